"""Recompute a bench results.json's summary with the current harness, rewrite results.md.

    python bench/rerender.py bench/results/h200-2026-11-29/bench_mbpp

Used when the summary rules change after a GPU run (the per-request figures stay as measured).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tandem.bench.env import read_json  # noqa: E402
from tandem.bench.harness import Request, markdown_table, summarize_method  # noqa: E402


def main(folder: str) -> None:
    path = Path(folder) / "results.json"
    if not path.exists():  # older results are kept gzipped
        path = path.with_suffix(".json.gz")
    results = read_json(path, "results")
    names = {f.name for f in dataclasses.fields(Request)}
    by: dict[str, list[Request]] = {}
    for rec in results["requests"]:
        r = Request(**{k: v for k, v in rec.items() if k in names})
        r.per_depth = [tuple(x) for x in r.per_depth]
        by.setdefault(r.method, []).append(r)
    for m, reqs in by.items():
        results["summary"][m] = summarize_method(reqs)
    text = json.dumps(results, indent=1)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    (Path(folder) / "results.md").write_text(markdown_table(results))
    print(markdown_table(results))


if __name__ == "__main__":
    for f in sys.argv[1:]:
        main(f)
