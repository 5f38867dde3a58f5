"""Locate async's CUDA divergence from ar: run ar / tree / async on the bundled pair under
several in-process variants and, for every target pass of every method, check the target's
answer against an uncached causal forward of the committed sequence.

    python bench/gpu_async_check.py --out $OUT        (device tool: carry .data)

A pass is "wrong" when the target's argmax at an accepted node (or the bonus) differs from the
uncached forward's argmax at that position by more than a near-tie (logit margin > 1e-3). The
first wrong pass of each method is printed with its shape (rows, prefix, tree_len, width bucket)
so the faulty step can be reproduced alone.
"""
from __future__ import annotations

import json
import os
import time

import torch
from pair_script import pair_and_prompts, parser

from tandem.config import GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime import generate as gen_mod
from tandem.runtime import runner as runner_mod
from tandem.runtime.generate import Generator

PASSES: list[dict] = []


def record_passes():
    """Wrap Target.finish: remember (prefix before, tree, result) of every pass."""
    orig = gen_mod.Target.finish

    def finish(self, launch):
        result = orig(self, launch)
        PASSES.append({"prefix_len": self.runner.cache.prefix_len - len(result.path), "tree": launch.tree,
                       "result": result})
        return result

    gen_mod.Target.finish = finish


ORIG_STEP = runner_mod.ModelRunner.step


def sync_every_step(on: bool):
    """With `on`, every runner step ends with a device synchronize."""
    def step(self, *a, **k):
        out = ORIG_STEP(self, *a, **k)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return out

    runner_mod.ModelRunner.step = step if on else ORIG_STEP


@torch.no_grad()
def first_wrong_pass(model, prompt: list[int], passes: list[dict]) -> dict | None:
    """Replay the committed sequence uncached; return the first pass whose answer is wrong."""
    seq = list(prompt)
    full = list(prompt)
    for p in passes:
        full += p["result"].tokens
    logits = model(torch.tensor([full], device=model.device))[0].float()  # [L, V] causal, no cache
    pos = len(prompt) - 1  # position whose logits choose the next token
    for i, p in enumerate(passes):
        for t in p["result"].tokens:
            row = logits[pos]
            best = int(row.argmax())
            if best != t and float(row[best] - row[t]) > 1e-3:
                tree = p["tree"]
                return {"pass": i, "position": pos, "got": t, "want": best, "margin": float(row[best] - row[t]),
                        "tree_nodes": len(tree), "accepted": p["result"].accepted, "prefix_len": len(seq),
                        "depths": max(tree.depth)}
            pos += 1
        seq += p["result"].tokens
    return None


def main():
    ap = parser(__doc__, num_prompts=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--variants", default="base,sync,nographs,notriton,streams,streams-sync")
    args = ap.parse_args()
    record_passes()
    pair, prompts = pair_and_prompts(args)
    tok = pair.tokenizer
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    spec = SpecConfig()
    report = {}
    for variant in args.variants.split(","):
        os.environ["TANDEM_TRITON"] = "0" if "notriton" in variant else "1"
        graphs = None if "nographs" not in variant else False
        sync_every_step("sync" in variant)
        g = Generator(pair.target, pair.draft, tok, use_graphs=graphs)
        rows = []
        for method, transport in (("ar", "auto"), ("tree", "auto"),
                                  ("async", "streams" if "streams" in variant else "inline")):
            for pi, prompt in enumerate(prompts):
                PASSES.clear()
                t0 = time.perf_counter()
                r = g.generate(prompt, method, spec, SamplingConfig(temperature=0.0), gen, transport=transport)
                wrong = first_wrong_pass(pair.target, prompt, list(PASSES))
                rows.append({"method": method, "prompt": pi, "tokens": r.token_ids, "wrong": wrong,
                             "seconds": time.perf_counter() - t0,
                             "stats": {k: v for k, v in getattr(r, "stats", {}).items()
                                       if k in ("transport", "mean_rounds", "hit_rate", "controller")}})
        ar = {x["prompt"]: x["tokens"] for x in rows if x["method"] == "ar"}
        for x in rows:
            x["equal_ar"] = x["tokens"] == ar[x["prompt"]]
        summary = {m: {"mismatch": sum(not x["equal_ar"] for x in rows if x["method"] == m),
                       "wrong_pass": sum(x["wrong"] is not None for x in rows if x["method"] == m),
                       "first": next((x["wrong"] for x in rows if x["method"] == m and x["wrong"]), None)}
                   for m in ("ar", "tree", "async")}
        print(f"== {variant}: {json.dumps(summary)}", flush=True)
        report[variant] = {"summary": summary, "rows": rows}
        with open(os.path.join(args.out, "async_check.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
