"""The block drafter's draft-pass kernels at their launch variants, on real inputs (bundled pair, bf16, GPU).

The inputs are those of the resident loop's own draft passes (`tree`, N = 32, over MBPP prompts, graphs off so that
each call is seen): the input rows' tokens and features, the rows head_topk reads, the lattices the tree is built
over. Each variant is timed inside a CUDA graph of back-to-back calls cycling over the recorded inputs
(bench/gpu_timing.graph_ms: the GPU's own time, as in the draft graph) and its output checked against the default's
(tokens and trees exactly; head_topk's log-probs to 1e-5, the block input rows to a bf16 rounding).
    python bench/gpu_draft_kernels.py --data-dir .data [--num-prompts 4] [--out $OUT]   (rows: $OUT/draft_kernels.jsonl)
"""
from __future__ import annotations

import json
import os
from functools import partial

os.environ["TANDEM_CUDA_GRAPHS"] = "0"  # the resident loop's bodies eagerly: every call recorded

import torch  # noqa: E402

from gpu_timing import graph_ms  # noqa: E402
from pair_script import parser  # noqa: E402

import tandem.runtime.resident as rl  # noqa: E402
from tandem.bench.workloads import load_workload  # noqa: E402
from tandem.config import GenerationConfig, SpecConfig  # noqa: E402
from tandem.kernels import block_input as bi, head_level as hl, resident as kr  # noqa: E402
from tandem.runtime.generate import Generator  # noqa: E402
from tandem.runtime.pair import load_pair  # noqa: E402

CAP = 48  # recorded calls of each kind


def record(pair, prompts):
    """Run `tree` with wrappers that keep (clones of) each draft pass's kernel inputs."""
    seen = {"topk": [], "tree": [], "input": []}
    real_topk, real_tree = rl.head_topk, rl.best_first_tree_device

    def topk(r, delta, norm_w, eps, lm_w, k, counter=None):
        if len(seen["topk"]) < CAP:
            seen["topk"].append((r.clone(), delta.clone(), norm_w, eps, lm_w, k))
        return real_topk(r, delta, norm_w, eps, lm_w, k, counter)

    def tree(tok, cond, root, nodes, out):
        if len(seen["tree"]) < CAP:
            seen["tree"].append((tok.clone(), cond.clone(), root.clone(), nodes))
        return real_tree(tok, cond, root, nodes, out)

    rl.head_topk, rl.best_first_tree_device = topk, tree
    drafter = getattr(pair.draft, "drafter", pair.draft)
    real_input = None
    if drafter is not None:
        real_input = drafter.input_rows

        def input_rows(tok, feat, rows):
            if len(seen["input"]) < CAP:
                seen["input"].append((tok.clone(), feat.clone(), rows))
            return real_input(tok, feat, rows)
        drafter.input_rows = input_rows
    gen = Generator(pair.target, pair.draft, pair.tokenizer, resident=True)
    g = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    for p in prompts:
        gen.generate(p, "tree", SpecConfig(nodes=32), gen=g)
    rl.head_topk, rl.best_first_tree_device = real_topk, real_tree
    if drafter is not None:
        drafter.input_rows = real_input
    return seen, drafter


