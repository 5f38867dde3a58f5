"""Functional check of the process transports with tensor-parallel target and draft on one GPU:
every process shares the GPU, gloo carries the collectives (graphs off for the shards), and
async's greedy output must equal ar's. Not a speed figure (one GPU, no NVLink).

    python bench/gpu_tp_check.py --out $OUT        (device tool: carry .data)
"""
from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--splits", default="2:1,1:2,2:2")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pair = load_pair(device=args.device, dtype="float32")
    g = Generator(pair.target, pair.draft, pair.tokenizer)
    prompts = [pair.tokenizer.encode(p.text).ids for p in load_workload("mbpp", args.num_prompts, args.data_dir)]
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
