#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite: every marker (torch, jax, slow) included.
# Extra arguments go to pytest (e.g. -x, -k serialize, tests/solver).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
exec .venv/bin/pytest "$@"
