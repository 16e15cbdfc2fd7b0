"""One fidelity table from the fidelity benches' records (issue 41, point 4).

    .venv/bin/python bench/fidelity.py --cnn --record fidelity.json
    .venv/bin/python bench/fidelity_moe.py --record moe.json
    .venv/bin/python bench/fidelity_recsys.py --record recsys.json
    .venv/bin/python bench/serving_fidelity.py --record serving.json
    .venv/bin/python bench/fidelity_table.py fidelity.json moe.json serving.json

Each record (``records.py``, ``record.schema.json``) is validated, its rows are normalised to
(source, configuration, published, predicted, error) and printed as one Markdown table, then
one summary line per kind of row (dense training, MoE training, convolutional training,
recommendation training, serving with the engine of record, serving eager).
``docs/costmodel.md`` holds the table and the README quotes the summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from shardplan.api.records import validate_record


def _training(r: dict) -> dict:
    config = f"{r['row']}, TP {r['tp']} PP {r['pp']} DP {r['dp']}, {r['cluster']}"
    return {"kind": "dense training", "source": r["source"], "configuration": config,
            "published": r["published_s"], "predicted": r["predicted_s"], "unit": "s/step",
            "error": r["error"]}  # fmt: skip


def _cnn(r: dict) -> dict:
    return {"kind": "CNN training", "source": r["source"],
            "configuration": f"{r['row']}, 8 GPUs, {r['cluster']}", "published": r["published_s"],
            "predicted": r["product_s"], "unit": "s/step", "error": r["product_error"]}  # fmt: skip


def _recsys(r: dict) -> dict:
    return {"kind": "recsys training", "source": r["source"],
            "configuration": f"{r['row']}, {r['gpus']} GPUs, {r['cluster']}",
            "published": r["published_s"], "predicted": r["product_s"], "unit": "s/step",
            "error": r["product_error"]}  # fmt: skip


def _moe(r: dict) -> dict:
    return {"kind": "MoE training", "source": r.get("source", ""), "configuration": r["label"],
            "published": r["published_s"], "predicted": r["predicted_s"], "unit": "s/step",
            "error": r["error"]}  # fmt: skip


def _serving(r: dict) -> dict:
    kind = "serving (engine of record)" if r["of_record"] else f"serving ({r['engine']})"
    return {"kind": kind, "source": r["source"],
            "configuration": f"{r['configuration']}, engine {r['engine']}",
            "published": r["published"], "predicted": r["predicted"], "unit": r["unit"],
            "error": r["error"]}  # fmt: skip


def rows_of(record: dict) -> list[dict]:
    """A record's fidelity rows, normalised (unknown benchmarks: refused)."""
    bench, results = record["benchmark"], record["results"]
    if bench == "fidelity":
        return [_cnn(r) if "product_error" in r and "error" not in r else _training(r)
                for r in results]  # fmt: skip
    if bench == "fidelity_moe":
        return [_moe(r) for r in results]
    if bench == "fidelity_recsys":
        return [_recsys(r) for r in results]
    if bench == "serving_fidelity":
        return [_serving(r) for r in results]
    raise ValueError(f"record of {bench!r} is not a fidelity bench (fidelity, fidelity_moe, "
                     "fidelity_recsys, serving_fidelity)")  # fmt: skip


def load(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        record = json.loads(path.read_text())
        errors = validate_record(record)
        if errors:
            raise ValueError(f"{path} is not a valid record: {errors[0]}")
        rows += rows_of(record)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| source | configuration | published | predicted | error |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['configuration']} | {r['published']:.4g} "
                     f"{r['unit']} | {r['predicted']:.4g} | {r['error']:+.1%} |")  # fmt: skip
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """One line: per kind, rows, median |error|, worst and mean signed error."""
    parts = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        errors = [r["error"] for r in rows if r["kind"] == kind]
        worst = max(errors, key=abs)
        parts.append(f"{kind}: {len(errors)} rows, median |error| "
                     f"{statistics.median(abs(e) for e in errors):.1%}, worst {worst:+.1%}, "
                     f"mean {statistics.mean(errors):+.1%}")  # fmt: skip
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path)
    args = parser.parse_args(argv)
    try:
        rows = load(args.records)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(rows))
    print()
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
