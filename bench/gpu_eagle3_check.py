"""EAGLE-3 head on the bundled target: greedy equality with `ar`, tau and tok/s of chain / tree.

    python bench/gpu_eagle3_check.py --head DIR --out $OUT      (device tool: carry .data)

DIR is a head in the public layout (`tandem train-drafters --kind eagle3 --out D` writes D/eagle3).
Also prints the draft time per verify pass: the head's context pass + all its levels, timed with
CUDA events around `propose` over a few requests.
"""
from __future__ import annotations

import json
import os
import time

import torch
from pair_script import parser

from tandem.bench.workloads import load_workload
from tandem.config import GenerationConfig, SpecConfig
from tandem.drafting.eagle_drafter import EagleDrafter
from tandem.runtime.generate import Generator
from tandem.runtime.pair import load_pair


def main():
    ap = parser(__doc__, num_prompts=20)
    ap.add_argument("--head", required=True)
    ap.add_argument("--specs", default="chain:k=5,tree:nodes=32:width=4,tree:nodes=32:width=8:depth=6")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pair = load_pair(None, args.head, device=args.device, dtype=args.dtype)
    prompts = [pair.tokenizer.encode(p.text).ids for p in load_workload("mbpp", args.num_prompts, args.data_dir)]
    ar, g = Generator(pair.target, None), Generator(pair.target, pair.draft)
    gen = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    # time `propose` with CUDA events (the drafter's cost per verify pass)
    draft_ms: list[float] = []
    orig = EagleDrafter.propose

    def timed(self):
        if not torch.cuda.is_available():  # a CPU dry run: host time
            t0 = time.perf_counter()
            t = orig(self)
            draft_ms.append(1e3 * (time.perf_counter() - t0))
            return t
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = orig(self)
        b.record()
        b.synchronize()
        draft_ms.append(a.elapsed_time(b))
        return t

    rows = []
    for p in prompts[:2]:
        ar.generate(p, "ar", gen=gen)
    t0 = time.perf_counter()
    want = [ar.generate(p, "ar", gen=gen).token_ids for p in prompts]
    ar_s = time.perf_counter() - t0
    n_tok = sum(len(w) for w in want)
    print(f"ar: {n_tok / ar_s:.0f} tok/s")
    for s in args.specs.split(","):
        method, *kv = s.split(":")
        spec = SpecConfig(**{k: int(v) for k, v in (x.split("=") for x in kv)})
        for p in prompts[:2]:
            g.generate(p, method, spec, gen=gen)
        t0 = time.perf_counter()
        outs = [g.generate(p, method, spec, gen=gen) for p in prompts]
        secs = time.perf_counter() - t0
        same = sum(o.token_ids == w for o, w in zip(outs, want))
        passes = sum(o.target_passes for o in outs)
        EagleDrafter.propose = timed
        draft_ms.clear()
        for p in prompts[:4]:
            g.generate(p, method, spec, gen=gen)
        EagleDrafter.propose = orig
        row = {"spec": s, "tok_s": round(n_tok / secs), "ratio_ar": round(ar_s / secs, 3),
               "tau": round(n_tok / passes, 3), "equal_to_ar": f"{same}/{len(prompts)}",
               "draft_ms_per_pass": round(sorted(draft_ms)[len(draft_ms) // 2], 4)}
        rows.append(row)
        print(row)
    with open(os.path.join(args.out, "eagle3_check.json"), "w") as f:
        json.dump({"ar_tok_s": round(n_tok / ar_s), "dtype": args.dtype, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
