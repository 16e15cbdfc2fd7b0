#!/usr/bin/env bash
# Set up (idempotent; headless Chromium too, from Debian packages when absent), then run the
# whole test suite: every marker (torch, jax, slow) included.
# Extra arguments go to pytest (e.g. -x, -k serialize, tests/solver).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
./scripts/install_browser.sh   # headless Chromium for the HTML report's browser tests
exec .venv/bin/pytest "$@"
