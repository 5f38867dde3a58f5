"""Does Python's garbage collector pause the engine's steps? Engine steps of `--concurrency`
requests arriving as others finish (a tiny model on the CPU, so Python dominates), each
collection timed through `gc.callbacks`; `--freeze` collects and freezes first (vLLM's habit).

    PYTHONPATH=$PWD:$PWD/tests python -c "from conftest import save_tiny_checkpoint; \
        save_tiny_checkpoint('/tmp/tiny2','llama',max_position_embeddings=1024)"
    PYTHONPATH=$PWD python bench/cpu_gc_probe.py --target /tmp/tiny2 --method ar
    PYTHONPATH=$PWD python bench/cpu_gc_probe.py --target /tmp/tiny2 --method tree --freeze
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="/tmp/tiny2")
    ap.add_argument("--method", default="ar", choices=("ar", "tree"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--freeze", action="store_true")
    args = ap.parse_args()
    spec = args.method != "ar"
    pair = load_pair(args.target, args.target if spec else None, "cpu", "float32", need_draft=spec)
    eng = Engine(pair.target, pair.draft, None, EngineConfig(method=args.method, max_num_seqs=args.concurrency))
    pauses: list[tuple[int, float]] = []
    t0 = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - t0[0]))

    if args.freeze:
        gc.collect()
        gc.freeze()
        pauses.clear()
    gc.callbacks.append(timed)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def submit() -> None:
        n = int(torch.randint(8, 128, (), generator=g))
        eng.add_request(torch.randint(0, 200, (n,), generator=g).tolist(), params)

    submitted = 0
    for _ in range(args.concurrency):
        submit()
        submitted += 1
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter()
        for _ in eng.step():
            if submitted < args.requests:
                submit()
                submitted += 1
        steps.append(time.perf_counter() - t)
    gc.callbacks.remove(timed)
    steps.sort()
    n = len(steps)
    print(f"{args.method}{' (frozen)' if args.freeze else ''}: {n} steps, p50 {steps[n // 2] * 1e3:.2f} ms, "
          f"p99 {steps[int(n * 0.99)] * 1e3:.2f} ms")
    for gen in sorted({gen for gen, _ in pauses}):
        ds = [d for g_, d in pauses if g_ == gen]
        print(f"  generation {gen}: {len(ds)} collections, longest {max(ds) * 1e3:.2f} ms, total {sum(ds) * 1e3:.1f} ms")
    if not pauses:
        print("  no collections")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
