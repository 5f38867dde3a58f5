"""Triton kernels of the batched engine's verification on the device (Engine._verify_on_device),
beside their references.

A greedy `tree` step keeps the drafted trees on the device: `tree` [6, R, n] int64 from the
drafter's captured tree (token, parent's tree position, rank, log-prob bits, depth, ancestor
mask; tandem.engine.batched_draft). Around the target pass two pieces of glue remain, ~25 small
torch kernels in all (each 5-10 us of host launch on the H200's host, whatever its size); here
they are one program per request each:

- `fill_tree_rows`: the target's pass was packed with every request's n + 1 rows as a flat
  tree (each node a child of the root: the same rows, slots and mask word as any tree of n
  nodes); write each node's token, position (the root's plus its depth) and ancestor mask;
- `accept_paths`: from every row's argmax, each tree's accepted path: a node is accepted when
  its token is the argmax after its parent, a path when all its nodes are; the deepest such
  node (siblings differ, so at most one a depth) gives the path as its ancestor mask, and the
  argmax after it is the bonus. Out [R, 3 + n]: path mask, bonus, the tree's deepest depth, the
  tree's tokens (what the host reads back, in one copy).

The references are the semantics and the CPU path; the GPU lane checks the kernels against them
(`tests/gpu/test_gpu_tree_verify.py`, and the engine's GPU tests with them: passed on the H200,
2026-12-02). The kernels are the GPU's default: the references' ~25 launches cost the host
0.4-0.6 ms a step (bench/gpu_step_timeline.py --host-only). TANDEM_TRITON_VERIFY=0 takes the
references on the GPU too.
"""
from __future__ import annotations

import os

import torch

from tandem.kernels.fused import pdl, pow2, triton_enabled

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None


# ---- references ------------------------------------------------------------------------------
def fill_tree_rows_ref(tree: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, row_bits: torch.Tensor
                       ) -> None:
    """tree [6, R, n]; tokens, positions [>= R (n + 1)], row_bits [>= R (n + 1), words]: request r's
    rows are r (n + 1) .. (r + 1)(n + 1) - 1, its root first (packed already)."""
    _, R, n = tree.shape
    M, W = R * (n + 1), n + 1
    tokens[:M].view(R, W)[:, 1:] = tree[0]
    pos = positions[:M].view(R, W)
    pos[:, 1:] = pos[:, :1] + tree[4]  # (the root's row holds its prefix: a node sits at prefix + depth)
    row_bits[:M].view(R, W, -1)[:, 1:, 0] = tree[5]


