"""GPU lane: the device verification's Triton glue (tandem.kernels.tree_verify) equals its torch
reference: the target's tree rows written over a flat tree's, and every tree's accepted path,
bonus and deepest depth from the rows' argmax, over random trees (1-63 nodes, bit 63 included)
cut from a wider bucket as the drafter's captured tree hands them over."""
from __future__ import annotations

import os
import random

import pytest
import torch

from gpu_lane import NEEDS_CUDA
from tandem.engine.batched_draft import tree_depth_bits
from tandem.kernels import tree_verify

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # (the interpreter, for development)


def _trees(R: int, n: int, bucket: int, seed: int) -> torch.Tensor:
    """[6, R, n] (a slice of a [6, bucket, n] tensor): random trees of depth <= 8, distinct sibling tokens."""
    rng = random.Random(seed)
    out = torch.zeros(6, bucket, n, dtype=torch.long)
    for r in range(bucket):
        depth, children = [0], {0: set()}
        for q in range(1, n + 1):
            p = rng.choice([j for j in range(q) if depth[j] < 8])
            depth.append(depth[p] + 1)
            t = rng.choice([x for x in range(6) if x not in children[p]] or [99 + q])
            children[p].add(t)
            children[q] = set()
            out[0, r, q - 1], out[1, r, q - 1] = t, p
    d, b = tree_depth_bits(out[1], 8)
    out[4], out[5] = d[:, 1:], b[:, 1:]
    return out.to(DEVICE)[:, :R]


@NEEDS_CUDA if DEVICE == "cuda" else (lambda f: f)
@pytest.mark.cuda
@pytest.mark.parametrize("R,n,bucket", [(1, 32, 1), (3, 7, 4), (5, 63, 8), (8, 1, 8)])
@torch.no_grad()
def test_fill_and_accept_equal_the_reference(R, n, bucket):
    tree = _trees(R, n, bucket, seed=R * 100 + n)
    M, W = R * (n + 1), n + 1
    g = torch.Generator().manual_seed(n)
    rows = []
    for _ in range(2):  # the packed flat tree: the root's token and position, -7 elsewhere (what is overwritten)
        tokens = torch.full((M + 5,), -7, dtype=torch.long)
        positions = torch.full((M + 5,), -7, dtype=torch.long)
        positions[:M:W] = torch.arange(R) * 10
        bits = torch.full((M + 5, 2), -7, dtype=torch.long)
        rows.append([t.to(DEVICE) for t in (tokens, positions, bits)])
    tree_verify.fill_tree_rows_triton(tree, *rows[0])
    tree_verify.fill_tree_rows_ref(tree, *rows[1])
    for got, want in zip(*rows):
        assert torch.equal(got, want)
    for trial in range(4):  # argmax rows that accept nothing, some paths, or follow the tree's tokens
        am = torch.randint(0, 6, (M,), generator=g)
        if trial >= 2:
            am_host = am.view(R, W)
            for r in range(R):  # the argmax after each node's parent is that node's token, for some nodes
                for q in range(n):
                    if torch.rand((), generator=g) < 0.7:
                        am_host[r, int(tree[1, r, q])] = int(tree[0, r, q])
        am = am.to(DEVICE)
        assert torch.equal(tree_verify.accept_paths_triton(am, tree), tree_verify.accept_paths_ref(am, tree))
