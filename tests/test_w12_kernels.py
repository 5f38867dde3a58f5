"""The W12 Triton kernels (tandem.quant.w12_gemm) on the CPU, through Triton's interpreter.

Triton reads TRITON_INTERPRET when it is imported, so tests/w12_checks.py runs in a subprocess with
TRITON_INTERPRET=1, under this interpreter when it has Triton, else under $TANDEM_TRITON_PYTHON (a
Python with torch and Triton installed). The GPU lane runs the same kernels compiled
(tests/gpu/test_gpu_w12.py); tests/test_w12.py checks their torch emulations without Triton.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _triton_python() -> str | None:
    if importlib.util.find_spec("triton") is not None:
        return sys.executable
    return os.environ.get("TANDEM_TRITON_PYTHON")


@pytest.mark.skipif(_triton_python() is None, reason="needs Triton for its CPU interpreter (CPU builds of torch ship "
                    "without it): install triton, or set TANDEM_TRITON_PYTHON to a Python that has it")
def test_w12_kernels_under_the_triton_interpreter():
    """The GEMV kernel bitwise its torch emulation and a row's bits the same alone and among up to 8
    rows; the tensor-core kernel a row's bits the same alone and among 36 rows; both within bf16
    rounding of decode-then-matmul, on matrices with escapes of every finite kind, dense cells, one
    or several K splits and shapes that are not tile multiples (odd K included)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    proc = subprocess.run([_triton_python(), str(TESTS / "w12_checks.py")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 2, proc.stdout  # gemv, dot
