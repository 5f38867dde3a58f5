"""The cached-attention kernel (tandem.kernels.attention) on the CPU, through Triton's interpreter
(tests/attention_checks.py in a subprocess). The GPU lane runs it compiled (tests/gpu/test_gpu_kernels.py)."""
from __future__ import annotations

from triton_interpreter import NEEDS_TRITON, run_checks


@NEEDS_TRITON
def test_cached_attention_with_and_without_column_splits_equals_sdpa():
    """One program over all columns and the columns split across programs (then merged in a second
    launch) equal SDPA, for GQA groups, tree masks (a split can hold no column a row sees), several
    batches and widths that are not a multiple of the column block."""
    run_checks("attention_checks.py", 1)
