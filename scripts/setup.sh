#!/usr/bin/env bash
# Set up shardplan from nothing: a virtual environment in .venv with the pinned, tested versions of
# everything (torch CPU, jax CPU, OR-Tools, test tools). Idempotent: a second run that finds the
# same constraints, pyproject and checkout returns in well under a second.
#
#   ./scripts/setup.sh            # create or update .venv
#   PYTHON=python3.12 ./scripts/setup.sh   # choose the interpreter (3.11 is what CI tests)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.shardplan-setup"

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.11 python3 python; do
        [[ -n "$candidate" ]] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "setup: shardplan needs Python >= 3.11 (3.11 is tested); set PYTHON=/path/to/python3.11" >&2
    return 1
}

# What the environment was built from: when none of it changed, there is nothing to do.
fingerprint() {
    {
        echo "$root"
        "$venv/bin/python" --version 2>&1
        cat constraints.txt pyproject.toml
    } | sha256sum | cut -d' ' -f1
}

if [[ ! -x "$venv/bin/python" ]]; then
    python="$(find_python)"
    echo "setup: creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
fi

# Byte-code for the checkout's own modules (the editable install is imported from source): where
# PYTHONDONTWRITEBYTECODE is set, as on this project's machines, Python would otherwise compile
# every shardplan module again in every process (~1 CPU s for all of them; a third of that inside
# the first `sp.plan` call, and again in every example script and test worker). Incremental: only
# files changed since the last run are compiled; a stale file is still compiled in memory.
compile_sources() {
    "$venv/bin/python" -m compileall -q -l "$root" >/dev/null   # the top-level modules
    "$venv/bin/python" -m compileall -q "$root"/*/ >/dev/null      # the packages (not .venv)
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$(fingerprint)" && -x "$venv/bin/shardplan" ]]; then
    compile_sources
    exit 0
fi

echo "setup: installing pinned dependencies into .venv (first run takes a few minutes)"
# The filter drops one harmless line per package that some machines' pip configuration prints
# (an extra index folder that is absent); every other message gets through.
pip_install() {
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
        2> >(grep -v -e "is ignored: it is neither a file nor a directory" >&2)
}
pip_install -c constraints.txt pip setuptools
# setuptools warns on every editable install of a package whose directory is the project root
# (this one's, by design: docs/design.md); the message says nothing the user can act on.
PYTHONWARNINGS="ignore:Editable installation" pip_install -c constraints.txt \
    -e ".[torch,jax,dev,recsys,torchtitan]"
# torchrec without its declared fbgemm-gpu (a CUDA build that would overwrite fbgemm-gpu-cpu's
# files); its other dependencies come with the recsys extra above.
pip_install -c constraints.txt --no-deps torchrec
fingerprint >"$stamp"
compile_sources
echo "setup: done ($("$venv/bin/python" -c 'import shardplan; print("shardplan", shardplan.__version__)'))"
