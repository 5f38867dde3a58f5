"""Skinny GEMM (Triton) against cuBLAS (F.linear) for the Llama-3-8B projection shapes.

    python bench/gpu_gemm.py

For each (N, K) and row count M: correctness (rel. error vs an fp32 product) and median time
of both over rotating weight copies (so L2 does not serve repeats), with the achieved GB/s.
"""
from __future__ import annotations

import itertools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tandem.kernels.skinny_gemm import skinny_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def bench(fn, ws, x, iters=30):
    times = []
    for i in range(iters + 5):
        w = ws[i % len(ws)]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(x, w)
        e.record()
        e.synchronize()
        if i >= 5:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    configs = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
               for bn, bk, nw, ns in itertools.product((16, 32, 64), (128, 256), (4,), (4,))]
    print(f"{'shape':8s} {'M':>3s} {'cublas ms':>9s} {'GB/s':>6s} {'best triton ms':>14s} {'GB/s':>6s}  config")
    for name, (N, K) in SHAPES.items():
        copies = max(2, int(2e9 // (N * K * 2)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for M in (1, 2, 8, 32, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = (x.float() @ ws[0].float().T)
            t_cub = bench(lambda a, b: torch.nn.functional.linear(a, b), ws, x)
            best = None
            for cfg in configs:
                y = skinny_linear(x, ws[0], **cfg)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (name, M, cfg, err)
                t = bench(lambda a, b, c=cfg: skinny_linear(a, b, **c), ws, x)
                if best is None or t < best[0]:
                    best = (t, cfg)
            gb = N * K * 2 / 1e9
            print(f"{name:8s} {M:3d} {t_cub:9.4f} {gb / t_cub * 1e3:6.0f} {best[0]:14.4f} {gb / best[0] * 1e3:6.0f}  {best[1]}")
        del ws


if __name__ == "__main__":
    main()
