"""The one-row GEMV layer kernels of large models (tandem.kernels.gemv) on the CPU, through Triton's interpreter.

tests/gemv_checks.py runs in a subprocess (tests/triton_interpreter.py). The GPU lane runs the same kernels
compiled, at the Llama-3-8B shape, in bf16 too (tests/gpu/test_gpu_gemv.py).
"""
from __future__ import annotations

import pytest
import torch

from tandem.kernels import gemv as gv
from triton_interpreter import NEEDS_TRITON, run_checks


@NEEDS_TRITON
def test_gemv_kernels_under_the_triton_interpreter():
    """The plain GEMV, the gate/up GEMV with the norm in front and SiLU * up behind, and the q/k/v GEMV with
    the norm in front and RoPE + the K/V store behind equal their references (residuals exactly), and a tiny
    model decoded one row at a time through them gives the tokens, logits and features of the decode without;
    each of them reading a W12 matrix (records decoded in registers, escapes added after) gives what it gives
    with the decoded bf16 weight, and a tiny bf16 model decoded through W12 copies of its weights gives the
    tokens of its decode through the bf16 weights."""
    run_checks("gemv_checks.py", 6)


def test_gemv_stays_off_the_cpu_and_off_many_rows():
    """Off CUDA, and for more than one row, the kernels do not apply, and the calls are the torch ops."""
    x, w = torch.randn(1, 128), torch.randn(64, 128)
    assert not gv.applies(x, w)
    assert torch.equal(gv.gemv(x, w), torch.nn.functional.linear(x, w))
    assert not gv.applies(torch.randn(2, 128), w)


def test_set_launch_refuses_an_unknown_kind():
    saved = dict(gv.LAUNCH)
    try:
        gv.set_launch({"plain": [16, 256, 8]})
        assert gv.LAUNCH["plain"] == (16, 256, 8)
        with pytest.raises(ValueError, match="unknown GEMV kind 'down'"):
            gv.set_launch({"down": [8, 512, 4]})
    finally:
        gv.LAUNCH.update(saved)
