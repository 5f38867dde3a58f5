"""Launch shapes of the small kernels of the bundled pair's passes, timed on the GPU (bf16, inside a CUDA graph of
back-to-back calls, bench/gpu_timing.graph_ms):
- `linear`: `fused_layer.linear` (a fused layer's o_proj / down_proj) against cuBLAS's F.linear, at 1, 4 and 33 rows;
- `head_topk`: `head_level.head_topk` (the head's residual add, final norm, LM head and top-4) at 1 and 4 rows, over
  its vocabulary block BV, column step BK and warps;
- `level`: the other kernels of one of the head's tree levels (4 rows): `head_level.eagle_qkv` (input norms, parent
  gather, q/k/v, RoPE, K/V store) over CB / BK / warps, the cached attention over 256 columns (column block, warps,
  splits) and `fused_layer.norm_gate_up_silu` (BK, BN, warps).
Each variant's output is checked against its reference.
    python bench/gpu_small_kernels.py [--ops linear,head_topk,level]
"""
from __future__ import annotations

import argparse
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


def linears(c, best: dict) -> None:
    H, I = c.hidden_size, c.intermediate_size
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


def head_topks(c, best: dict) -> None:
    H, V = c.hidden_size, c.vocab_size
    nw_, lm = 1 + _r(H, scale=0.1), _r(V, H, scale=4 * H ** -0.5)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for R in (1, 4):
        r, d = _r(R, H), _r(R, H)
        want = hl.head_topk_ref(r, d, nw_, 1e-5, lm, 4)[2]
        rows = []
        for bv, bk, nw in itertools.product((64, 128, 256), (128,), (4, 8)):
            tok = hl.launch_head_topk(r, d, nw_, 1e-5, lm, 4, counter, bv=bv, bk=bk, num_warps=nw)[2]
            same = (tok[:, 0] == want[:, 0]).float().mean().item()
            us = 1e3 * graph_ms([lambda: hl.launch_head_topk(r, d, nw_, 1e-5, lm, 4, counter, bv=bv, bk=bk,
                                                             num_warps=nw)], 400)
            rows.append((f"bv{bv}_bk{bk}_w{nw}", us, same))
            print(json.dumps({"op": "head_topk", "rows": R, "variant": rows[-1][0], "us": round(us, 3),
                              "top1_agree": same}))
        dflt = next(r for r in rows if r[0] == f"bv{hl.BLOCK_V}_bk{hl.BLOCK_K}_w{hl.TOPK_WARPS}")
        b = min(rows, key=lambda r: r[1])
        best[("head_topk", R)] = (b[0], b[1], dflt[1])


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-9)).item()


def level(c, best: dict) -> None:
    """One tree level of the head (w = 4 rows), at the bundled head's shape."""
    from tandem.kernels.attention import cached_attention_ref, launch_cached_attention
    from tandem.models.layers import rope_inv_freq

    H, D, nq, nkv, I, T, cap = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, \
        c.intermediate_size, 4, 256
    embed, hidden = _r(c.vocab_size, H), _r(T, H)
    ids = torch.randint(0, c.vocab_size, (T,), device="cuda")
    src = torch.tensor([0, 0, 1, 2], device="cuda")
    we, wh, w = 1 + _r(H, scale=0.1), 1 + _r(H, scale=0.1), _r((nq + 2 * nkv) * D, 2 * H, scale=(2 * H) ** -0.5)
    pos = torch.arange(100, 100 + T, device="cuda")
    slots = torch.arange(200, 200 + T, device="cuda")
    inv = rope_inv_freq(c).cuda()
    kc, vc = _r(1, nkv, cap, D), _r(1, nkv, cap, D)
    want = hl.eagle_qkv_ref(ids, embed, hidden, src, we, wh, 1e-5, w, pos, inv, nq, nkv, kc.clone(), vc.clone(),
                            slots)[0]
    _sweep(best, "eagle_qkv", T, {
        f"cb{cb}_bk{bk}_w{nw}": (lambda cb=cb, bk=bk, nw=nw: hl.launch_eagle_qkv(
            ids, embed, hidden, src, we, wh, 1e-5, w, pos, inv, nq, nkv, kc, vc, slots, bk=bk, cb=cb, num_warps=nw)[0])
        for cb, bk, nw in itertools.product((16, 32), (128, 256), (2, 4, 8))},
        want, f"cb{hl.QKV_CB}_bk{hl.QKV_BK}_w{hl.QKV_WARPS}")
    # attention: 4 rows over 256 columns (a 200-token prefix, then the tree rows), mask as a level's
    q = _r(1, T, nq, D)
    mask = torch.zeros(1, 1, T, cap, dtype=torch.bool, device="cuda")
    mask[..., :200] = True
    mask[0, 0, torch.arange(T), 200 + torch.arange(T)] = True
    _sweep(best, "attention", T, {
        f"bn{bn}_w{nw}_s{sp}": (lambda bn=bn, nw=nw, sp=sp: launch_cached_attention(q, kc, vc, mask, block_n=bn,
                                                                                     num_warps=nw, splits=sp))
        for bn, nw, sp in itertools.product((32, 64, 128), (2, 4), (1, 2))},
        cached_attention_ref(q, kc, vc, mask), "bn64_w4_s1")
    # gate/up with the residual add and the norm in front, SiLU * up behind
    x, dx, lw, wgu = _r(T, H), _r(T, H), 1 + _r(H, scale=0.1), _r(2 * I, H, scale=H ** -0.5)
    _sweep(best, "gate_up", T, {
        f"bk{bk}_bn{bn}_w{nw}": (lambda bk=bk, bn=bn, nw=nw: fl.launch_norm_gate_up(x, dx, lw, 1e-5, wgu, bk=bk, bn=bn,
                                                                                     num_warps=nw)[1])
        for bk, bn, nw in itertools.product((128, 256), (16, 32, 64), (2, 4))},
        fl.norm_gate_up_silu_ref(x, dx, lw, 1e-5, wgu)[1],
        f"bk{fl.GATE_UP_BK}_bn{fl._gate_up_bn(I)}_w{fl.GATE_UP_WARPS}")


def _sweep(best: dict, op: str, T: int, variants: dict, want: torch.Tensor, default: str) -> None:
    """Each variant (name -> call returning the output) checked against want and timed in a CUDA graph, a JSON
    line each; best[(op, T)] = (the fastest's name, its us, the default's us)."""
    rows = []
    for name, f in variants.items():
        err = _rel(f(), want)
        rows.append((name, 1e3 * graph_ms([f], 400), err))
        print(json.dumps({"op": op, "rows": T, "variant": name, "us": round(rows[-1][1], 3), "rel_err": err}))
    dflt = next(r for r in rows if r[0] == default)
    best[(op, T)] = (*min(rows, key=lambda r: r[1])[:2], dflt[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="linear,head_topk,level", help="which sweeps (comma-separated)")
    ops = ap.parse_args().ops.split(",")
    torch.set_grad_enabled(False)
    c = read_config(BUNDLED_TARGET)
    best: dict = {}
    for name, fn in (("linear", linears), ("head_topk", head_topks), ("level", level)):
        if name in ops:
            fn(c, best)
    print("\nbest per (op, rows): variant, us  (baseline: cuBLAS for the linears, the default shape otherwise)")
    for key, (v, us, base) in best.items():
        print(f"  {key}: {v} {us:.2f} us (baseline {base:.2f} us)")


if __name__ == "__main__":
    main()
