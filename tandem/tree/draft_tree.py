"""DraftTree: a speculation tree as flat arrays, and the attention masks it implies.

Node 0 is the root (the last committed token); every other node is a draft token. Nodes are
in topological order (a parent's index is smaller than its children's), which is what both
the best-first builder and the chain builder produce. A chain is a tree with one branch.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    Parents must be in topological order (parents[i] < i), parents[root] = -1.
    """
    p = parents.tolist() if isinstance(parents, torch.Tensor) else parents
    n = len(p)
    anc = np.eye(n, dtype=bool)
    # NOTE: built on the host row by row (a row is its parent's row plus itself): one small numpy
    # op per node is ~10x cheaper than device-style pointer jumping for trees of <= 256 nodes,
    # and this runs once per target pass on the critical path.
    for i in range(1, n):
        anc[i] |= anc[p[i]]
    out = torch.from_numpy(anc)
    return out if device is None else out.to(device)

