"""The batched engine's step on the device: kernels by device time and count per step (torch
profiler, CUDA graphs included: their kernels are traced one by one), and the host time of each
graph replay call (a graph of many nodes costs host time to launch).

    python bench/gpu_profile_engine_kernels.py --draft eagle3 --method tree --concurrency 1 [--steps 20]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="eagle3")
    ap.add_argument("--method", default="tree")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    pair = load_pair(None, None if a.draft == "draft" else a.draft, a.device, "bfloat16" if a.device == "cuda" else "float32", need_draft=a.method != "ar")
    cfg = EngineConfig(method=a.method, max_num_seqs=a.concurrency, draft_gate=False)  # (every step drafts)
    eng = Engine(pair.target, pair.draft, pair.tokenizer, cfg)
    g = torch.Generator().manual_seed(0)

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    def add(n_tokens: int) -> None:
        for _ in range(a.concurrency):
            eng.add_request(torch.randint(10, 8000, (64,), generator=g).tolist(),
                            SamplingParams(max_tokens=n_tokens, ignore_eos=True))

    add(96)
    eng.run()  # warm-up: captures, compiles
    # host time of every CUDA graph replay call, by graph
    replays: dict[int, list[float]] = defaultdict(list)
    orig = torch.cuda.CUDAGraph.replay

    def timed_replay(self):
        t0 = time.perf_counter()
        orig(self)
        replays[id(self)].append(time.perf_counter() - t0)
    torch.cuda.CUDAGraph.replay = timed_replay
    add(400)
    for _ in range(3):
        eng.step()  # (prefill)
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    sync()
    wall = (time.perf_counter() - t0) / a.steps
    torch.cuda.CUDAGraph.replay = orig
    print(f"{a.draft} {a.method} C={a.concurrency}: {wall * 1e3:.3f} ms/step over {a.steps} steps")
    for k, v in sorted(replays.items(), key=lambda kv: -sum(kv[1])):
        v.sort()
        print(f"  graph {k % 100000:5d}: {len(v)} replays, host time per replay.replay() median {v[len(v) // 2] * 1e6:.0f} us")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            eng.step()
        sync()
    n_kernels = sum(e.count for e in prof.key_averages() if e.self_device_time_total > 0 and e.key not in ("",))
    dev_total = sum(e.self_device_time_total for e in prof.key_averages())
    print(f"device: {dev_total / a.steps:.0f} us of kernel time per step, ~{n_kernels / a.steps:.0f} device events per step")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=a.top, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
