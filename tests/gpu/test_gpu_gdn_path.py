"""GPU lane: the GDN path kernel (tandem.kernels.gdn_path) compiled, at transformers' default Qwen3.5
GDN shape (32 value heads of 128 x 128, 16 key heads), against the torch walk and the WY form; its bitwise
exactness (a tree node equals committing its parent's path and decoding it alone); and a random
hybrid target decoding through it (greedy tree equals ar, fp32).
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu_lane import NEEDS_CUDA, no_grad
from tandem.kernels.gdn import gdn_snapshots_ref, gdn_tree_wy
from tandem.kernels.gdn_path import gdn_path_commit, gdn_path_tree, root_paths
from tandem.tree.draft_tree import ancestor_mask

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]

H, DK, DV = 32, 128, 128


def _inputs(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, k, v = r(1, n, H, DK) * DK ** -0.5, F.normalize(r(1, n, H, DK), dim=-1), r(1, n, H, DV)
    decay = -torch.rand(1, n, H, generator=g, device="cuda")
    beta = torch.rand(1, n, H, generator=g, device="cuda")
    return r(1, H, DK, DV) * 0.1, q, k, v, decay, beta


def _tree(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(max(0, i - 4), i) for i in range(1, n)]  # deep-ish, as best-first trees are


@pytest.mark.parametrize("n", [1, 17, 33, 65])
def test_path_kernel_equals_walk_and_wy(n):
    parents = _tree(n, n)
    S0, q, k, v, decay, beta = _inputs(n, n)
    ref, snaps = gdn_snapshots_ref(S0, q, k, v, decay, beta, parents)
    paths, lens = (t.cuda() for t in root_paths(parents))
    o = gdn_path_tree(S0, q, k, v, decay, beta, paths, lens)
    assert torch.allclose(o, ref, atol=1e-4, rtol=1e-4), (o - ref).abs().max()
    wy, _, _ = gdn_tree_wy(S0, q, k, v, decay, beta, ancestor_mask(parents, "cuda"))
    assert torch.allclose(wy, ref, atol=1e-3, rtol=1e-3), (wy - ref).abs().max()  # (TF32 may be on)
    S = gdn_path_commit(S0.clone(), k, v, decay, beta, paths, lens, n - 1)
    assert torch.allclose(S, snaps[n - 1], atol=1e-4, rtol=1e-4), (S - snaps[n - 1]).abs().max()


def test_path_kernel_is_bitwise_exact():
    n = 24
    parents = _tree(n, 3)
    S0, q, k, v, decay, beta = _inputs(n, 3)
    pl = [t.cuda() for t in root_paths(parents)]
    one_node = [t.cuda() for t in root_paths([-1])]
    o = gdn_path_tree(S0, q, k, v, decay, beta, *pl)
    for i in range(n):
        p = parents[i]
        S = S0.clone() if p < 0 else gdn_path_commit(S0.clone(), k, v, decay, beta, *pl, p)
        sl = (slice(None), slice(i, i + 1))
        alone = gdn_path_tree(S, *(t[sl].contiguous() for t in (q, k, v, decay, beta)), *one_node)
        assert torch.equal(o[:, i], alone[:, 0]), i


def test_hybrid_target_through_the_path_kernel_equals_ar():
    """The interpreter checks' tiny hybrid target on the GPU: the path kernel's logits and state equal
    the walk's, and greedy tree decoding through it gives ar's tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gdn_path_checks

    gdn_path_checks.check_model("cuda")
