"""Launch shapes of two small kernels of the bundled pair's passes, timed on the GPU (bf16, inside a CUDA graph of
back-to-back calls, bench/gpu_timing.graph_ms):
- `fused_layer.linear` (a fused layer's o_proj / down_proj) against cuBLAS's F.linear, at 1, 4 and 33 rows;
- `head_level.head_topk` (the head's residual add, final norm, LM head and top-4) at 1 and 4 rows, over its
  vocabulary block BV, column step BK and warps.
Each variant's output is checked against its reference.
    python bench/gpu_small_kernels.py
"""
from __future__ import annotations

import itertools
import json

import torch
import torch.nn.functional as F

from gpu_timing import graph_ms
from tandem.kernels import fused_layer as fl, head_level as hl
from tandem.models.loader import read_config
from tandem.runtime.pair import BUNDLED_TARGET


def _r(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def main() -> None:
    torch.set_grad_enabled(False)
    c = read_config(BUNDLED_TARGET)
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    best = {}
    for M, (name, n, k) in itertools.product((1, 4, 33), (("o_proj", H, c.num_attention_heads * c.head_dim),
                                                         ("down_proj", H, I))):
        x, w = _r(M, k), _r(n, k, scale=k ** -0.5)
        want = F.linear(x, w)
        rows = [("cublas", 1e3 * graph_ms([lambda: F.linear(x, w)], 400), 0.0)]
        for bk, bn, nw in itertools.product((64, 128, 256), (16, 32, 64), (2, 4)):
            got = fl.launch_linear(x, w, bk=bk, bn=bn, num_warps=nw)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            rows.append((f"bk{bk}_bn{bn}_w{nw}", 1e3 * graph_ms([lambda: fl.launch_linear(x, w, bk=bk, bn=bn,
                                                                                           num_warps=nw)], 400), err))
        for v, us, err in rows:
            print(json.dumps({"op": name, "rows": M, "variant": v, "us": round(us, 3), "rel_err": err}))
        b = min((r for r in rows[1:] if r[2] < 2e-2), key=lambda r: r[1])
        best[(name, M)] = (b[0], b[1], rows[0][1])
    nw_, lm = 1 + _r(H, scale=0.1), _r(V, H, scale=4 * H ** -0.5)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for R in (1, 4):
        r, d = _r(R, H), _r(R, H)
        want = hl.head_topk_ref(r, d, nw_, 1e-5, lm, 4)[2]
        rows = []
        for bv, bk, nw in itertools.product((32, 64, 128, 256), (64, 128), (2, 4, 8)):
            tok = hl.launch_head_topk(r, d, nw_, 1e-5, lm, 4, counter, bv=bv, bk=bk, num_warps=nw)[2]
            same = (tok[:, 0] == want[:, 0]).float().mean().item()
            us = 1e3 * graph_ms([lambda: hl.launch_head_topk(r, d, nw_, 1e-5, lm, 4, counter, bv=bv, bk=bk,
                                                             num_warps=nw)], 400)
            rows.append((f"bv{bv}_bk{bk}_w{nw}", us, same))
            print(json.dumps({"op": "head_topk", "rows": R, "variant": rows[-1][0], "us": round(us, 3),
                              "top1_agree": same}))
        dflt = next(r for r in rows if r[0] == f"bv{hl.BLOCK_V}_bk{hl.BLOCK_K}_w4")
        b = min(rows, key=lambda r: r[1])
        best[("head_topk", R)] = (b[0], b[1], dflt[1])
    print("\nbest per (op, rows): variant, us  (baseline: cuBLAS for the linears, the default shape for head_topk)")
    for key, (v, us, base) in best.items():
        print(f"  {key}: {v} {us:.2f} us (baseline {base:.2f} us)")


if __name__ == "__main__":
    main()
