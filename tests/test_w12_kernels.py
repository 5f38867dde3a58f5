"""The W12 Triton kernels (tandem.quant.w12_gemm) on the CPU, through Triton's interpreter.

tests/w12_checks.py runs in a subprocess (tests/triton_interpreter.py). The GPU lane runs the same kernels compiled
(tests/gpu/test_gpu_w12.py); tests/test_w12.py checks their torch emulations without Triton.
"""
from __future__ import annotations

from triton_interpreter import NEEDS_TRITON, run_checks


@NEEDS_TRITON
def test_w12_kernels_under_the_triton_interpreter():
    """The GEMV kernel bitwise its torch emulation and a row's bits the same alone and among up to 8
    rows; the tensor-core kernel a row's bits the same alone and among 36 rows; both within bf16
    rounding of decode-then-matmul, on matrices with escapes of every finite kind, dense cells, one
    or several K splits and shapes that are not tile multiples (odd K included)."""
    run_checks("w12_checks.py", 2)
