"""The one-row GEMV kernels (tandem.kernels.gemv) reading W12 records against reading bf16 weights, and
cuBLAS, at the Llama-3-8B projection shapes and its LM head: microseconds a call inside a CUDA graph
(bench/gpu_timing.py), cycling over enough weight copies that reads come from HBM, and the bytes a second
that makes. Weights: tests/gpu/test_gpu_w12.py's realistic_weights (Student-t with per-channel scales over
a decade, outlier columns, a channel of zeros, one of denormals and one mostly under its window; their
escape rate and bits per weight are printed). Each W12 output is checked against the bf16 kernel's.

    python bench/gpu_w12_gemv.py --out $OUT [--launches 2/2048/8,4/1024/8] [--iters 100]

The issue's W12 bar is end to end (`ar` at the 8B shape <= 3.7 ms/token on the H200:
`python bench/gpu_core.py --preset llama3-8b --w12`); this is the per-kernel view of it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))

from gpu_timing import graph_ms  # noqa: E402
from tandem.bench.presets import PRESETS  # noqa: E402
from tandem.kernels import gemv as gv  # noqa: E402
from tandem.quant.w12 import encode_w12, gemv_operand, w12_stats  # noqa: E402
from test_gpu_w12 import _shapes, realistic_weights  # noqa: E402

HBM_BYTES = 384 << 20  # weight bytes cycled per timing: several times the L2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    ap.add_argument("--launches", default="2/2048/8,2/1024/8,4/1024/8,4/512/4,8/512/4,2/512/4",
                    help="the W12 kernel's (BN, BK, warps) to time; the bf16 kernel runs at its LAUNCH['plain']")
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    launches = [tuple(int(v) for v in s.split("/")) for s in args.launches.split(",")]
    rows, bad = [], 0
    torch.set_grad_enabled(False)  # (the kernels run only without autograd: tandem.kernels.fused.triton_enabled)
    for name, (n, k) in _shapes(PRESETS[args.preset]).items():
        w = realistic_weights(n, k, seed=n + k)
        rec, esc = encode_w12(w)
        st = w12_stats(rec, esc)
        op = gemv_operand(rec, esc)
        copies = max(2, -(-HBM_BYTES // (2 * n * k)))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        ops = [op] + [gv.W12Gemv(op.data.clone(), op.b7, op.esc_off, op.esc_col, op.esc_bits, op.shape)
                      for _ in range(copies - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = gv.gemv(x, w)
        base = {"shape": name, "n": n, "k": k, "escape_rate": st.escape_rate, "bits_per_weight": st.bits_per_weight}
        us_cublas = graph_ms([lambda w=w_: F.linear(x, w) for w_ in ws], args.iters) * 1e3
        us_bf16 = graph_ms([lambda w=w_: gv.gemv(x, w) for w_ in ws], args.iters) * 1e3
        print(f"{name} [{n}, {k}]: escape rate {st.escape_rate:.2e}, {st.bits_per_weight:.3f} bits a weight; "
              f"cuBLAS {us_cublas:.1f} us, bf16 GEMV {us_bf16:.1f} us ({2 * n * k / us_bf16 / 1e6:.2f} TB/s)", flush=True)
        rows.append({**base, "kernel": "cublas", "us": us_cublas})
        rows.append({**base, "kernel": "gemv bf16", "launch": list(gv.LAUNCH["plain"]), "us": us_bf16})
        for launch in launches:
            try:
                err = rel_err(gv.gemv(x, op, launch), want)
                us = graph_ms([lambda o=o_, la=launch: gv.gemv(x, o, la) for o_ in ops], args.iters) * 1e3
            except Exception as e:  # noqa: BLE001 - a launch shape that cannot compile is recorded, the rest go on
                print(f"  W12 {launch}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            ok = err < 1e-2
            bad += not ok
            tbps = st.stored_bytes / us / 1e6
            rows.append({**base, "kernel": "gemv w12", "launch": list(launch), "us": us, "rel_err": err, "ok": ok,
                         "TBps": tbps, "vs_bf16": us_bf16 / us, "vs_cublas": us_cublas / us})
            print(f"  W12 {launch}: {us:.1f} us ({tbps:.2f} TB/s of its bytes), {us_bf16 / us:.2f}x the bf16 GEMV, "
                  f"{us_cublas / us:.2f}x cuBLAS, rel err {err:.1e}{'' if ok else '  MISMATCH'}", flush=True)
        del ws, ops
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "w12_gemv.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
