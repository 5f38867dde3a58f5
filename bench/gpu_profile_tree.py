"""Where a tree pass spends host time: cProfile over `tree` (and `ar`) on the bundled pair.

    python bench/gpu_profile_tree.py --out $OUT        (device tool: carry .data)
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

from pair_script import pair_and_prompts, parser

from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator


def main():
    ap = parser(__doc__, num_prompts=6)
    ap.add_argument("--methods", default="ar,tree,async")
    args = ap.parse_args()
    pair, prompts = pair_and_prompts(args)
    g = Generator(pair.target, pair.draft, pair.tokenizer)
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
