"""Launch shapes of the fused layer kernels and the cached attention, timed on the GPU.

For the bundled target's and draft's layer widths (and the EAGLE-3 head's q/k/v over 2 x hidden),
at 1 row (an AR step) and 33 (a tree verify of N = 32): the unfused launches a fused kernel
replaces, then each fused launch shape (BK: the loop's column step; warps;
BN for gate/up), and the cached attention's BLOCK_N x warps at attention widths 256 and 512; each variant's output is
checked against its reference (relative error; the best shape is picked among those under 2e-2).
--pre: each fused variant with its first weight step loaded before the PDL wait and after it (`_pre1` / `_pre0`
in the variant's name; without --pre, as TANDEM_PRELOAD says), plus a whole-K step (BK 512).
Times are per call inside a CUDA graph of back-to-back calls (bench/gpu_timing.graph_ms: the GPU's
own time, as the runners' graphs see it), median over replays; bf16.
    python bench/gpu_fused_layer.py [--iters 400] [--pre]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from gpu_timing import graph_ms
from tandem.kernels import attention, fused, fused_layer as fl
from tandem.models.layers import rope_inv_freq
from tandem.models.loader import read_config
from tandem.runtime.pair import BUNDLED_DRAFT, BUNDLED_TARGET


def _r(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--pre", action="store_true", help="time each variant with the weights' preload on and off")
    a = ap.parse_args()
    pres = (True, False) if a.pre else (None,)

    def tag(pre):
        return "" if pre is None else f"_pre{int(pre)}"

    rows_out = []

    def rec(**kw):
        rows_out.append(kw)
        print(json.dumps(kw), flush=True)

    def timed(fn, want, **kw):  # one variant: its relative error against want, its time in a graph
        err = ((fn().float() - want.float()).norm() / want.float().norm()).item()
        rec(**kw, us=1e3 * graph_ms([fn], a.iters), rel_err=err)

    torch.set_grad_enabled(False)
    for name, path in (("target", BUNDLED_TARGET), ("draft", BUNDLED_DRAFT)):
        c = read_config(path)
        K, D, nq, nkv, inter = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, \
            c.intermediate_size
        inv = rope_inv_freq(c).cuda()
        for M in (1, 33):
            x, d, ln = _r(M, K), _r(M, K), 1 + _r(K, scale=0.1)
            pos = torch.arange(100, 100 + M, device="cuda")
            slots = torch.arange(M, device="cuda")
            kv = _r(2, 1, nkv, 512, D)
            for qkv_in, norm in ((K, True), (2 * K, False)) if name == "target" else ((K, True),):
                xi = x if qkv_in == K else _r(M, qkv_in)
                w = _r((nq + 2 * nkv) * D, qkv_in, scale=qkv_in ** -0.5)
                label = "qkv" if norm else "qkv_eagle3"

                def unfused():
                    h = fused.add_rmsnorm(xi.clone() if norm else xi, d if norm else None, ln, 1e-5)[1] if norm else xi
                    qkv = F.linear(h, w).view(1, M, nq + 2 * nkv, D)
                    fused.rope_store_kv(qkv, pos[None], inv, nq, nkv, kv[0], kv[1], slots[None])
                rec(shape=name, op=label, rows=M, variant="unfused", us=1e3 * graph_ms([unfused], a.iters))
                want = fl.norm_qkv_rope_store_ref(xi, d if norm else None, ln if norm else None, 1e-5, w, None, pos,
                                                  inv, nq, nkv, kv[0].clone(), kv[1].clone(), slots)[1]
                shapes = ((128, 4, 32), (512, 8, 32), (512, 4, 16), (128, 4, 16)) if a.pre else \
                    ((64, 4, 32), (128, 4, 32), (128, 8, 32), (128, 4, 16), (64, 4, 16), (128, 2, 16))
                for (bk, nw, cb), pre in itertools.product(shapes, pres):
                    def f(bk=bk, nw=nw, cb=cb, pre=pre):
                        return fl.launch_norm_qkv(xi, d if norm else None, ln if norm else None, 1e-5, w, None, pos,
                                                  inv, nq, nkv, kv[0], kv[1], slots, bk=bk, num_warps=nw, cb=cb,
                                                  pre=pre)[1]
                    timed(f, want, shape=name, op=label, rows=M, variant=f"bk{bk}_w{nw}_cb{cb}{tag(pre)}")
            wgu = _r(2 * inter, K, scale=K ** -0.5)

            def unfused_gu():
                h = fused.add_rmsnorm(x.clone(), d, ln, 1e-5)[1]
                fused.silu_mul(F.linear(h, wgu))
            rec(shape=name, op="gate_up", rows=M, variant="unfused", us=1e3 * graph_ms([unfused_gu], a.iters))
            want = fl.norm_gate_up_silu_ref(x, d, ln, 1e-5, wgu)[1]
            gshapes = ((128, 64, 4), (128, 32, 4), (512, 32, 8), (512, 16, 4)) if a.pre else \
                tuple(itertools.product((64, 128), (16, 32, 64), (2, 4)))
            for (bk, bn, nw), pre in itertools.product(gshapes, pres):
                def g(bk=bk, bn=bn, nw=nw, pre=pre):
                    return fl.launch_norm_gate_up(x, d, ln, 1e-5, wgu, bk=bk, bn=bn, num_warps=nw, pre=pre)[1]
                timed(g, want, shape=name, op="gate_up", rows=M, variant=f"bk{bk}_bn{bn}_w{nw}{tag(pre)}")
            for N_out, K_in, op in ((K, nq * D, "o_proj"), (K, inter, "down_proj")):
                xo, wo = _r(M, K_in), _r(N_out, K_in, scale=K_in ** -0.5)
                want = F.linear(xo, wo)
                for (bk, bn, nw), pre in itertools.product(((256, 16, 2), (512, 16, 4), (1024, 16, 4)) if a.pre
                                                           else ((256, 16, 2),), pres):
                    def li(bk=bk, bn=bn, nw=nw, pre=pre, xo=xo, wo=wo):
                        return fl.launch_linear(xo, wo, bk=bk, bn=bn, num_warps=nw, pre=pre)
                    timed(li, want, shape=name, op=op, rows=M, variant=f"bk{bk}_bn{bn}_w{nw}{tag(pre)}")
            if a.pre:
                continue  # (the attention's shapes: without --pre)
            for W in (256, 512):
                q = _r(1, M, nq, D)
                k, v = _r(1, nkv, W, D), _r(1, nkv, W, D)
                mask = torch.ones(1, 1, M, W, dtype=torch.bool, device="cuda")
                want = attention.cached_attention_ref(q, k, v, mask)
                for bn, nw in itertools.product((32, 64, 128, 256), (2, 4, 8)):
                    def at(bn=bn, nw=nw):
                        return attention.cached_attention(q, k, v, mask, block_n=bn, num_warps=nw)
                    timed(at, want, shape=name, op=f"attention_w{W}", rows=M, variant=f"bn{bn}_w{nw}")
    # the best variant of each (shape, op, rows)
    best: dict = {}
    for r in rows_out:
        k = (r["shape"], r["op"], r["rows"])
        if r["variant"] != "unfused" and r.get("rel_err", 1) < 2e-2 and (k not in best or r["us"] < best[k]["us"]):
            best[k] = r
    print("\nbest per (shape, op, rows), against the unfused launches:")
    for k, r in best.items():
        base = next((x["us"] for x in rows_out if (x["shape"], x["op"], x["rows"]) == k and x["variant"] == "unfused"),
                    None)
        print(f"  {k}: {r['variant']} {r['us']:.2f} us, rel err {r['rel_err']:.1e}" + (f" (unfused {base:.2f} us)" if base else ""))


if __name__ == "__main__":
    main()
