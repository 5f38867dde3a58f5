"""Where the host's time goes in steady decode steps: cProfile over `--steps` engine steps of C
requests (random 16-token prompts, no EOS), the top functions by own time. The profiler's
per-call cost inflates functions that make many small calls; read it for ranks, not for totals.

    python bench/gpu_host_profile.py --method tree --concurrency 1 64
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

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
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    pair = load_pair(args.target, args.draft if args.method != "ar" else None, args.device, args.dtype,
                     need_draft=args.method != "ar")
    for c in args.concurrency:
        eng = Engine(pair.target, pair.draft if args.method != "ar" else None, pair.tokenizer,
                     EngineConfig(method=args.method, max_num_seqs=c, max_num_batched_tokens=max(2048, 33 * c),
                                  draft_gate=False))
        g = torch.Generator().manual_seed(0)
        vocab = pair.target.config.vocab_size
        for _ in range(c):
            eng.add_request(torch.randint(0, vocab, (16,), generator=g).tolist(),
                            SamplingParams(max_tokens=10 ** 6, ignore_eos=True))
        for _ in range(10):
            eng.step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            eng.step()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"== {args.method} C={c}: {args.steps} steps")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:12000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
