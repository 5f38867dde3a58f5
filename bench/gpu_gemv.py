"""Launch shapes of the one-row GEMV layer kernels (tandem.kernels.gemv) at a preset's layer shapes, timed
on the GPU against what they replace: cuBLAS's F.linear and the small kernels around it.

For each kind (plain: o_proj and down_proj; gate_up: add + RMSNorm, gate/up, SiLU * up; qkv: add +
RMSNorm, q/k/v, RoPE + K/V store) every launch shape (BN, BK, warps) is timed inside a CUDA graph of
back-to-back calls cycling over enough weight copies that reads come from HBM, not L2 (bench/gpu_timing.py);
each variant's output is checked against its reference (relative error). The best shape per kind (the
least total time over the kind's shapes) goes to `--out`/gemv_launch.json, which
`bench/gpu_core.py --gemv-launch` loads. Also the LM head (plain kernel against cuBLAS), for reference.
    python bench/gpu_gemv.py --preset llama3-8b --out $OUT
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from gpu_timing import graph_ms
from tandem.bench.presets import PRESETS
from tandem.kernels import fused, gemv as gv
from tandem.models.layers import rope_inv_freq

L2_BYTES = 256 << 20  # weight bytes cycled per timing: several times the H100's / H200's 50 / 60 MB L2


def _r(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _copies(w: torch.Tensor) -> list[torch.Tensor]:
    n = max(2, -(-L2_BYTES // (w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(n - 1)]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def shapes_for(kind: str) -> list[tuple[int, int, int]]:
    """(BN, BK, warps) to try: accumulators of at most 8K fp32 values a program (4K where two weights)."""
    cap = 8192 if kind == "plain" else 4096
    return [(bn, bk, w) for bn, bk, w in itertools.product((2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8))
            if bn * bk <= cap]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    c = PRESETS[a.preset]
    K, I, D, nq, nkv = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    rows: list[dict] = []

    def rec(**kw):
        rows.append(kw)
        print(json.dumps(kw), flush=True)

    x, d, ln = _r(1, K), _r(1, K), 1 + _r(K, scale=0.1)
    xr = x.clone()  # the unfused path's residual, updated in place by add_rmsnorm (its scale drifts: the norm
    #                 does not see it)
    h = _r(1, I)
    bytes_of = {}
    # plain: o_proj [K, nq D] and down_proj [K, I]
    plain = {"o_proj": (_copies(_r(K, nq * D, scale=K ** -0.5)), _r(1, nq * D)),
             "down_proj": (_copies(_r(K, I, scale=I ** -0.5)), h)}
    for op, (ws, inp) in plain.items():
        bytes_of[op] = ws[0].numel() * 2
        rec(kind="plain", op=op, variant="cublas", us=1e3 * graph_ms([lambda w=w: F.linear(inp, w) for w in ws], a.iters))
        want = F.linear(inp, ws[0])
        for shape in shapes_for("plain"):
            err = _err(gv.gemv(inp, ws[0], shape), want)
            us = 1e3 * graph_ms([lambda w=w, s=shape: gv.gemv(inp, w, s) for w in ws], a.iters)
            rec(kind="plain", op=op, variant=list(shape), us=us, rel_err=err)
    # gate_up
    wgu = _copies(_r(2 * I, K, scale=K ** -0.5))
    bytes_of["gate_up"] = wgu[0].numel() * 2
    rec(kind="gate_up", op="gate_up", variant="cublas",
        us=1e3 * graph_ms([lambda w=w: fused.silu_mul(F.linear(fused.add_rmsnorm(xr, d, ln, 1e-5)[1], w))
                           for w in wgu], a.iters))
    want = gv.norm_gate_up_silu_ref(x, d, ln, 1e-5, wgu[0])[1]
    for shape in shapes_for("gate_up"):
        err = _err(gv.norm_gate_up_silu(x, d, ln, 1e-5, wgu[0], shape)[1], want)
        us = 1e3 * graph_ms([lambda w=w, s=shape: gv.norm_gate_up_silu(x, d, ln, 1e-5, w, s) for w in wgu], a.iters)
        rec(kind="gate_up", op="gate_up", variant=list(shape), us=us, rel_err=err)
    # qkv
    wq = _copies(_r((nq + 2 * nkv) * D, K, scale=K ** -0.5))
    bytes_of["qkv"] = wq[0].numel() * 2
    inv = rope_inv_freq(c).cuda()
    pos, slots = torch.tensor([700], device="cuda"), torch.tensor([700], device="cuda")
    kv = _r(2, 1, nkv, 1024, D)

    def unfused_qkv(w):
        hh = fused.add_rmsnorm(xr, d, ln, 1e-5)[1]
        fused.rope_store_kv(F.linear(hh, w).view(1, 1, nq + 2 * nkv, D), pos[None], inv, nq, nkv, kv[0], kv[1],
                            slots[None])
    rec(kind="qkv", op="qkv", variant="cublas", us=1e3 * graph_ms([lambda w=w: unfused_qkv(w) for w in wq], a.iters))
    want = gv.norm_qkv_rope_store_ref(x, d, ln, 1e-5, wq[0], None, pos, inv, nq, nkv, kv[0].clone(), kv[1].clone(),
                                      slots)[1]
    for shape in shapes_for("qkv"):
        if shape[0] > D // 2:
            continue
        err = _err(gv.norm_qkv_rope_store(x, d, ln, 1e-5, wq[0], None, pos, inv, nq, nkv, kv[0], kv[1], slots,
                                          launch=shape)[1], want)
        us = 1e3 * graph_ms([lambda w=w, s=shape: gv.norm_qkv_rope_store(x, d, ln, 1e-5, w, None, pos, inv, nq, nkv,
                                                                         kv[0], kv[1], slots, launch=s) for w in wq],
                            a.iters)
        rec(kind="qkv", op="qkv", variant=list(shape), us=us, rel_err=err)
    # the best shape per kind: least total time over the kind's ops, among variants within 2e-2
    best: dict[str, tuple] = {}
    for kind in ("plain", "gate_up", "qkv"):
        totals: dict[tuple, float] = {}
        for r in rows:
            if r["kind"] == kind and r["variant"] != "cublas":
                key = tuple(r["variant"])
                totals[key] = totals.get(key, 0.0) + (r["us"] if r["rel_err"] < 2e-2 else float("inf"))
        best[kind] = min(totals, key=totals.get)
    print("\nbest per op (GB/s = weight bytes / time), against cuBLAS and the small kernels it replaces:")
    for r in rows:
        if r["variant"] == "cublas":
            b = next(x for x in rows if x["op"] == r["op"] and x["variant"] == list(best[r["kind"]]))
            print(f"  {r['op']:10s} {str(best[r['kind']]):18s} {b['us']:8.2f} us ({bytes_of[r['op']] / b['us'] / 1e3:6.0f}"
                  f" GB/s)  cuBLAS path {r['us']:8.2f} us ({bytes_of[r['op']] / r['us'] / 1e3:6.0f} GB/s)")
    # the LM head at one row: the best plain shape against cuBLAS (not used by the layers; for reference)
    lm = _copies(_r(c.vocab_size, K, scale=K ** -0.5))
    xs = _r(1, K)
    cub = 1e3 * graph_ms([lambda w=w: F.linear(xs, w) for w in lm], a.iters)
    tri = 1e3 * graph_ms([lambda w=w: gv.gemv(xs, w, best["plain"]) for w in lm], a.iters)
    rec(kind="plain", op="lm_head", variant="cublas", us=cub)
    rec(kind="plain", op="lm_head", variant=list(best["plain"]), us=tri, rel_err=_err(gv.gemv(xs, lm[0], best["plain"]),
                                                                                    F.linear(xs, lm[0])))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gemv_launch.json"), "w") as f:
        json.dump({k: list(v) for k, v in best.items()}, f)
    with open(os.path.join(a.out, f"gemv_sweep_{a.preset}.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "preset": a.preset, "rows": rows}, f)


if __name__ == "__main__":
    main()
