"""The fused decoder-layer kernels (tandem.kernels.fused_layer) on the CPU, through Triton's interpreter.

tests/fused_layer_checks.py runs in a subprocess (tests/triton_interpreter.py). The GPU lane runs the
same kernels compiled, in bf16 too, and a whole model through them (tests/gpu/test_gpu_fused_layer.py).
"""
from __future__ import annotations

from triton_interpreter import NEEDS_TRITON, run_checks


@NEEDS_TRITON
def test_fused_layer_kernels_under_the_triton_interpreter():
    """Each kernel equals its unfused reference (fp32) across row blocks, odd widths, with and without the
    residual delta and a q/k/v bias (the o_proj / down_proj kernel too), with K/V rows at scattered slots and no other cache row touched; a
    Llama and a Qwen2 model's prefill and tree passes (with target features), an EAGLE-3 head's layer and
    the batched engine's pass over the paged pool, through the fused kernels, equal their unfused passes."""
    run_checks("fused_layer_checks.py", 6)
