"""The GDN WY kernel (tandem.kernels.gdn_wy) on the CPU, through Triton's interpreter.

tests/gdn_wy_checks.py runs in a subprocess (tests/triton_interpreter.py); the GPU lane runs the
same kernel compiled, with real bf16 tensor-core products (tests/gpu/test_gpu_gdn_wy.py).
"""
from __future__ import annotations

import pytest

from triton_interpreter import NEEDS_TRITON, run_checks
from tandem.config import ConfigError


@NEEDS_TRITON
def test_gdn_wy_kernel_under_the_triton_interpreter():
    """The kernel's outputs and commits equal per-node snapshots on random forests (both solves);
    within one bf16 ulp of the path kernel with three bf16 pieces a product, not with one; a state
    carried through 64 committed passes stays with token-by-token decoding; a tiny Qwen3.5 target
    through it (eager and captured, emulated) equals the walk, and greedy tree equals ar."""
    run_checks("gdn_wy_checks.py", 4)


def test_wy_triton_off_cuda_is_a_config_error(monkeypatch):
    from tandem.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen35Config
    from tandem.runtime.hybrid import HybridTarget
    from tandem.tree.draft_tree import DraftTree

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = Qwen35Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       layer_types=("linear_attention", "full_attention"), linear_key_head_dim=4,
                       linear_value_head_dim=4, linear_num_key_heads=1, linear_num_value_heads=2)
    model = Qwen3_5ForCausalLM(cfg).eval()
    model.gdn_tree = "wy_triton"
    with pytest.raises(ConfigError, match="GDN wy_triton kernel .* runs on CUDA.*TANDEM_GDN_TREE=walk or wy"):
        HybridTarget(model, capacity=8).logits(DraftTree.chain([1, 2]))
