"""A warm engine's first decode step of a new request, against its steady steps: per step wall
ms (synchronized) for `--requests` MBPP prompts served one at a time (concurrency 1) after a
warm-up, the CUDA graphs captured during each step, and a cProfile of the first decode steps
(top functions by cumulative time). What a request's TTFT pays beyond its prefill.

    python bench/gpu_first_decode.py --method tree --data-dir .data
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from tandem.bench.workloads import load_workload
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair


def graphs(eng: Engine) -> int:
    """CUDA graphs (or emulated buckets) this engine's models hold."""
    models = [eng.model] + ([eng.batched.model] if eng.batched is not None else [])
    n = sum(len(m._graphs) + len(m._input_graphs) for m in models)
    return n + (len(getattr(eng.batched, "_tree", {}) or {}) if eng.batched is not None else 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tandem/assets/pair/target")
    ap.add_argument("--draft", default="tandem/assets/pair/eagle3")
    ap.add_argument("--method", default="tree")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--data-dir", default=".data")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--steps", type=int, default=6, help="steps timed per request (prefill first)")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    pair = load_pair(args.target, args.draft if args.method != "ar" else None, args.device, args.dtype,
                     need_draft=args.method != "ar")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    eng = Engine(pair.target, pair.draft if args.method != "ar" else None, pair.tokenizer,
                 EngineConfig(method=args.method, max_num_seqs=1, max_num_batched_tokens=2048, draft_gate=False))
    eng.warmup_request()
    prompts = [pair.tokenizer.encode(p.text).ids[-256:] for p in load_workload("mbpp", 2 * args.requests + 4,
                                                                              args.data_dir)]
    for p in prompts[-4:]:  # (served whole: the captures a workload's first requests pay)
        eng.add_request(p, SamplingParams(max_tokens=64, ignore_eos=True))
        eng.run()
    prof = cProfile.Profile()
    table: list[list[float]] = []
    for i, p in enumerate(prompts[:2 * args.requests]):
        profiled = i % 2 == 1  # (every other request: the timed ones run without the profiler)
        req = eng.add_request(p, SamplingParams(max_tokens=128, ignore_eos=True))
        row = []
        for k in range(args.steps):
            g0 = graphs(eng)
            sync()
            t0 = time.perf_counter()
            if profiled and k == 1:
                prof.enable()
            eng.step()
            sync()
            if profiled and k == 1:
                prof.disable()
            row.append(1e3 * (time.perf_counter() - t0))
            if graphs(eng) != g0:
                print(json.dumps({"request": i, "step": k, "graphs_captured": graphs(eng) - g0}))
        if not profiled:
            table.append(row)
            print(json.dumps({"request": i, "prompt": len(p), "steps_ms": [round(x, 3) for x in row],
                              "ttft_ms": round(1e3 * req.figures.ttft, 3)}))
        eng.abort(req.request_id)
    med = [round(statistics.median(r[k] for r in table), 3) for k in range(args.steps)]
    print(json.dumps({"method": args.method, "median_steps_ms": med}))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(args.top)
    print(f"== cProfile of {args.requests} first decode steps, by cumulative time")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:14000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
