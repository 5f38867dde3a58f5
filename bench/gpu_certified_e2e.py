"""Greedy `ar` with and without the certified INT8 head, end to end, at a preset's shape (random weights).

    python bench/gpu_certified_e2e.py --preset llama3-8b [--context 512 --new-tokens 128] --out $OUT

Runs Generator(..., certified_head=False / True) on the same prompt, alternating, three times each,
and reports ms per token (after the first) and whether the tokens are equal. Random weights make
near-uniform logits, which is the certified head's slow case (many tokens survive the bound).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tandem.bench.presets import PRESETS, random_model  # noqa: E402
from tandem.config import GenerationConfig  # noqa: E402
from tandem.runtime.generate import Generator  # noqa: E402


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    model = random_model(a.preset, "cuda", torch.bfloat16).fuse_projections()
    prompt = torch.randint(0, model.config.vocab_size, (a.context,)).tolist()
    cfg = GenerationConfig(max_new_tokens=a.new_tokens, ignore_eos=True)
    gens = {False: Generator(model, None), True: Generator(model, None, certified_head=True)}
    for g in gens.values():  # warm-up: graphs, kernels, the int8 copy of the head
        g.generate(prompt, "ar", gen=GenerationConfig(max_new_tokens=16, ignore_eos=True))
    runs: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[int]] = {}
    for _ in range(3):
        for flag, g in gens.items():
            r = g.generate(prompt, "ar", gen=cfg)
            runs[flag].append((r.seconds - r.ttft) / (r.new_tokens - 1) * 1e3)
            tokens[flag] = r.token_ids
    rep = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "preset": a.preset,
           "ms_per_token": {"full_head": statistics.median(runs[False]), "certified_head": statistics.median(runs[True])},
           "runs": {"full_head": runs[False], "certified_head": runs[True]},
           "tokens_equal": tokens[False] == tokens[True]}
    rep["speedup"] = rep["ms_per_token"]["full_head"] / rep["ms_per_token"]["certified_head"]
    if not rep["tokens_equal"]:  # where they part: the full head's logits there (an uncached forward)
        i = next(i for i, (x, y) in enumerate(zip(tokens[False], tokens[True])) if x != y)
        row = model(torch.tensor([prompt + tokens[False][:i]], device="cuda"))[0, -1].float()  # [V]
        rep["first_difference"] = {"index": i, "full_head": tokens[False][i], "certified": tokens[True][i],
                                   "logit_full_head_token": row[tokens[False][i]].item(),
                                   "logit_certified_token": row[tokens[True][i]].item(), "max_logit": row.max().item()}
    print(json.dumps(rep))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"certified_e2e_{a.preset}.json"), "w") as f:
        json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
