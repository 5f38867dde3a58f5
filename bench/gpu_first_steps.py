"""A request's first token: the engine's first steps, timed one by one, for C prompts submitted
together to a fresh engine, twice (round 2 shows what round 1 paid once: captures, compiles).

    python bench/gpu_first_steps.py --method tree --concurrency 8 --data-dir .data

Prints per step: wall ms, rows, requests with a first token so far.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.bench.workloads import load_workload
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tandem/assets/pair/target")
    ap.add_argument("--draft", default="tandem/assets/pair/eagle3")
    ap.add_argument("--method", default="tree")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--data-dir", default=".data")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    pair = load_pair(args.target, args.draft if args.method != "ar" else None, args.device, args.dtype,
                     need_draft=args.method != "ar")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for c in args.concurrency:
        prompts = [pair.tokenizer.encode(p.text).ids[-256:] for p in load_workload("mbpp", 2 * c, args.data_dir)]
        eng = Engine(pair.target, pair.draft if args.method != "ar" else None, pair.tokenizer,
                     EngineConfig(method=args.method, max_num_seqs=c, max_num_batched_tokens=max(2048, 33 * c),
                                  draft_gate=False))
        for rnd, batch in enumerate((prompts[:c], prompts[c:])):
            sync()
            t0 = time.perf_counter()
            reqs = [eng.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in batch]
            steps = []
            for _ in range(args.steps):
                s0 = time.perf_counter()
                eng.step()
                sync()
                rec = eng.counters.records[-1]
                steps.append({"ms": round(1e3 * (time.perf_counter() - s0), 2), "rows": rec.rows,
                              "first": sum(1 for r in reqs if r.output_ids)})
            ttft = [round(1e3 * r.figures.ttft, 2) for r in reqs if r.figures.ttft is not None]
            print(json.dumps({"method": args.method, "C": c, "round": rnd + 1, "steps": steps,
                              "ttft_ms_max": max(ttft) if ttft else None, "since_submit_ms":
                              round(1e3 * (time.perf_counter() - t0), 2)}))
            while eng.has_unfinished():
                eng.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
