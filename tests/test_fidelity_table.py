"""The one fidelity table (issue 41): every fidelity figure from the benches' records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fidelity_table

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "bench" / "records").glob("*.json"))


def test_committed_records_make_one_consistent_table():
    """Each committed record validates; every row's error is its predicted over published."""
    assert {p.stem for p in RECORDS} >= {
        "fidelity",
        "fidelity_moe",
        "fidelity_recsys",
        "serving_fidelity",
    }
    rows = fidelity_table.load(RECORDS)
    kinds = {r["kind"] for r in rows}
    assert {
        "dense training",
        "CNN training",
        "MoE training",
        "recsys training",
        "serving (engine of record)",
    } <= kinds
    assert sum(r["kind"] == "dense training" for r in rows) == 19
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted"] / r["published"] - 1, abs=1e-9)
    table = fidelity_table.table(rows)
    assert table.count("\n") == len(rows) + 1  # header, rule, one line per row
    assert "dense training: 19 rows" in fidelity_table.summary(rows)


def test_a_record_of_another_bench_is_refused(tmp_path):
    record = json.loads(RECORDS[0].read_text())
    record["benchmark"] = "scale"
    with pytest.raises(ValueError, match="not a fidelity bench"):
        fidelity_table.rows_of(record)
    del record["results"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(record))
    assert fidelity_table.main([str(path)]) == 2
