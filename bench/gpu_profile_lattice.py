"""Where a `tree` pass with the block drafter spends its time on the GPU (host-bound steps).

Per phase (propose / verify / observe / emit) wall time with a sync on both sides, then a
cProfile of an unsynced run (top functions by own time), for tree and ar.
    python bench/gpu_profile_lattice.py [--draft block] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict

import torch

from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime import generate as G
from tandem.runtime.pair import load_pair

PROMPTS = ["def fib(n):\n", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
           "def merge_sort(xs):\n    \"\"\"Sort a list.\"\"\"\n", "def parse_args(argv):\n    import argparse\n"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="block")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--nodes", type=int, default=32)
    a = ap.parse_args()
    pair = load_pair(None, a.draft, "cuda", a.dtype)
    gen = G.Generator(pair.target, pair.draft, pair.tokenizer)
    spec = SpecConfig(nodes=a.nodes)
    g = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    ids = [pair.tokenizer.encode(p).ids for p in PROMPTS]
    for m in ("ar", "tree"):  # warm-up: graphs captured
        gen.generate(ids[0], m, spec, gen=g)
    for m in ("ar", "chain", "tree"):
        t = time.perf_counter()
        n = sum(gen.generate(p, m, spec, gen=g).new_tokens for p in ids)
        torch.cuda.synchronize()
        print(f"{m}: {n / (time.perf_counter() - t):.1f} tok/s over {len(ids)} prompts")
    # per-phase, synced
    acc = defaultdict(float)
    cnt = defaultdict(int)

    def timed(name, fn):
        def w(*args, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn(*args, **kw)
            torch.cuda.synchronize()
            acc[name] += time.perf_counter() - t0
            cnt[name] += 1
            return r
        return w

    from tandem.drafting.lattice_drafter import LatticeDrafter
    import tandem.drafting.lattice_drafter as LD
    orig = (LatticeDrafter.propose, LatticeDrafter.observe, G.Target.verify, G.Emitter.emit, LD.best_first_tree,
            LD.unpack_lattice)
    LatticeDrafter.propose = timed("draft.propose", orig[0])
    LatticeDrafter.observe = timed("draft.observe", orig[1])
    G.Target.verify = timed("target.verify", orig[2])
    G.Emitter.emit = timed("emit", orig[3])
    LD.best_first_tree = timed("  best_first_tree (host)", orig[4])
    LD.unpack_lattice = timed("  unpack_lattice (D2H)", orig[5])
    for p in ids:
        gen.generate(p, "tree", spec, gen=g)
    passes = cnt["target.verify"]
    print(f"per pass (synced), {passes} passes:")
    for k in acc:
        print(f"  {k}: {acc[k] / passes * 1e3:.3f} ms")
    (LatticeDrafter.propose, LatticeDrafter.observe, G.Target.verify, G.Emitter.emit, LD.best_first_tree,
     LD.unpack_lattice) = orig
    for m in ("ar", "tree"):
        pr = cProfile.Profile()
        pr.enable()
        for p in ids:
            gen.generate(p, m, spec, gen=g)
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print(f"==== cProfile {m}\n" + "\n".join(s.getvalue().splitlines()[:45]))


if __name__ == "__main__":
    main()
