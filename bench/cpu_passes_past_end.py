"""Passes the resident loop computes past a request's end, for each hold margin given (the
TANDEM_RESIDENT_HOLD values; 0: no hold), on the CPU: the loop's bodies run eagerly there (as in
the tests), so this counts what a GPU run queues and throws away; it times nothing.

    python bench/cpu_passes_past_end.py --data-dir ../shared/datasets --num-prompts 20 --holds 1,1.25,1.5,2,0

Bundled pair with its EAGLE-3 head, fp32, greedy, MBPP prompts (tandem.bench.workloads), 128 new tokens.
Prints, per method and setting, the mean passes past the end a request, the steps queued after the
loop had nothing in flight (stalls: each an idle gap on a GPU while the host reads and queues), and the
mean passes a request.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from tandem.bench.workloads import load_workload
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator
from tandem.runtime.pair import load_pair


def loops(gen: Generator) -> list:
    """The resident loops this generator's runners keep (tandem.runtime.resident.resident_loop)."""
    from tandem.runtime.resident import ResidentLoop

    found = []
    for runner in gen._runners.values():
        for v in getattr(runner, "attached", {}).values():
            loop = v[1] if isinstance(v, tuple) and len(v) == 2 else v
            if isinstance(loop, ResidentLoop) and loop not in found:
                found.append(loop)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/datasets")
    ap.add_argument("--workload", default="mbpp")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft", default="eagle3")
    ap.add_argument("--holds", default="1.5,0", help="TANDEM_RESIDENT_HOLD values, comma-separated (0: off)")
    ap.add_argument("--methods", default="ar,chain,tree")
    ap.add_argument("--out", default=None, help="a JSON file for the figures")
    args = ap.parse_args()
    pair = load_pair(None, args.draft, device="cpu", dtype="float32")
    prompts = [pair.tokenizer.encode(p.text).ids[-384:]  # (the GPU runs' --max-prompt-tokens)
               for p in load_workload(args.workload, args.num_prompts, args.data_dir)]
    gen = Generator(pair.target, pair.draft, use_graphs=False, resident=True)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows = []
    specs = {"ar": SpecConfig(), "chain": SpecConfig(k=5), "tree": SpecConfig(nodes=32, width=4)}
    for method in args.methods.split(","):
        spec = specs[method]
        for hold in args.holds.split(","):
            os.environ["TANDEM_RESIDENT_HOLD"] = hold
            res, stalls = [], []
            for ids in prompts:
                for loop in loops(gen):
                    loop.stalls = 0
                res.append(gen.generate(ids, method, spec, gen=cfg))
                stalls.append(sum(loop.stalls for loop in loops(gen)))  # (only the loop that ran it counted)
            row = {"method": method, "hold": float(hold), "requests": len(res),
                   "passes_past_end": statistics.mean(r.passes_past_end for r in res),
                   "passes": statistics.mean(r.target_passes for r in res),
                   "tokens": statistics.mean(len(r.token_ids) for r in res),
                   # steps queued after the device had run dry (a read-back's idle gap on a GPU each)
                   "stalls": statistics.mean(stalls)}
            rows.append(row)
            print(f"{method:5s} hold {hold:>4s}: {row['passes_past_end']:.2f} passes past the "
                  f"end a request, {row['stalls']:.2f} stalls, {row['passes']:.1f} passes, {row['tokens']:.0f} tokens",
                  flush=True)
    os.environ.pop("TANDEM_RESIDENT_HOLD")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
