"""DraftTree: a speculation tree as flat arrays, and the attention masks it implies.

Node 0 is the root (the last committed token); every other node is a draft token. Nodes are
in topological order (a parent's index is smaller than its children's), which is what both
the best-first builder and the chain builder produce. A chain is a tree with one branch.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: list[int]  # [n] token of each node; tokens[0] is the root
    parents: list[int]  # [n] parent index; -1 for the root
    logp: list[float]  # [n] cumulative draft log-prob of the path to the node (root 0.0)
    # [n, vocab] probabilities the draft proposed each node from (its parent's draft distribution),
    # for lossless rejection sampling of sampled drafts; None = nodes chosen deterministically
    # (best-first), which verification treats as point masses.
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> list[int]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self) -> list[list[int]]:
        return children_of(self.parents)

    def subset(self, keep: list[int]) -> "DraftTree":
        """The sub-tree on node indices `keep` (sorted, prefix-closed, containing 0), re-indexed."""
        remap = {old: new for new, old in enumerate(keep)}
        return DraftTree(
            tokens=[self.tokens[i] for i in keep],
            parents=[-1 if self.parents[i] < 0 else remap[self.parents[i]] for i in keep],
            logp=[self.logp[i] for i in keep],
            q=None if self.q is None else self.q[keep],
        )

    @staticmethod
    def root(token: int) -> "DraftTree":
        """The root alone: a plain decoding step (every request of an `ar` step)."""
        return DraftTree([token], [-1], [0.0])

    @staticmethod
    def chain(tokens: list[int], q: torch.Tensor | None = None) -> "DraftTree":
        return DraftTree(tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)), logp=[0.0] * len(tokens), q=q)


def children_of(parents: list[int]) -> list[list[int]]:
    """Each node's children, in index order (parents in topological order, the root's -1)."""
    ch: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        ch[parents[i]].append(i)
    return ch


def ancestor_mask(parents: list[int] | torch.Tensor, device=None) -> torch.Tensor:
    """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors.

    Parents must be in topological order (parents[i] < i); -1 marks a root (a forest may have
    several).
    """
    p = parents.tolist() if isinstance(parents, torch.Tensor) else parents
    n = len(p)
    anc = np.eye(n, dtype=bool)
    # NOTE: built on the host row by row (a row is its parent's row plus itself): one small numpy
    # op per node is ~10x cheaper than device-style pointer jumping for trees of <= 256 nodes,
    # and this runs once per target pass on the critical path.
    for i in range(1, n):
        if p[i] >= 0:  # a root's row is itself alone (anc[-1] would be the last row)
            anc[i] |= anc[p[i]]
    out = torch.from_numpy(anc)
    return out if device is None else out.to(device)



def deepest_depths(depth: "np.ndarray | list[int]", sizes: list[int]) -> list[int]:
    """Each tree's deepest node's depth, from tree_masks' depths of trees side by side (sizes:
    their node counts). A tree is prefix-closed, so it offers every depth 1 .. its deepest."""
    if len(depth) == len(sizes):  # every tree its root alone
        return [0] * len(sizes)
    if isinstance(depth, np.ndarray):  # (many nodes: one array op)
        return np.maximum.reduceat(depth, list(accumulate(sizes[:-1], initial=0))).tolist()
    out, at = [], 0
    for size in sizes:
        out.append(max(depth[at:at + size]))
        at += size
    return out


def node_masks(parents: list[int]) -> tuple[list[int], list[int]]:
    """One tree's nodes (parents in topological order, the root's -1) -> each node's ancestor
    mask (bit j: node j is the node itself or one of its ancestors; python ints, any width) and
    its depth."""
    bits: list[int] = []
    depth: list[int] = []
    for i, p in enumerate(parents):
        if p < 0:
            depth.append(0)
            bits.append(1 << i)
        else:
            depth.append(depth[p] + 1)
            bits.append(bits[p] | 1 << i)
    return bits, depth


def tree_masks(parents: list[int], sizes: list[int]) -> tuple["np.ndarray | list[int]", "np.ndarray | list[int]", int]:
    """Trees side by side -> each node's ancestor mask, its depth, and the 64-bit words the widest
    mask needs. parents: every tree's parent indices (tree-local, -1 for its root), the trees one
    after another; sizes: their node counts. Bit j of a node's mask: node j of its tree is the
    node itself or one of its ancestors (what its verify row sees of the tree).

    Few nodes (or a tree wider than 64): a python step per node, python ints. Many (every tree at
    most 64 nodes): uint64 words for all trees at once by pointer jumping, log2(depth) rounds of
    a few array ops (numpy's fixed cost per op makes that the slower way below ~300 nodes)."""
    n = len(parents)
    if n == len(sizes):  # every tree its root alone (an `ar` step)
        return np.ones(n, dtype=np.uint64), np.zeros(n, dtype=np.int64), 1
    if n < 300 or max(sizes) > 64:
        bits: list[int] = []
        depth: list[int] = []
        at = 0
        for size in sizes:
            b, d = node_masks(parents[at:at + size])
            bits += b
            depth += d
            at += size
        return bits, depth, -(-max(sizes) // 64)
    sz = np.asarray(sizes, dtype=np.int64)
    first = np.repeat(np.cumsum(sz) - sz, sz)  # [n] the row of each node's root
    local = np.asarray(parents, dtype=np.int64)
    up = np.where(local >= 0, local + first, first)  # [n] parent row (a root: itself)
    masks = np.left_shift(np.uint64(1), (np.arange(n) - first).astype(np.uint64))  # [n] own bit
    depths = (local >= 0).astype(np.int64)
    # invariant: masks[i] holds the nodes from i up to, not including, up[i] and depths[i] counts
    # them (a root points at itself and counts 0, so jumping past the root changes nothing)
    while True:
        nxt = up[up]
        masks |= masks[up]  # (each right-hand side reads the values before this round)
        if np.array_equal(nxt, up):  # every node points at its root, now in its mask too
            return masks, depths, 1
        depths += depths[up]
        up = nxt
