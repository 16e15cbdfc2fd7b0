"""Plan digests: the SHA-256 of a plan's JSON, recorded per test module under ``tests/digests/``.

A refactor that must not change any plan (issue 39) is held to it here: every emission-matrix
cell, the demo and the ``bench/scale.py --quick`` rows check their plan's digest against the
recorded one. After a change that is meant to change plans, re-record with
``SHARDPLAN_UPDATE_DIGESTS=1 ./scripts/test.sh <the tests>`` and commit the JSON files (each
module writes its own file, so xdist's ``--dist loadfile`` workers never share one).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DIGESTS = ROOT / "digests"
UPDATE = os.environ.get("SHARDPLAN_UPDATE_DIGESTS") == "1"
_LOADED: dict[Path, dict[str, str]] = {}


def _file(test_file: str) -> Path:
    rel = Path(test_file).resolve().relative_to(ROOT).with_suffix("")
    return DIGESTS / ("__".join(rel.parts) + ".json")


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_text(test_file: str, key: str, text: str) -> None:
    """Assert ``text``'s digest is the one recorded for ``key`` (record it when updating)."""
    path = _file(test_file)
    if path not in _LOADED:
        _LOADED[path] = json.loads(path.read_text()) if path.exists() else {}
    recorded = _LOADED[path]
    got = digest(text)
    if UPDATE:
        if recorded.get(key) != got:
            recorded[key] = got
            DIGESTS.mkdir(exist_ok=True)
            path.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")
        return
    assert key in recorded, (
        f"no recorded plan digest for {key!r} in {path.name}; record it with "
        "SHARDPLAN_UPDATE_DIGESTS=1 (see tests/plan_digests.py)"
    )
    assert recorded[key] == got, (
        f"the plan of {key!r} changed (digest {got[:12]}, recorded {recorded[key][:12]}); "
        "if the change is meant, re-record with SHARDPLAN_UPDATE_DIGESTS=1"
    )


def check_plan(test_file: str, key: str, plan: object) -> None:
    check_text(test_file, key, plan.to_json())  # type: ignore[attr-defined]
