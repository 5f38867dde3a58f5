"""GPU benchmark of method `async` (SwiftSpec-style disaggregated tree decoding) against `ar`
and the serial `tree` loop, on one GPU (two CUDA streams) or two (processes over NCCL).

    # trained pair (real acceptance):
    python bench/gpu_async.py --target DIR --draft DIR --out $OUT
    # realistic shapes, random weights; the draft shares the target's first K layers
    # (early exit: same vocabulary, partial agreement, no extra weights):
    python bench/gpu_async.py --preset llama3-8b --draft-layers 4 --out $OUT
    # realistic shapes, an independent random draft: acceptance ~0, i.e. the collapse case
    # (checks "never worse than serial" and that the collapse guard fires):
    python bench/gpu_async.py --preset llama3-8b --draft-preset llama3.2-1b --out $OUT

Per prompt the methods run interleaved (ar, tree, async[streams], optional async[inline] and
async[nccl|gloo]); every greedy output is checked against ar's. Reported: tokens/s (decode
only, prefill excluded), tau, ratios to ar and to tree (medians over prompts), and the async
timeline: the chosen depth d, t_target(N+1 rows), t_draft(w rows), mean expansion rounds
hidden behind each verify, the in-tree rate, K/V rows reused per re-root, collapse events.

Prediction to write down before running (fill in from the printed t_target / t_draft):
serial tree pass = t_target + (draft rounds) * t_draft; async pass ~ t_target + (overlap
slowdown of sharing one GPU) when the answer is in the tree, + (1 + growth rounds) * t_draft
when it is not. On one GPU the two streams share SMs and HBM, so the overlap is partial: the
gain comes from the draft's small kernels filling what the target's graph leaves idle.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tandem.config import GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.async_decode import generate_async
from tandem.runtime.generate import Generator

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three laws of thermodynamics can be summarised as follows.",
    "Once upon a time, in a small village by the sea, there lived",
    "Question: What is the capital of France and why is it important?\nAnswer:",
    "import numpy as np\n\n# compute the moving average of a 1-D array\ndef moving_average(x, w):\n",
    "A step-by-step explanation of how a hash map works:\n1.",
]


def early_exit_draft(target, layers: int):
    """A draft made of the target's first `layers` layers, its embedding, norm and head (shared)."""
    from torch import nn

    from tandem.models.transformer import Transformer

    cfg = dataclasses.replace(target.config, num_hidden_layers=layers)
    with torch.device("meta"):
        d = Transformer(cfg)
    d.model.embed_tokens = target.model.embed_tokens
    d.model.layers = nn.ModuleList(list(target.model.layers[:layers]))
    d.model.norm = target.model.norm
    d.lm_head = target.lm_head
    d.inv_freq = target.inv_freq
    return d.eval()


def load(args):
    dtype = getattr(torch, args.dtype)
    if args.target:
        from tandem.runtime.pair import load_pair

        pair = load_pair(args.target, args.draft, device=args.device, dtype=args.dtype, need_draft=args.draft is not None)
        target, draft, tok = pair.target, pair.draft, pair.tokenizer
        name = os.path.basename(os.path.normpath(args.target))
    else:
        from tandem.bench.presets import random_model

        target, tok = random_model(args.preset, args.device, dtype, seed=0), None
        draft = None
        name = args.preset
    if args.draft_layers:
        draft, name = early_exit_draft(target, args.draft_layers), f"{name}-exit{args.draft_layers}"
    elif draft is None:
        from tandem.bench.presets import random_model

        draft = random_model(args.draft_preset, args.device, dtype, seed=1)
        name = f"{name}-{args.draft_preset}"
    return target, draft, tok, name


def encode(tok, text: str, vocab: int, i: int) -> list[int]:
    if tok is not None:
        return tok.encode(text).ids
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, vocab, (24 + 8 * i,), generator=g).tolist()


