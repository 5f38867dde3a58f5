"""The GDN WY kernel (tandem.kernels.gdn_wy) on the CPU, through Triton's interpreter.

tests/gdn_wy_checks.py runs in a subprocess (tests/triton_interpreter.py); the GPU lane runs the
same kernel compiled, with real bf16 tensor-core products (tests/gpu/test_gpu_gdn_wy.py).
"""
from __future__ import annotations

from triton_interpreter import NEEDS_TRITON, run_checks


@NEEDS_TRITON
def test_gdn_wy_kernel_under_the_triton_interpreter():
    """The kernel's outputs and commits equal per-node snapshots on random forests (both solves);
    within one bf16 ulp of the path kernel with three bf16 pieces a product, not with one; a state
    carried through 64 committed passes stays with token-by-token decoding; a tiny Qwen3.5 target
    through it (eager and captured, emulated) equals the walk, and greedy tree equals ar."""
    run_checks("gdn_wy_checks.py", 4)
