"""Where the batched engine's step time goes: host functions (cProfile, sorted by own time) and
wall time per step, for a method / drafter / concurrency on the bundled pair.

    python bench/gpu_profile_engine.py --draft draft --method tree --concurrency 1 [--top 30] [--no-drafting]

The GPU runs asynchronously, so host time in a function includes its kernel launches and any
device sync it waits on (a `.tolist()` read-back waits for the pass before it).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from dataclasses import replace

import torch

from tandem.config import SpecConfig
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--method", default="tree")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-drafting", action="store_true",
                    help="every step plain (as the draft gate's off steps): what a drafting engine's plain step costs")
    args = ap.parse_args()
    pair = load_pair(None, None if args.draft == "draft" else args.draft, args.device, args.dtype,
                     need_draft=args.method != "ar")
    cfg = EngineConfig(method=args.method, max_num_seqs=max(args.concurrency, 1), draft_gate=False)
    if args.draft in ("block",):
        cfg = replace(cfg, spec=SpecConfig(method=args.method))
    eng = Engine(pair.target, pair.draft, pair.tokenizer, cfg)
    if args.no_drafting:
        eng._forced = False
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def run() -> tuple[float, int]:
        for _ in range(args.concurrency):
            eng.add_request(torch.randint(10, 8000, (64,), generator=g).tolist(), params)
        n0, t0 = eng.steps, time.perf_counter()
        eng.run()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, eng.steps - n0

    run()  # warm-up (graphs, Triton compiles)
    wall, steps = run()
    tokens = args.concurrency * args.max_tokens
    print(f"{args.draft} {args.method} C={args.concurrency}: {wall / steps * 1e3:.3f} ms/step, {steps} steps, "
          f"{tokens / wall:.1f} tok/s (no profiler)")
    # the step's pieces, each between two device syncs (the syncs add a little to each)
    phases: dict[str, float] = {}

    def timed(obj, name: str, label: str):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            phases[label] = phases.get(label, 0.0) + time.perf_counter() - t0
            return out
        setattr(obj, name, wrapper)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    timed(eng.scheduler, "plan_step", "plan")
    timed(eng, "_batched_drafts", "draft (batched)")
    timed(eng, "_rows", "target rows (trees -> packed)")
    timed(eng.model, "forward", "target pass")
    timed(eng, "_apply", "accept, commit, emit")
    timed(eng, "_gate_drafts", "gate")
    if eng.batched is not None:
        timed(eng.batched, "_roots", "  draft: catch-up / context pass")
    wall, steps = run()
    print(f"with synced phases: {wall / steps * 1e3:.3f} ms/step")
    for k, v in phases.items():
        print(f"  {k:40s} {v / steps * 1e3:8.3f} ms/step")
    for obj in (eng.scheduler, eng, eng.model) + ((eng.batched,) if eng.batched is not None else ()):
        for k in [k for k in vars(obj) if k in ("plan_step", "_batched_drafts", "_rows", "forward", "_apply", "_roots",
                                                 "_gate_drafts")]:
            delattr(obj, k)  # the plain methods again
    pr = cProfile.Profile()
    pr.enable()
    wall, steps = run()
    pr.disable()
    print(f"under cProfile: {wall / steps * 1e3:.3f} ms/step")
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(args.top)
    st.sort_stats("cumtime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
