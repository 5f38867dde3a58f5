"""Functional check of the process transports with tensor-parallel target and draft on one GPU:
every process shares the GPU, gloo carries the collectives (graphs off for the shards), and
async's greedy output must equal ar's. Not a speed figure (one GPU, no NVLink).

    python bench/gpu_tp_check.py --out $OUT        (device tool: carry .data)
"""
from __future__ import annotations

import json
import os
import sys
import time

from pair_script import pair_and_prompts, parser

from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator


def main():
    ap = parser(__doc__, num_prompts=3)
    ap.add_argument("--splits", default="2:1,1:2,2:2")
    args = ap.parse_args()
    pair, prompts = pair_and_prompts(args)
    g = Generator(pair.target, pair.draft, pair.tokenizer)
    gen = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    want = [g.generate(p, "ar", gen=gen).token_ids for p in prompts]
    rows = []
    for split in args.splits.split(","):
        tp, dp = (int(x) for x in split.split(":"))
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            r = g.generate(p, "async", SpecConfig(), gen=gen, transport="gloo", tensor_parallel_size=tp,
                           draft_tensor_parallel_size=dp)
            rows.append({"split": split, "prompt": i, "equal_ar": r.token_ids == want[i], "tau": r.tau,
                         "wall_s": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "tp_check.json"), "w") as f:
        json.dump(rows, f, indent=1)
    bad = [r for r in rows if not r["equal_ar"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} async outputs equal ar")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
