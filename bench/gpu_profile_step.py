"""Kernel-level breakdown of one runner step (torch.profiler), to see where a step's time goes.

    python bench/gpu_profile_step.py --preset llama3-8b --rows 1,64
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tandem.bench.presets import PRESETS, random_model  # noqa: E402
from tandem.runtime.runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    model = random_model(args.preset, "cuda", torch.bfloat16).fuse_projections()
    runner = ModelRunner(model, args.context + 300, use_graphs=False)
    V = model.config.vocab_size
    runner.prefill(torch.randint(0, V, (args.context,)).tolist())
    for T in [int(x) for x in args.rows.split(",")]:
        toks = torch.randint(0, V, (T,)).tolist()
        pos = [args.context + i for i in range(T)]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        for _ in range(3):
            runner.step(toks, pos, mask)
            runner.cache.drop_tree()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.step(toks, pos, mask)
                runner.cache.drop_tree()
            torch.cuda.synchronize()
        print(f"==== rows={T}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main()
