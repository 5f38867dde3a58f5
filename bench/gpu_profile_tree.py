"""Where a tree pass spends host time: cProfile over `tree` (and `ar`) on the bundled pair.

    python bench/gpu_profile_tree.py --out $OUT        (device tool: carry .data)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tandem.bench.workloads import load_workload  # noqa: E402
from tandem.config import GenerationConfig, SpecConfig  # noqa: E402
from tandem.runtime.generate import Generator  # noqa: E402
from tandem.runtime.pair import load_pair  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-dir", default=".data")
    ap.add_argument("--methods", default="ar,tree,async")
    ap.add_argument("--num-prompts", type=int, default=6)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pair = load_pair(device=args.device, dtype="float32")
    g = Generator(pair.target, pair.draft, pair.tokenizer)
    prompts = [pair.tokenizer.encode(p.text).ids for p in load_workload("mbpp", args.num_prompts, args.data_dir)]
    gen = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    for method in args.methods.split(","):
        for p in prompts[:2]:
            g.generate(p, method, SpecConfig(), gen=gen)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        passes = tokens = 0
        prof.enable()
        for p in prompts:
            r = g.generate(p, method, SpecConfig(), gen=gen)
            passes += r.target_passes
            tokens += len(r.token_ids)
        prof.disable()
        dt = time.perf_counter() - t0
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats("tandem", 22)
        head = f"== {method}: {tokens / dt:.0f} tok/s (profiled), {passes} passes, {1e3 * dt / passes:.3f} ms/pass"
        print(head)
        with open(os.path.join(args.out, f"profile_{method}.txt"), "w") as f:
            f.write(head + "\n" + s.getvalue())
        print("\n".join(ln[:150] for ln in s.getvalue().splitlines() if ln.strip() and "Ordered" not in ln))


if __name__ == "__main__":
    main()
