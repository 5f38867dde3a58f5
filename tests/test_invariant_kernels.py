"""Deterministic mode's batch invariance (tandem.engine.invariant and its CUDA kernels):
identical logits rows for a row alone and among N rows, for a tree node and its AR step.

The torch reference path is checked here directly. The Triton kernels (invariant GEMM, invariant
attention) run on the CPU only through Triton's interpreter, which must be switched on before
Triton is imported: tests/invariant_checks.py runs them in a subprocess with TRITON_INTERPRET=1,
under this interpreter when it has Triton, else under $TANDEM_TRITON_PYTHON (a Python with torch
and Triton installed). The GPU lane holds the bf16 checks on a real GPU (tests/gpu/test_gpu_invariant.py).
"""
from __future__ import annotations

import pytest
import torch

from invariant_checks import model_rows_alone_and_among
from models_for_tests import tiny_model
from triton_interpreter import NEEDS_TRITON, run_checks


@pytest.mark.parametrize("graphs", [None, "emulate"], ids=["exact", "bucket"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_deterministic_pass_gives_a_row_the_same_logits_alone_among_rows_and_as_a_tree_node(dtype, graphs):
    """A prefill chunk alone or between two other requests' chunks (padded into a graph bucket of
    32 rows when emulated), a tree alone or beside another request's decode row, and each tree
    node against the AR step with the same tokens at the same positions: the same bits."""
    model = tiny_model(seed=0).to(dtype)
    pairs, graphed = model_rows_alone_and_among(model, use_graphs=graphs)
    assert graphed == (graphs is not None)
    for i, (alone, among) in enumerate(pairs):
        assert alone.shape == among.shape and torch.equal(alone, among), i


@NEEDS_TRITON
def test_invariant_kernels_under_the_triton_interpreter():
    """The invariant GEMM's rows bitwise the same for M = 1, 37, 64, 130 and close to F.linear;
    the invariant attention's tree node bitwise its AR step's (1- and 2-word masks) and a row the
    same alone and among others, close to SDPA; the engine's deterministic mode with the kernels
    in its pass giving one greedy output alone, in a batch and with or without speculation (fp32; the attention
    kernel in the pass: see invariant_checks.check_model)."""
    run_checks("invariant_checks.py", 3)