def decode_rate(r) -> float:
    return r.decode_tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--draft-preset", default="llama3.2-1b")
    ap.add_argument("--draft-layers", type=int, default=0, help="early-exit draft from the target's first K layers")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=None, help="fix async's d (default: self-tuned)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--inline", action="store_true", help="also run async with the inline transport")
    ap.add_argument("--process", choices=["nccl", "gloo"], help="also run async over two processes")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (inline transport only)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    assert not cuda or torch.cuda.is_available(), "this benchmark needs a GPU (or --device cpu for a dry run)"
    torch.backends.cuda.matmul.allow_tf32 = True

    target, draft, tok, name = load(args)
    vocab = target.config.vocab_size
    spec = SpecConfig(method="tree", nodes=args.nodes, width=args.width)
    aspec = dataclasses.replace(spec, method="async", depth=args.depth)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    greedy = SamplingConfig()
    g = Generator(target, draft, tok, use_graphs=cuda)
    runners: dict = {}

    def run(method: str, prompt: list[int]):
        if cuda:
            torch.cuda.synchronize()
        if method in ("ar", "tree"):
            return g.generate(prompt, method, spec=spec, sampling=greedy, gen=gen)
        transport = method.split(":")[1]
        return generate_async(target, draft, prompt, aspec, greedy, gen, set(), transport=transport, use_graphs=cuda,
                              runners=runners if transport != "nccl" and transport != "gloo" else None,
                              timeout_s=600)

    methods = ["ar", "tree", "async:streams" if cuda else "async:inline"] + \
        (["async:inline"] if args.inline and cuda else []) + \
        ([f"async:{args.process}"] if args.process else [])
    prompts = [encode(tok, PROMPTS[i % len(PROMPTS)], vocab, i) for i in range(args.prompts)]
    # warm-up: graphs, allocator, cuBLAS (one short run per method)
    warm = prompts[0]
    for m in methods:
        if not m.endswith(("nccl", "gloo")):
            run(m, warm)
    rows: list[dict] = []
    for i, prompt in enumerate(prompts):
        ref = None
        for m in methods:
            t0 = time.perf_counter()
            r = run(m, prompt)
            wall = time.perf_counter() - t0
            if m == "ar":
                ref = r.token_ids
            row = {"prompt": i, "method": m, "tokens": len(r.token_ids), "decode_tok_s": decode_rate(r),
                   "tok_s": r.tokens_per_s, "tau": r.tau, "passes": r.target_passes, "seconds": r.seconds,
                   "wall": wall, "equal_ar": r.token_ids == ref}
            st = getattr(r, "stats", None)
            if st:
                keep = ("t_target_s", "t_draft_s", "mean_rounds", "hit_rate", "mean_reused", "draft_wait_s",
                        "target_wait_s", "startup_s", "draft_steps")
                row.update({k: st[k] for k in keep if k in st})
                row["controller"] = st.get("controller")
                for k in ("expand_s", "pass_wait_s"):  # per pass: draft expanding / blocked on the answer
                    if st.get(k):
                        row[f"mean_{k[:-2]}_ms"] = 1e3 * statistics.mean(st[k])
            rows.append(row)
            print(json.dumps(row), flush=True)

    summary = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        summary[m] = {
            "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in mine),
            "tau_mean": statistics.mean(r["tau"] for r in mine),
            "all_equal_ar": all(r["equal_ar"] for r in mine),
            "ms_per_pass_median": statistics.median(1e3 * r["seconds"] / max(1, r["passes"]) for r in mine),
        }
        for base in ("ar", "tree"):
            ratios = [r["decode_tok_s"] / b["decode_tok_s"] for r in mine for b in rows
                      if b["method"] == base and b["prompt"] == r["prompt"] and b["decode_tok_s"] > 0]
            summary[m][f"speedup_vs_{base}_median"] = statistics.median(ratios) if ratios else None
    report = {"name": name, "device": torch.cuda.get_device_name() if cuda else "cpu", "nodes": args.nodes, "width": args.width,
              "depth": args.depth, "new_tokens": args.new_tokens, "summary": summary, "rows": rows}
    print(json.dumps(summary, indent=1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu_async_{name}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
