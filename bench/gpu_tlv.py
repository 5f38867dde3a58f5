"""Two-level verification (`tlv`) against `tree` and `ar` on the bundled pair: tokens per exact pass and tokens/s.

    python bench/gpu_tlv.py --data-dir .data [--num-prompts 10 --nodes 8 --dtype bfloat16] --out $OUT

Greedy, 128 new tokens, the draft model, MBPP prompts. For each method: tokens/s over the prompts
(a warm-up prompt first), tokens per exact target pass (tau; TLV's Q passes are not counted), and
TLV's Q-pass top-1 agreement with the exact pass over its chains C. Every output is compared with
`ar`'s (bf16 near-ties may part them; fp32 is exact).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tandem.bench.workloads import load_workload  # noqa: E402
from tandem.config import GenerationConfig, SpecConfig  # noqa: E402
from tandem.runtime.generate import Generator  # noqa: E402
from tandem.runtime import tlv  # noqa: E402
from tandem.runtime.pair import load_pair  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--q-scale", type=int, default=None,
                    help="the first tree's size over N, which only the Q pass checks (default: tandem.runtime.tlv.Q_SCALE)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.q_scale is not None:
        tlv.Q_SCALE = a.q_scale
    pair = load_pair(None, None, a.device, a.dtype)
    gen = Generator(pair.target, pair.draft, tokenizer=pair.tokenizer)
    prompts = [pair.tokenizer.encode(p.text).ids[-256:] for p in load_workload("mbpp", a.num_prompts, a.data_dir)]
    cfg = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    spec = SpecConfig(nodes=a.nodes, width=a.width)
    rep: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "dtype": a.dtype,
                 "nodes": a.nodes, "width": a.width, "q_scale": tlv.Q_SCALE, "prompts": len(prompts), "methods": {}}
    outputs: dict[str, list[list[int]]] = {}
    for method in ("ar", "tree", "tlv"):
        gen.generate(prompts[0], method, spec, gen=GenerationConfig(max_new_tokens=32, ignore_eos=True))  # warm-up
        toks, secs, passes, agree, checked, outs = 0, 0.0, 0, 0, 0, []
        for p in prompts:
            r = gen.generate(p, method, spec, gen=cfg)
            toks, secs, passes = toks + r.new_tokens, secs + r.seconds, passes + r.target_passes
            agree, checked = agree + getattr(r, "q_agree", 0), checked + getattr(r, "q_checked", 0)
            outs.append(r.token_ids)
        outputs[method] = outs
        rep["methods"][method] = {"tokens_per_s": toks / secs, "tokens_per_exact_pass": toks / max(passes, 1),
                                  "q_agreement": agree / checked if checked else None,
                                  "equal_to_ar": sum(o == r for o, r in zip(outs, outputs["ar"]))}
        print(method, json.dumps(rep["methods"][method]), flush=True)
    m = rep["methods"]
    rep["tlv_vs_tree"] = {"tokens_per_exact_pass": m["tlv"]["tokens_per_exact_pass"] / m["tree"]["tokens_per_exact_pass"],
                          "tokens_per_s": m["tlv"]["tokens_per_s"] / m["tree"]["tokens_per_s"]}
    print(json.dumps(rep["tlv_vs_tree"]))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tlv.json"), "w") as f:
        json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
