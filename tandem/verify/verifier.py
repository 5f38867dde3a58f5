"""Deciding which draft tokens the target accepts.

Greedy: walk from the root, descending into the child whose token equals the target's
argmax at the current node; the argmax where no child matches is the bonus token.

Sampling: recursive rejection sampling over siblings (SpecInfer / SpecTr). At node u with
target distribution p, try u's children in order; child i (token x, proposed from draft
distribution q_i) is accepted with probability min(1, p(x) / q_i(x)); on rejection
p <- normalize(max(p - q_i, 0)). If every child is rejected the bonus is drawn from the
final residual p. The committed tokens are then distributed exactly as sampling from the
target. Best-first trees choose children deterministically; their q_i is a point mass on x,
for which the rule reduces to "accept x with probability p(x), then remove x from p".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.tree.draft_tree import DraftTree
from tandem.verify.sampling import sample


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one target pass over a tree.

    path: node indices of the root and the accepted nodes, root first (all get committed to
    the target's KV). tokens: the committed new tokens (accepted draft tokens then the bonus).
    """

    path: list[int]
    tokens: list[int]
    num_draft: int  # draft tokens offered in this pass (tree size minus the root)

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


def greedy_accept(tree: DraftTree, target_argmax: list[int]) -> VerifyResult:
    """target_argmax[i]: the target's argmax next token after node i."""
    n = len(tree.tokens)
    if n == 1:  # a plain decoding step (the batched engine's ar: every request, every step)
        return VerifyResult(path=[0], tokens=[target_argmax[0]], num_draft=0)
    # one scan in index order: a node's children come after it, in index order, so the first
    # later node whose parent is the current node and whose token is the target's argmax there is
    # the child the walk descends into (no per-node child lists: this runs for every request, every step)
    tokens, parents = tree.tokens, tree.parents
    path, node, want, out = [0], 0, target_argmax[0], []
    for c in range(1, n):
        if parents[c] == node and tokens[c] == want:
            path.append(c)
            out.append(want)
            node, want = c, target_argmax[c]
    out.append(want)  # the bonus: the target's argmax after the last accepted node
    return VerifyResult(path=path, tokens=out, num_draft=n - 1)


def rejection_accept(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> VerifyResult:
    """target_probs: [n, vocab] processed target distribution after each node (any device).

    Rows are moved to the CPU only along the walked path, so the transfer stays small.
    """
    children = tree.children()
    path, node = [0], 0
    while True:
        p = target_probs[node].detach().float().cpu().clone()  # [vocab]
        nxt = None
        for c in children[node]:
            x = tree.tokens[c]
            if tree.q is None:
                q = None
                ratio = float(p[x])  # point-mass proposal: accept with prob p(x)
            else:
                q = tree.q[c].detach().float().cpu()  # [vocab], q[x] > 0 since x was drawn from it
                qx = float(q[x])
                ratio = 1.0 if qx <= 0 else min(1.0, float(p[x]) / qx)
            u = float(torch.rand((), generator=generator))
            if u < ratio:
                nxt = c
                break
            residual = p.clone() if q is None else torch.clamp(p - q, min=0.0)
            if q is None:
                residual[x] = 0.0
            total = float(residual.sum())
            if total <= 0.0:  # only through rounding (p == q, so u < ratio = 1); keep p
                break
            p = residual / total
        if nxt is None:
            bonus = sample(p, generator)
            tokens = [tree.tokens[i] for i in path[1:]] + [bonus]
            return VerifyResult(path=path, tokens=tokens, num_draft=len(tree) - 1)
        path.append(nxt)
        node = nxt


def replay_accept(tree: DraftTree, target_argmax: list[int], accept: int) -> VerifyResult:
    """Acceptance replay (simulated acceptance, for timing realistic shapes with random weights).

    The decision comes from a recorded trace instead of the target: `accept` draft tokens are
    taken along the draft's most probable path (as deep as the tree allows), then the bonus is
    the target's argmax after the last of them. The target pass itself really runs, so costs are
    real; the tokens are not a decoding of anything and are never checked against `ar`.
    """
    children = tree.children()
    path, node = [0], 0
    while len(path) - 1 < accept and children[node]:
        node = max(children[node], key=lambda c: (tree.logp[c], -c))
        path.append(node)
    tokens = [tree.tokens[i] for i in path[1:]] + [target_argmax[node]]
    return VerifyResult(path=path, tokens=tokens, num_draft=len(tree) - 1)
