"""Whether a large model's few-row passes (a `chain` verify of k + 1 rows, a small tree) should leave cuBLAS:
the fused layer kernels (tandem.kernels.fused_layer: tl.dot over 16-row tiles, the norm in front, RoPE + K/V
store or SiLU * up behind), which today take only small models' weights, timed at a preset's layer shapes
against the cuBLAS path (add + RMSNorm, F.linear, RoPE + K/V store or SiLU * up), at 2-16 rows.

At one row the streaming GEMVs (tandem.kernels.gemv) beat cuBLAS by 9-22% a projection at the Llama-3-8B shape;
at two rows and more cuBLAS leaves its GEMV path (4.86 -> 6.04 ms a step on the H200, 2026-11-29). If the fused
kernels win here too, `fused_layer.applies` should take large weights at few rows. Graph-timed, weights cycled
through 256 MB (bench/gpu_gemv.py's timing); each variant checked against its reference.
    python bench/gpu_skinny.py --preset llama3-8b [--rows 2,4,8,16]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from gpu_gemv import _copies, _err, _r
from gpu_timing import graph_ms
from tandem.bench.presets import PRESETS
from tandem.kernels import fused, fused_layer as fl
from tandem.models.layers import rope_inv_freq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    ap.add_argument("--rows", default="2,4,8,16")
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    c = PRESETS[a.preset]
    K, I, D, nq, nkv = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    inv = rope_inv_freq(c).cuda()
    w_o = _copies(_r(K, nq * D, scale=K ** -0.5))
    w_down = _copies(_r(K, I, scale=I ** -0.5))
    w_gu = _copies(_r(2 * I, K, scale=K ** -0.5))
    w_qkv = _copies(_r((nq + 2 * nkv) * D, K, scale=K ** -0.5))
    kv = _r(2, 1, nkv, 1024, D)
    best = []
    for M in (int(m) for m in a.rows.split(",")):
        x, d, ln = _r(M, K), _r(M, K), 1 + _r(K, scale=0.1)
        xr = x.clone()  # the cuBLAS path's residual, updated in place (the norm does not see its drift)
        pos = torch.arange(700, 700 + M, device="cuda")
        table: dict[str, list[tuple[str, float, float]]] = {}

        def time(op, variant, fns, got=None, want=None):
            us = 1e3 * graph_ms(fns, a.iters)
            err = 0.0 if got is None else _err(got, want)
            table.setdefault(op, []).append((variant, us, err))
            print(json.dumps({"rows": M, "op": op, "variant": variant, "us": round(us, 2), "rel_err": err}), flush=True)

        for op, ws, inp in (("o_proj", w_o, _r(M, nq * D)), ("down_proj", w_down, _r(M, I))):
            time(op, "cublas", [lambda w=w: F.linear(inp, w) for w in ws])
            want = F.linear(inp, ws[0])
            for bk, bn, nw in itertools.product((64, 128, 256), (16, 32, 64), (2, 4, 8)):
                time(op, f"bk{bk}_bn{bn}_w{nw}", [lambda w=w: fl.launch_linear(inp, w, bk=bk, bn=bn, num_warps=nw)
                                                  for w in ws], fl.launch_linear(inp, ws[0], bk=bk, bn=bn,
                                                                                num_warps=nw), want)
        time("gate_up", "cublas", [lambda w=w: fused.silu_mul(F.linear(fused.add_rmsnorm(xr, d, ln, 1e-5)[1], w))
                                   for w in w_gu])
        want = fl.norm_gate_up_silu_ref(x, d, ln, 1e-5, w_gu[0])[1]
        for bk, bn, nw in itertools.product((64, 128), (16, 32, 64), (4, 8)):
            time("gate_up", f"bk{bk}_bn{bn}_w{nw}",
                 [lambda w=w: fl.launch_norm_gate_up(x, d, ln, 1e-5, w, bk=bk, bn=bn, num_warps=nw) for w in w_gu],
                 fl.launch_norm_gate_up(x, d, ln, 1e-5, w_gu[0], bk=bk, bn=bn, num_warps=nw)[1], want)

        def unfused_qkv(w):
            h = fused.add_rmsnorm(xr, d, ln, 1e-5)[1]
            fused.rope_store_kv(F.linear(h, w).view(1, M, nq + 2 * nkv, D), pos[None], inv, nq, nkv, kv[0], kv[1],
                                pos[None])
        time("qkv", "cublas", [lambda w=w: unfused_qkv(w) for w in w_qkv])
        want = fl.norm_qkv_rope_store_ref(x, d, ln, 1e-5, w_qkv[0], None, pos, inv, nq, nkv, kv[0].clone(),
                                          kv[1].clone(), pos)[1]
        for bk, cb, nw in itertools.product((64, 128), (8, 16, 32), (4, 8)):
            def f(w, bk=bk, cb=cb, nw=nw):
                return fl.launch_norm_qkv(x, d, ln, 1e-5, w, None, pos, inv, nq, nkv, kv[0], kv[1], pos, bk=bk,
                                          num_warps=nw, cb=cb)[1]
            time("qkv", f"bk{bk}_cb{cb}_w{nw}", [lambda w=w: f(w) for w in w_qkv], f(w_qkv[0]), want)
        for op, variants in table.items():
            base = variants[0][1]
            b = min((v for v in variants[1:] if v[2] < 2e-2), key=lambda v: v[1])
            best.append((M, op, b[0], b[1], base))
    print("\nbest fused variant per (rows, op) against the cuBLAS path:")
    for M, op, v, us, base in best:
        print(f"  rows {M:2d} {op:9s} {v:16s} {us:8.2f} us  cuBLAS path {base:8.2f} us  ({base / us:.2f}x)")


if __name__ == "__main__":
    main()
