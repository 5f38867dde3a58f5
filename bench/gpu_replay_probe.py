"""Host seconds of each CUDA graph replay call in the engine's decode steps, by graph (the
target's pass, the drafter's context pass, the drafter's whole level tree), with and without a
device synchronize just before each call. A replay that costs the host much more than a launch
(~20 us) either waits for the device (then the synchronized variant is cheap) or pays for its
own size (then it is not).

    python bench/gpu_replay_probe.py --draft tandem/assets/pair/eagle3 --method tree --concurrency 8 64
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

import cpu_profile_engine as cpe  # (bench/ on sys.path when run as a script)


def probe(eng, concurrency: int, steps: int, sync: bool) -> dict:
    stats: dict = collections.defaultdict(list)
    orig = torch.cuda.CUDAGraph.replay
    names = {}
    d = eng.batched
    for b, g in getattr(eng.model, "_graphs", {}).items():
        if getattr(g, "graph", None) is not None:
            names[id(g.graph)] = f"target rows<={b}"
    if d is not None:
        for b, g in getattr(d, "_trees", {}).items():
            if getattr(g, "graph", None) is not None:
                names[id(g.graph)] = f"tree R<={b}"
        for b, g in getattr(d.model, "_input_graphs", {}).items():
            if getattr(g, "graph", None) is not None:
                names[id(g.graph)] = f"draft context rows<={b}"

    def replay(self):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        orig(self)
        stats[names.get(id(self), f"graph {id(self) % 10000}")].append(time.perf_counter() - t0)

    torch.cuda.CUDAGraph.replay = replay
    try:
        cpe.decode_steps(eng, concurrency, steps, 7)
    finally:
        torch.cuda.CUDAGraph.replay = orig
    return stats


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tandem/assets/pair/target")
    ap.add_argument("--draft", default="tandem/assets/pair/eagle3")
    ap.add_argument("--method", default="tree")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    args.device, args.dtype, args.graphs = "cuda", "bfloat16", "emulate"
    for c in args.concurrency:
        eng = cpe.build(args, c)
        cpe.decode_steps(eng, c, 20, 99)  # warm-up (captures)
        for sync in (False, True):
            stats = probe(eng, c, args.steps, sync)
            for name, ts in sorted(stats.items()):
                ts = sorted(ts)
                print(f"{args.method} C={c} sync={int(sync)} {name}: {len(ts)} replays, host us median "
                      f"{ts[len(ts) // 2] * 1e6:.1f}, max {ts[-1] * 1e6:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
