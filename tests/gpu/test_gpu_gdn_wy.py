"""GPU lane: the GDN WY kernel (tandem.kernels.gdn_wy) compiled, its products on bf16 tensor cores, at
transformers' default Qwen3.5 GDN shape (32 value heads of 128 x 128): against per-node snapshots for
both solves, within one bf16 ulp of the path kernel (three pieces a product; one piece is not), a state
carried through committed one-node passes, and a tiny hybrid target decoding through it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gpu_lane import NEEDS_CUDA, no_grad
from test_gpu_gdn_path import _inputs, _tree
from tandem.kernels.gdn import gdn_replay, gdn_snapshots_ref
from tandem.kernels.gdn_path import gdn_path_commit, gdn_path_tree, root_paths
from tandem.kernels.gdn_wy import SOLVES, bf16_ulps, gdn_wy_commit_, gdn_wy_tree
from tandem.tree.draft_tree import ancestor_mask

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]

def _on_path(parents: list[int], node: int) -> torch.Tensor:
    on = torch.zeros(len(parents), dtype=torch.bool)
    while node >= 0:
        on[node], node = True, parents[node]
    return on.cuda()


@pytest.mark.parametrize("solve", SOLVES)
@pytest.mark.parametrize("n", [1, 17, 33, 64, 65])
def test_wy_kernel_equals_snapshots(n, solve):
    parents = _tree(n, n)
    S0, q, k, v, decay, beta = _inputs(n, n)
    ref, snaps = gdn_snapshots_ref(S0, q, k, v, decay, beta, parents)
    o, U, G = gdn_wy_tree(S0, q, k, v, decay, beta, ancestor_mask(parents, "cuda"), solve=solve)
    assert torch.allclose(o, ref, atol=1e-4, rtol=1e-4), (o - ref).abs().max()
    S = gdn_wy_commit_(S0.clone(), k, U, G, _on_path(parents, n - 1), n - 1)
    assert torch.allclose(S, snaps[n - 1], atol=1e-4, rtol=1e-4), (S - snaps[n - 1]).abs().max()


@pytest.mark.parametrize("solve", SOLVES)
def test_wy_kernel_within_one_bf16_ulp_of_the_path_kernel(solve):
    n = 32
    parents = _tree(n, 7)
    S0, q, k, v, decay, beta = _inputs(n, 7)
    paths, lens = (t.cuda() for t in root_paths(parents))
    o_path = gdn_path_tree(S0, q, k, v, decay, beta, paths, lens)
    S_path = gdn_path_commit(S0.clone(), k, v, decay, beta, paths, lens, n - 1)
    worst = {}
    for pieces in (3, 1):
        o, U, G = gdn_wy_tree(S0, q, k, v, decay, beta, ancestor_mask(parents, "cuda"), pieces=pieces, solve=solve)
        S = gdn_wy_commit_(S0.clone(), k, U, G, _on_path(parents, n - 1), n - 1, pieces=pieces)
        worst[pieces] = max(bf16_ulps(o, o_path).max().item(), bf16_ulps(S, S_path).max().item())
    assert worst[3] <= 1.0 < worst[1], worst


def test_committed_state_carried_over_one_node_passes():
    n = 48
    S0, q, k, v, decay, beta = _inputs(n, 4)
    S_wy, S_ref = S0.clone(), S0.clone()
    one_anc, one_on = torch.ones(1, 1, dtype=torch.bool, device="cuda"), torch.ones(1, dtype=torch.bool, device="cuda")
    for i in range(n):
        args = [t[:, i:i + 1].contiguous() for t in (q, k, v, decay, beta)]
        _, U, G = gdn_wy_tree(S_wy, *args, one_anc)
        S_wy = gdn_wy_commit_(S_wy, args[1], U, G, one_on, 0)
        S_ref = gdn_replay(S_ref, *args[1:], [0])
    assert torch.allclose(S_wy, S_ref, atol=1e-5, rtol=1e-4), (S_wy - S_ref).abs().max()


def test_hybrid_target_through_the_wy_kernel_equals_ar():
    """The interpreter checks' tiny hybrid target on the GPU (eager; its captured passes are the
    hybrid graphs lane's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gdn_wy_checks

    gdn_wy_checks.check_model("cuda")
