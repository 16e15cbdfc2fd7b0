"""JAX frontend tests run on 8 simulated CPU devices: the flag must be set before jax loads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MODELS = Path(__file__).resolve().parent  # test-only models (gqa_decoder.py)
for folder in (EXAMPLES, MODELS):  # the examples double as test models (make() factories)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
