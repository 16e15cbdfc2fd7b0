#!/usr/bin/env bash
# Set up (idempotent; headless Chromium too, from Debian packages when absent), then run the
# whole test suite: every marker (torch, jax, slow) included.
# Extra arguments go to pytest (e.g. -x, -k serialize, tests/solver).
# Tests run in one worker process per core (pytest-xdist), at most 4, whole files per worker so a
# file's shared captures are made once; SHARDPLAN_TEST_WORKERS=0 runs them in this process.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
./scripts/install_browser.sh   # headless Chromium for the HTML report's browser tests
cores="$(nproc 2>/dev/null || echo 2)"
workers="${SHARDPLAN_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
exec .venv/bin/pytest -n "$workers" --dist loadfile "$@"
