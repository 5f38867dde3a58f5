"""Checks of the W12 Triton kernels (tandem.quant.w12_gemm), shared by tests/test_w12_kernels.py.

They run the GEMV and tensor-core kernels on the CPU through Triton's interpreter, which reads
TRITON_INTERPRET when Triton is imported, so they run in a process of their own:
`TRITON_INTERPRET=1 python tests/w12_checks.py` (what the test starts). The matrices have escapes
of every finite kind (zeros, denormals, window bottoms, a channel of zeros, an outlier channel whose
slots mostly escape: dense cells) and shapes that are not tile multiples, odd K included. Each check
raises AssertionError on failure; the script prints one line per passed check.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tandem.quant.w12 import encode_w12
from tandem.quant.w12_gemm import (GEMV_MAX_ROWS, GEMV_PROGRAMS_PER_SM, pack_w12, w12_gemv_emulated, w12_linear,
                                   w12_linear_emulated, w12_linear_ref)


def _bits(v: int) -> torch.Tensor:
    return torch.tensor(v - 0x10000 if v >= 0x8000 else v, dtype=torch.int16).view(torch.bfloat16)


def hard_matrix(n: int, k: int, seed: int) -> torch.Tensor:
    """Student-t weights with per-channel scales, plus every finite kind of escape."""
    g = torch.Generator().manual_seed(seed)
    chi2 = torch.randn(3, n, k, generator=g).pow(2).sum(0) / 3
    w = (torch.randn(n, k, generator=g) / chi2.sqrt() * 10 ** (torch.rand(n, 1, generator=g) - 2.5)).to(torch.bfloat16)
    w[1, :] = 0  # a channel of zeros: B_n = 0, no corrections
    w[2, : k // 2] = _bits(0x0003)  # denormals in half a channel
    w[3, 0] = w[3].float().abs().max() * 2.0**20  # an outlier: most of channel 3 escapes below its window (dense)
    for i, v in enumerate((0x0000, 0x8000, 0x0001, 0x807F, 0x0080)):  # +-0, denormals, the smallest normal
        w[(7 * i + 5) % n, (11 * i + 3) % k] = _bits(v)
    top = int(((w[4].view(torch.int16).int() >> 7) & 0xFF).max())
    w[4, k // 3] = -(2.0 ** (top - 15 - 127))  # the window bottom itself: an escape whose slot decodes to z_n
    return w


MATRICES = {  # name: (N, K, GEMV block_n, SM count for the split)
    "150x200": (150, 200, 128, 4),
    "200x100": (200, 100, 64, 1),  # one K split: the GEMV and dot kernels round and store their own results
    "70x101": (70, 101, 32, 4),  # odd K: x is padded to an even row stride for the GEMV
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _case(name: str):
    n, k, block_n, sms = MATRICES[name]
    w = hard_matrix(n, k, seed=n + k)
    r, e = encode_w12(w)
    p = pack_w12(r, e, "cpu", sms=sms, gemv_block_n=block_n)
    x = torch.randn(36, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    exact = x.double() @ w.double().T  # [36, N]
    scale = x.double().abs() @ w.double().abs().T  # each output's error scale
    return w, r, e, p, x, exact, scale, (sms, block_n)


def _close(got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, ref: torch.Tensor) -> float:
    """Within bf16 rounding: a relative (norm) error under 1e-2 against the reference, and every output within
    1e-2 of its error scale (sum |x| |w|) of the exact product. Returns the largest such scaled error."""
    assert rel_err(got, ref) < 1e-2, rel_err(got, ref)
    err = ((got.double() - exact).abs() / scale.clamp_min(1e-30)).max().item()
    assert err <= 1e-2, err
    return err


def check_gemv() -> None:
    """The GEMV kernel (run up to 8 rows here): bitwise its torch emulation; within bf16 rounding of the
    reference; a row's bits the same alone and among up to 8 rows (and in a second row group of 8)."""
    errs = []
    for name in MATRICES:
        w, r, e, p, x, exact, scale, (sms, block_n) = _case(name)
        if name == "150x200":
            assert int(p.gemv.dense_off[-1]) > 0 and p.gemv.splits > 1  # dense cells and a K split are exercised
        gemv = dict(gemv_max_rows=8)
        y8 = w12_linear(x[:8], p, **gemv)  # [8, N]
        emu = w12_gemv_emulated(x[:8], r, e, sms=sms, block_n=block_n, programs_per_sm=GEMV_PROGRAMS_PER_SM)
        assert torch.equal(y8, emu), name
        errs.append(_close(y8, exact[:8], scale[:8], w12_linear_ref(x[:8], r, e)))
        for m in (2, 5):
            assert torch.equal(w12_linear(x[:m], p, **gemv), y8[:m]), (name, m)
        for i in (0, 7):
            assert torch.equal(w12_linear(x[i:i + 1], p, **gemv), y8[i:i + 1]), (name, i)
        y11 = w12_linear(x[:11], p, gemv_max_rows=16)  # rows 8..10: a second group (of 8, three of them real)
        assert torch.equal(y11[:8], y8) and torch.equal(w12_linear(x[9:10], p, **gemv), y11[9:10]), name
        assert torch.equal(w12_linear(x[:GEMV_MAX_ROWS], p), y8[:GEMV_MAX_ROWS])  # the default dispatch
    print(f"gemv: ok (largest error / scale {max(errs):.1e})")


def check_dot() -> None:
    """The tensor-core kernel (M > gemv_max_rows): within bf16 rounding of the reference and close to
    its torch emulation; a row's bits the same alone and among 36 rows (three 16-row blocks)."""
    errs = []
    for name in MATRICES:
        w, r, e, p, x, exact, scale, (sms, _) = _case(name)
        if name == "150x200":
            assert int(p.dot.dense_off[-1]) > 0 and p.dot.splits > 1
        y36 = w12_linear(x, p, gemv_max_rows=0)  # [36, N]
        errs.append(_close(y36, exact, scale, w12_linear_ref(x, r, e)))
        assert rel_err(y36, w12_linear_emulated(x, r, e, sms=sms)) < 1e-3, name  # (fp32 sums in other orders)
        for m in (9, 17):
            assert torch.equal(w12_linear(x[:m], p, gemv_max_rows=0), y36[:m]), (name, m)
        for i in (0, 35):
            assert torch.equal(w12_linear(x[i:i + 1], p, gemv_max_rows=0), y36[i:i + 1]), (name, i)
        m = GEMV_MAX_ROWS + 1  # the default dispatch: from here on, this kernel
        assert torch.equal(w12_linear(x[:m], p), y36[:m]), name
    print(f"dot: ok (largest error / scale {max(errs):.1e})")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (the kernels then run on the CPU)"
    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)
    with torch.no_grad():
        for check in (check_gemv, check_dot):
            check()
    sys.exit(0)