def accept_paths_ref(am: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
    """am [R (n + 1)]: the target's argmax after each row; tree [6, R, n] -> [R, 3 + n] int64."""
    _, R, n = tree.shape
    W = n + 1
    tok, par, depth, bits = tree[0], tree[1], tree[4], tree[5]
    am = am[:R * W].view(R, W)
    ok = (tok == am.gather(1, par)).long()  # [R, n] node q's token is the argmax after its parent
    one = torch.ones(R, 1, dtype=torch.long, device=tok.device)
    ok_bits = (ok << torch.arange(1, W, device=tok.device)).sum(1, keepdim=True) | 1  # [R, 1] (distinct bits)
    all_bits = torch.cat([one, bits], 1)  # [R, n + 1] each node's ancestors, itself included
    accepted = (all_bits & ~ok_bits) == 0  # every node of its path accepted
    best = (torch.cat([one - 1, depth], 1) * accepted).argmax(1, keepdim=True)  # [R, 1] (the first maximum)
    return torch.cat([all_bits.gather(1, best), am.gather(1, best), depth.max(1, keepdim=True).values, tok], 1)


def accepted_rows(acc: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepts, still on the device, as what a feature drafter runs next: request r's rows
    k = 0 .. count[r] - 1 hold the accepted nodes' tokens and then the bonus, each reading the
    target's features of the tree position before it (the root's for k = 0). acc [R, 3 + n]
    (accept_paths); K >= the longest path (the tree's depth + 1) -> tokens [R, K], the tree positions
    whose features each row reads [R, K] (rows past count: the root's, their tokens 0), count [R]."""
    R, n = acc.shape[0], acc.shape[1] - 3
    dev = acc.device
    on = ((acc[:, :1] >> torch.arange(n + 1, device=dev)) & 1).bool()  # [R, n + 1] the path's tree positions
    count = on.sum(1)  # [R] path length = accepted + 1
    # the path's k-th position at column k (columns past count: position 0, the root)
    at = torch.where(on, on.cumsum(1) - 1, K)  # [R, n + 1] column of each path position (K: none)
    pos = torch.zeros(R, K + 1, dtype=torch.long, device=dev)
    pos.scatter_(1, at, torch.arange(n + 1, device=dev).expand(R, n + 1))
    pos = pos[:, :K]  # [R, K]
    # row k's token: the path's node k + 1, or the bonus at k = count - 1
    nxt = torch.cat([pos[:, 1:], pos.new_zeros(R, 1)], 1)  # [R, K]
    toks = acc[:, 3:].gather(1, (nxt - 1).clamp_min(0))  # [R, K]
    k = torch.arange(K, device=dev)
    toks = torch.where(k == (count - 1)[:, None], acc[:, 1:2], torch.where(k < (count - 1)[:, None], toks, 0))
    return toks, pos, count


# ---- dispatch --------------------------------------------------------------------------------
def _kernels(t: torch.Tensor) -> bool:
    return triton_enabled(t) and os.environ.get("TANDEM_TRITON_VERIFY", "1") != "0"


def fill_tree_rows(tree, tokens, positions, row_bits) -> None:
    (fill_tree_rows_triton if _kernels(tree) else fill_tree_rows_ref)(tree, tokens, positions, row_bits)


def accept_paths(am: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
    return (accept_paths_triton if _kernels(tree) else accept_paths_ref)(am, tree)


def fill_tree_rows_triton(tree, tokens, positions, row_bits) -> None:
    _, R, n = tree.shape
    assert tree.stride()[1:] == (n, 1) and tokens.stride(0) == positions.stride(0) == 1  # (a bucket's [6, R', n] cut to R)
    _fill_kernel[(R,)](tree, tokens, positions, row_bits, row_bits.stride(0), tree.stride(0), n, NP=pow2(n),
                       num_warps=1, **pdl(tree))


def accept_paths_triton(am: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
    _, R, n = tree.shape
    assert tree.stride()[1:] == (n, 1) and am.is_contiguous()
    out = torch.empty(R, 3 + n, dtype=torch.long, device=tree.device)
    _accept_kernel[(R,)](am, tree, out, tree.stride(0), n, NP=pow2(n), num_warps=1, **pdl(am))
    return out


if triton is not None:
    from tandem.kernels.fused import _pdl_enter

    @triton.jit
    def _fill_kernel(tree_ptr, tok_ptr, pos_ptr, bits_ptr, bits_stride, plane, n, NP: tl.constexpr,
                     PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        r = tl.program_id(0)
        q = tl.arange(0, NP)
        ok = q < n
        at = r * n + q  # node q + 1 of request r in each [R, n] plane of the tree
        row = r * (n + 1) + 1 + q
        tl.store(tok_ptr + row, tl.load(tree_ptr + at, mask=ok, other=0), mask=ok)
        root_pos = tl.load(pos_ptr + r * (n + 1))
        tl.store(pos_ptr + row, root_pos + tl.load(tree_ptr + 4 * plane + at, mask=ok, other=0), mask=ok)
        tl.store(bits_ptr + row * bits_stride, tl.load(tree_ptr + 5 * plane + at, mask=ok, other=0), mask=ok)

    @triton.jit
    def _accept_kernel(am_ptr, tree_ptr, out_ptr, plane, n, NP: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        r = tl.program_id(0)
        q = tl.arange(0, NP)
        ok = q < n
        at = r * n + q
        tok = tl.load(tree_ptr + at, mask=ok, other=-1)
        par = tl.load(tree_ptr + plane + at, mask=ok, other=0)
        depth = tl.load(tree_ptr + 4 * plane + at, mask=ok, other=0)
        bits = tl.load(tree_ptr + 5 * plane + at, mask=ok, other=0)
        after_parent = tl.load(am_ptr + r * (n + 1) + par, mask=ok, other=-2)
        one = tl.full([NP], 1, tl.int64)
        own = tl.where(ok & (tok == after_parent), one << (q + 1).to(tl.int64), 0)
        ok_bits = tl.sum(own, axis=0) | 1  # (distinct bits: the sum is the or)
        accepted = ok & ((bits & ~ok_bits) == 0)
        score = tl.where(accepted, depth, 0)
        top = tl.max(score, axis=0)
        first = tl.min(tl.where(accepted & (score == top), q, NP), axis=0)  # the first maximum
        has = top > 0
        path = tl.where(has, tl.sum(tl.where(q == first, bits, 0), axis=0), 1)
        best_row = tl.where(has, first + 1, 0)
        o = out_ptr + r * (3 + n)
        tl.store(o, path)
        tl.store(o + 1, tl.load(am_ptr + r * (n + 1) + best_row))
        tl.store(o + 2, tl.max(tl.where(ok, depth, 0), axis=0))
        tl.store(o + 3 + q, tok, mask=ok)
