"""An EAGLE-3 head's fused level kernels (tandem.kernels.head_level) on the CPU, through Triton's interpreter.

tests/head_level_checks.py runs in a subprocess (tests/triton_interpreter.py). The GPU lane runs the same
kernels compiled, in bf16 too and replayed in a CUDA graph (tests/gpu/test_gpu_head_level.py).
"""
from __future__ import annotations

import torch

from tandem.kernels import head_level as hl
from triton_interpreter import NEEDS_TRITON, run_checks


@NEEDS_TRITON
def test_head_level_kernels_under_the_triton_interpreter():
    """The fused top-k (residual add, final norm, LM head, per-block top-k, the last program's merge)
    equals its reference, ties included, and leaves its counter zero; the selection kernel's tree equals
    the reference's across widths, budgets, zero-probability children and ties; the q/k/v kernel with
    the input norms and the parent-row gather in its prologue equals the norms then q/k/v; and a tiny
    head's levels grown with every kernel on equal those grown with none
    (which also catches a level's rows reading another level's positions); the resident loop's pass
    views (positions, slots, masks of a context pass and of a tree pass) equal theirs; the loop's commit
    (the path's K/V rows and the features in one launch) equals index_select then index_copy; and the block
    drafter's tree selection kernel, which shares its best-N and ancestor helpers, equals its reference."""
    run_checks("head_level_checks.py", 7)


def test_head_select_ref_is_the_best_first_tree_of_the_levels():
    """The reference itself: the n nodes of highest cumulative log-prob (ties to the earlier node),
    prefix-closed, in node order, with depths from the layout and the ancestor mask of the parents."""
    # w = 2, depth 3: nodes 0-1 at depth 1; 2-5 children of the fed nodes of level 1; 6-9 of level 2
    lp = torch.tensor([-0.1, -0.5, -0.3, -2.0, -0.6, -0.6, -0.4, -3.0, -0.9, -5.0])
    par = torch.tensor([-1, -1, 0, 0, 1, 1, 2, 2, 4, 4])
    tok = torch.arange(100, 110)
    t, p, d, anc = hl.head_select_ref(lp, tok, par, torch.tensor([7]), 2, 3, 5)
    # the five best: 0 (-0.1), 2 (-0.3), 6 (-0.4), 1 (-0.5), then 4 and 5 tie at -0.6: 4 (earlier)
    assert t.tolist() == [7, 100, 101, 102, 104, 106]
    assert p.tolist() == [-1, 0, 0, 1, 2, 3]
    assert d.tolist() == [0, 1, 1, 2, 2, 3]
    assert anc[5].tolist() == [True, True, False, True, False, True]  # node 6 <- 2 <- 0 <- root
    assert anc.diagonal().all() and not anc.triu(1).any()
    assert hl.level_depths(2, 10).tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
