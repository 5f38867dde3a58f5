"""First look at the batched engine's throughput by concurrency (not yet `tandem bench --concurrency`).

    python bench/engine_concurrency.py --device cuda --methods ar,tree --concurrency 1,8,32,64 --out $OUT

For each method and concurrency C: C requests (the GPU-lane prompts, cycled) of --max-tokens new
tokens each, greedy, submitted together; one warm-up run first. Prints and writes (JSON) total
new tokens / wall seconds, steps, mean tau and median TTFT. Every output is checked against the
method `ar` output of the same prompt at concurrency 1 (exact token equality, counted).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
from gpu_lane import PROMPTS  # noqa: E402

from tandem.config import SpecConfig  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.engine.request import SamplingParams  # noqa: E402
from tandem.runtime.pair import load_pair  # noqa: E402


def run(pair, method: str, prompts: list[list[int]], max_tokens: int, nodes: int) -> dict:
    cfg = EngineConfig(method=method, spec=SpecConfig(nodes=nodes, width=4), max_num_seqs=max(1, len(prompts)))
    engine = Engine(pair.target, pair.draft if method != "ar" else None, pair.tokenizer, cfg)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)).request_id for p in prompts]
    if pair.target.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = {o.request_id: o for o in engine.run()}
    if pair.target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    outs = [outs[i] for i in ids]
    return {"method": method, "concurrency": len(prompts), "seconds": seconds, "steps": engine.steps,
            "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
            "tau": statistics.mean(o.tau for o in outs),
            "ttft_median_ms": 1e3 * statistics.median(o.figures.ttft for o in outs),
            "token_ids": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--methods", default="ar,tree")
    ap.add_argument("--concurrency", default="1,8,16,32,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    pair = load_pair(device=a.device, dtype=a.dtype)
    base = [pair.tokenizer.encode(p).ids for p in PROMPTS]
    ref = {i: run(pair, "ar", [p], a.max_tokens, a.nodes)["token_ids"][0] for i, p in enumerate(base)}
    rows = []
    for method in a.methods.split(","):
        for c in (int(x) for x in a.concurrency.split(",")):
            prompts = [base[i % len(base)] for i in range(c)]
            run(pair, method, prompts, a.max_tokens, a.nodes)  # warm-up
            r = run(pair, method, prompts, a.max_tokens, a.nodes)
            r["equal_to_ar"] = sum(t == ref[i % len(base)] for i, t in enumerate(r.pop("token_ids")))
            rows.append(r)
            print(f"{method:5s} C={c:3d}  {r['tokens_per_s']:9.1f} tok/s  steps {r['steps']:4d}  tau {r['tau']:.2f}  "
                  f"TTFT {r['ttft_median_ms']:.1f} ms  equal to ar {r['equal_to_ar']}/{c}", flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "engine_concurrency.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
