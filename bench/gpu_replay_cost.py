"""What a CUDA graph replay costs the host: every replay of `--steps` steady engine steps timed
on the host (perf_counter around CUDAGraph.replay, which only launches), by the graph's owner
(the target's pass, the drafter's context pass, the drafter's whole tree), once in steps as they
run and once with the device drained before each replay (the launch alone).

    python bench/gpu_replay_cost.py --method tree --concurrency 1 64
"""
from __future__ import annotations

import argparse
import collections
import json
import time
import traceback

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tandem/assets/pair/target")
    ap.add_argument("--draft", default="tandem/assets/pair/eagle3")
    ap.add_argument("--method", default="tree")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    pair = load_pair(args.target, args.draft if args.method != "ar" else None, "cuda", args.dtype,
                     need_draft=args.method != "ar")
    replay = torch.cuda.CUDAGraph.replay
    spent: dict[str, list[float]] = collections.defaultdict(list)
    drain = [False]

    def timed(self):
        caller = next((f"{f.filename.split('/tandem/')[-1]}:{f.name}" for f in reversed(traceback.extract_stack()[:-1])
                       if "/tandem/" in f.filename), "?")
        if drain[0]:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay(self)
        spent[caller].append(time.perf_counter() - t0)

    for c in args.concurrency:
        eng = Engine(pair.target, pair.draft if args.method != "ar" else None, pair.tokenizer,
                     EngineConfig(method=args.method, max_num_seqs=c, max_num_batched_tokens=max(2048, 33 * c),
                                  draft_gate=False))
        g = torch.Generator().manual_seed(0)
        for _ in range(c):
            eng.add_request(torch.randint(0, pair.target.config.vocab_size, (16,), generator=g).tolist(),
                            SamplingParams(max_tokens=10 ** 6, ignore_eos=True))
        for _ in range(10):
            eng.step()
        torch.cuda.CUDAGraph.replay = timed
        try:
            for mode in (False, True):
                spent.clear()
                drain[0] = mode
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    eng.step()
                torch.cuda.synchronize()
                step_ms = (time.perf_counter() - t0) / args.steps * 1e3
                print(json.dumps({"C": c, "drained": mode, "step_ms": round(step_ms, 3),
                                  "replay_us": {k: [len(v), round(1e6 * sum(v) / len(v), 1)] for k, v in spent.items()}}))
        finally:
            torch.cuda.CUDAGraph.replay = replay
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
