"""The GDN path kernel (tandem.kernels.gdn_path) on the CPU, through Triton's interpreter.

tests/gdn_path_checks.py runs in a subprocess (tests/triton_interpreter.py); the GPU lane runs the
same checks compiled (tests/gpu/test_gpu_gdn_path.py).
"""
from __future__ import annotations

import pytest

from triton_interpreter import NEEDS_TRITON, run_checks
from tandem.config import ConfigError
from tandem.kernels.gdn_path import root_paths


def test_root_paths_of_a_forest():
    # 0 -> {1, 3}, 1 -> 2, and 4 a second root
    paths, lens = root_paths([-1, 0, 1, 0, -1])
    assert lens.tolist() == [1, 2, 3, 2, 1]
    assert paths.tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 3, -1], [4, -1, -1]]


@NEEDS_TRITON
def test_gdn_path_kernel_under_the_triton_interpreter():
    """The kernel's outputs and commits equal the torch walk on random forests (value widths across
    the 32-column blocks, key widths not powers of two); a tree node's output equals committing its
    parent's path then decoding it alone, and a chain pass equals decoding row by row, bitwise; a tiny
    Qwen3.5 target through the kernel equals the walk's logits and state, and greedy tree equals ar."""
    run_checks("gdn_path_checks.py", 3)


@pytest.mark.parametrize("kernel", ["path", "wy_triton"])
def test_triton_kernels_off_cuda_are_a_config_error(kernel, monkeypatch):
    from tandem.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen35Config
    from tandem.runtime.hybrid import HybridTarget
    from tandem.tree.draft_tree import DraftTree

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = Qwen35Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       layer_types=("linear_attention", "full_attention"), linear_key_head_dim=4,
                       linear_value_head_dim=4, linear_num_key_heads=1, linear_num_value_heads=2)
    model = Qwen3_5ForCausalLM(cfg).eval()
    model.gdn_tree = kernel
    with pytest.raises(ConfigError, match=f"GDN {kernel} kernel .* runs on CUDA.*TANDEM_GDN_TREE=walk or wy"):
        HybridTarget(model, capacity=8).logits(DraftTree.chain([1, 2]))
