#!/usr/bin/env bash
# The main job: set up (idempotent), then plan the shipped example on a 2x4 H100 mesh and print it.
# Extra arguments go to `shardplan plan` (e.g. --out plan.json, --memory-limit 40GB).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
exec .venv/bin/shardplan plan examples/mlp_graph.py:make --mesh dp=2,tp=4 --cluster h100-sxm "$@"
