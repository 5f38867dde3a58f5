"""Where the device-resident loop's step spends its GPU time (bundled pair + a drafter).

Per graph (draft, verify): the mean replay time over 200 replays (CUDA events, the state
restored before each), then a torch.profiler table of one eager run of each body: kernels
by device time, and the kernel count (at this size a step is bound by kernel count, not work).
    python bench/gpu_profile_resident.py [--kind block|eagle3|draft] [--dtype bfloat16] [--nodes 32]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator
from tandem.runtime.pair import load_pair


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--kind", default="block", choices=["block", "eagle3", "draft"])
    a = ap.parse_args()
    pair = load_pair(None, a.kind, "cuda", a.dtype)
    gen = Generator(pair.target, pair.draft, pair.tokenizer)
    ids = pair.tokenizer.encode("def merge_sort(xs):\n    \"\"\"Sort a list.\"\"\"\n").ids
    g = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    for m, spec in (("tree", SpecConfig(nodes=a.nodes)), ("chain", SpecConfig(k=8)), ("ar", SpecConfig())):
        gen.generate(ids, m, spec, gen=g)
        r = gen.generate(ids, m, spec, gen=g)
        print(f"{m}: {r.decode_tokens_per_s:.0f} tok/s, tau {r.tau:.2f}")
    target = gen._runners["target"]
    loops = [v[1] for k, v in target.attached.items() if isinstance(k, tuple) and k[0] == "resident"]
    for loop in loops:
        key = (loop.kind, "chain" if loop.chain else "tree", loop.M - 1)
        saved = [t.clone() for t in loop._state()]
        for (part, width, *_), graph in sorted(loop._graphs.items(), key=lambda kv: kv[0][:2]):
            times = []
            for _ in range(200):
                for t, v in zip(loop._state(), saved):
                    t.copy_(v)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            times.sort()
            print(f"{key} {part} width {width}: replay median {1e3 * times[100]:.1f} us")
        for part in ("draft", "verify") if loop.d is not None else ("verify",):
            width = min(k[1] for k in loop._graphs if k[0] == part)
            body = loop._draft_body if part == "draft" else loop._verify_body
            with torch.no_grad():
                for t, v in zip(loop._state(), saved):
                    t.copy_(v)
                body(width)
                torch.cuda.synchronize()
                for t, v in zip(loop._state(), saved):  # (restored outside the profile: its copies are not the body's)
                    t.copy_(v)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    body(width)
                    torch.cuda.synchronize()
            ev = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
            n = sum(e.count for e in ev if "Memcpy" not in e.key)
            total = sum(e.self_device_time_total for e in ev)
            print(f"\n{key} {part}: {n} kernels, {total:.0f} us of kernel time (eager, one run)")
            for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:14]:
                print(f"  {e.self_device_time_total:8.1f} us  x{e.count:<3d} {e.key[:90]}")
        for t, v in zip(loop._state(), saved):
            t.copy_(v)


if __name__ == "__main__":
    main()