class Rows(list):
    """The result rows, each printed and appended to the jsonl file as it comes (a call cut by its deadline keeps
    what it measured)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        open(path, "w").close()

    def append(self, row: dict) -> None:
        super().append(row)
        print(json.dumps(row), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def us(fns) -> float:
    return 1e3 * graph_ms(fns, iters=400, per_graph=len(fns))


def bench_tree(calls, rows):
    M = calls[0][3] + 1
    outs = [tuple(torch.empty(M, dtype=torch.long, device="cuda") for _ in range(3))
            + (torch.empty(M, M, dtype=torch.bool, device="cuda"),) for _ in calls]
    want = [kr.select_tree_ref(tok, root, *kr.beam_levels_ref(cond.float(), 32, n), n) for tok, cond, root, n in calls]
    for narrow, w in ((0, 4), (16, 4), (16, 8), (16, 2)):
        fns = [partial(kr.launch_tree, tok, root, cond, 32, n, o, num_warps=w, narrow=narrow)
               for (tok, cond, root, n), o in zip(calls, outs)]
        t = us(fns)
        ok = all(all(torch.equal(a, b) for a, b in zip(o, wt)) for o, wt in zip(outs, want))
        rows.append({"kernel": "tree (beams + selection, one launch)", "variant": f"narrow={narrow} num_warps={w}",
                     "us": round(t, 2), "equal": ok})
    for narrow in (16, 8):  # how often the narrow pass's tree is kept (no level holds `narrow` of its nodes)
        kept = 0
        for tok, cond, root, n in calls:
            d = kr.select_tree_ref(tok, root, *kr.beam_levels_ref(cond.float(), narrow, n), n)[2]
            kept += int(kr.narrow_tree_kept(d, narrow, cond.shape[0], cond.shape[1]))
        rows.append({"kernel": f"tree: narrow={narrow} pass kept (share of the recorded lattices)", "variant": "",
                     "us": round(kept / len(calls), 3)})
    fns = [partial(kr.launch_beam_levels, cond, 32, n) for tok, cond, root, n in calls]
    rows.append({"kernel": "tree: beams alone (early stop)", "variant": "num_warps=4", "us": round(us(fns), 2)})
    beams = [kr.launch_beam_levels(cond, 32, n) for tok, cond, root, n in calls]
    levels = [int((~torch.isinf(b[0][:, 0])).sum()) for b in beams]
    rows.append({"kernel": "tree: levels run (mean of the recorded lattices)", "variant": "",
                 "us": round(sum(levels) / len(levels), 2)})


def bench_topk(calls, rows):
    ref = [hl.launch_head_topk(r, d, nw, eps, lm, k, bv=hl.BLOCK_V, bitonic=False) for r, d, nw, eps, lm, k in calls]
    for bitonic, bv, warps in ((False, 128, 8), (False, 256, 8), (False, 128, 4), (True, 256, 8), (True, 128, 4)):
        got = []
        counters = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in calls]

        def call(i, c, bitonic=bitonic, bv=bv, warps=warps, got=got, counters=counters):
            r, d, nw, eps, lm, k = c
            out = hl.launch_head_topk(r, d, nw, eps, lm, k, counters[i], bv=bv, num_warps=warps, bitonic=bitonic)
            if len(got) < len(calls):
                got.append(out)
        t = us([partial(call, i, c) for i, c in enumerate(calls)])
        ok = all(torch.equal(g[2], w[2]) and torch.allclose(g[1], w[1], atol=1e-5) for g, w in zip(got, ref))
        rows.append({"kernel": "head_topk (16 rows, top 16)", "variant": f"bitonic={bitonic} BV={bv} warps={warps}",
                     "us": round(t, 2), "equal": ok})


def bench_input(calls, drafter, rows):
    e, me = drafter.shared["embed"].weight, drafter.mask_embedding
    nw, eps, fc = drafter.feature_norm.weight, drafter.feature_norm.eps, drafter.fc.weight
    ref = [bi.launch_block_input(tok, f, e, me, nw, eps, fc, n) for tok, f, n in calls]
    for bn, bk, warps in ((32, 128, 4), (16, 128, 4), (32, 256, 4), (16, 256, 2)):
        fns = [partial(bi.launch_block_input, tok, f, e, me, nw, eps, fc, n, bn=bn, bk=bk, num_warps=warps)
               for tok, f, n in calls]
        t = us(fns)
        # (fc's fp32 sums in another order: equal up to a rounding of the bf16 output)
        err = max(((bi.launch_block_input(tok, f, e, me, nw, eps, fc, n, bn=bn, bk=bk, num_warps=warps)
                    - w).float().abs() / w.float().abs().clamp(min=1e-3)).max().item()
                  for (tok, f, n), w in zip(calls, ref))
        rows.append({"kernel": "block_input (input rows)", "variant": f"BN={bn} BK={bk} warps={warps}",
                     "us": round(t, 2), "equal": err <= 2 ** -7})


def main():
    ap = parser(__doc__, num_prompts=4)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pair = load_pair(None, "block", "cuda", "bfloat16")
    prompts = [pair.tokenizer.encode(p.text).ids[-384:] for p in load_workload("mbpp", args.num_prompts, args.data_dir)]
    seen, drafter = record(pair, prompts)
    print({k: len(v) for k, v in seen.items()})
    rows = Rows(os.path.join(args.out, "draft_kernels.jsonl"))
    for name, fn in (("tree", lambda: bench_tree(seen["tree"], rows)), ("topk", lambda: bench_topk(seen["topk"], rows)),
                     ("input", lambda: bench_input(seen["input"], drafter, rows))):
        try:
            fn()
        except Exception as e:  # one kernel's failure does not hide the others' timings
            rows.append({"kernel": name, "variant": "FAILED", "us": None, "error": f"{type(e).__name__}: {e}"[:300]})
    print("\n| kernel | variant | us | equal |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['variant']} | {r['us']} | {r.get('equal', '')} |")


if __name__ == "__main__":
    main()
