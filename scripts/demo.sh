#!/usr/bin/env bash
# The main job: set up (idempotent), then plan a Llama-3.2-1B-shaped HF model (meta device) on a
# 2x4 H100 mesh and print the plan.
# Extra arguments go to `shardplan plan` (e.g. --out plan.json, --memory-limit 40GB).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
exec .venv/bin/shardplan plan examples/llama_demo.py:make --mesh dp=2,tp=4 --cluster h100-sxm "$@"
