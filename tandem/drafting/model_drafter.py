"""Small-model drafter: grows a best-first tree (or a chain) from the root under a node budget.

Best-first (SpecExec / SpecPilot): every node carries the cumulative draft log-prob of its
path (parent-conditioned). Each round expands the w most probable unexpanded nodes: they are
fed to the draft model together (one step, tree mask) and each gets its top-w children. After
d rounds the N most probable nodes are kept; sorting by log-prob keeps the set prefix-closed
because a child can never be more probable than its parent.

Chain drafting is the w = 1 case; with sampling its tokens are drawn from the draft's
processed distribution q and q is kept for lossless rejection sampling.

The draft's KV cache holds [verified prefix | rows of expanded nodes, in expansion order].
Tokens the draft has not fed yet (the last accepted token if it was never expanded, and the
bonus) wait in `pending` and are fed at the start of the next proposal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.config import SamplingConfig
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree
from tandem.verify.sampling import probs_from_logits
from tandem.verify.verifier import VerifyResult


@dataclass
class _Node:
    token: int
    parent: int
    logp: float
    depth: int
    row: int = -1  # draft tree-region row once expanded, else -1


class ModelDrafter:
    def __init__(self, runner: ModelRunner, sampling: SamplingConfig, generator: torch.Generator | None = None):
        self.runner = runner
        self.sampling = sampling
        self.generator = generator
        self.pending: list[int] = []
        self._kept_rows: list[int] = []  # draft row of each node of the last proposed tree (-1: not fed)
        self.steps = 0  # draft forward passes

    def start(self, prompt: list[int]) -> None:
        self.pending = list(prompt)

    # ------------------------------------------------------------------------------------
    def propose(self, nodes: int, width: int, depth: int, sampled_chain: bool = False) -> DraftTree:
        """A tree of at most `nodes` draft tokens under the root (pending[-1]).

        The root is expanded first, then `depth` rounds expand `width` leaves each, so the
        deepest node is at depth + 1. A chain of k tokens is width 1, depth k - 1.
        """
        cache = self.runner.cache
        prefix = cache.prefix_len
        # Feed the pending tokens as a causal chain; all but the last join the prefix.
        T = len(self.pending)
        logits = self._feed(self.pending, list(range(prefix, prefix + T)),
                            torch.ones(T, T, dtype=torch.bool).tril())
        cache.commit(list(range(T - 1)), keep=[T - 1])  # the root stays as tree row 0
        prefix = cache.prefix_len
        tree: list[_Node] = [_Node(self.pending[-1], -1, 0.0, 0, row=0)]
        q_rows: list[torch.Tensor | None] = [None]
        anc_rows: dict[int, list[int]] = {0: [0]}  # node -> tree rows of its ancestors and itself
        frontier = self._add_children(tree, q_rows, [0], logits[-1:], width, sampled_chain)
        for _ in range(depth):
            if not frontier:
                break
            if sampled_chain:
                leaves = frontier[-1:]
            else:
                leaves = sorted(frontier, key=lambda i: (-tree[i].logp, i))[:width]
            frontier = [i for i in frontier if i not in leaves]
            base = cache.tree_len
            for j, i in enumerate(leaves):
                tree[i].row = base + j
                anc_rows[i] = anc_rows[tree[i].parent] + [base + j]
            mask = torch.zeros(len(leaves), base + len(leaves), dtype=torch.bool)
            for j, i in enumerate(leaves):
                mask[j, anc_rows[i]] = True
            logits = self._feed([tree[i].token for i in leaves], [prefix + tree[i].depth for i in leaves], mask)
            frontier += self._add_children(tree, q_rows, leaves, logits, width, sampled_chain)
        # Keep the N most probable nodes (prefix-closed), in index (= topological) order.
        ranked = sorted(range(1, len(tree)), key=lambda i: (-tree[i].logp, i))[:nodes]
        keep = [0] + sorted(ranked)
        self._kept_rows = [tree[i].row for i in keep]
        full = DraftTree(
            tokens=[n.token for n in tree], parents=[n.parent for n in tree], logp=[n.logp for n in tree],
            q=torch.stack([q if q is not None else torch.zeros_like(_first(q_rows)) for q in q_rows])
            if sampled_chain else None,
        )
        return full.subset(keep)

    def observe(self, result: VerifyResult, tree: DraftTree) -> None:
        """Move the accepted path's draft K/V into the prefix; queue what the draft never fed."""
        rows = [self._kept_rows[i] for i in result.path]
        fed = [r for r in rows if r >= 0]
        # Every accepted node but the last has a child in the tree, so it was expanded (fed).
        self.runner.cache.commit(fed)
        unfed = [tree.tokens[i] for i, r in zip(result.path, rows) if r < 0]
        self.pending = unfed + [result.bonus]

    # ------------------------------------------------------------------------------------
    def _feed(self, tokens: list[int], positions: list[int], tree_mask: torch.Tensor) -> torch.Tensor:
        # tree_mask: [T, tree_len + T] over the draft's tree region, new rows last
        self.steps += 1
        return self.runner.step(tokens, positions, tree_mask)  # [T, vocab]

    def _add_children(self, tree, q_rows, parents: list[int], logits: torch.Tensor, width: int,
                      sampled: bool) -> list[int]:
        # logits: [len(parents), vocab]
        new: list[int] = []
        if sampled:
            probs = probs_from_logits(logits, self.sampling)  # [P, vocab]
            toks = torch.multinomial(probs.cpu(), 1, generator=self.generator)[:, 0].tolist()
            for j, p in enumerate(parents):
                tree.append(_Node(toks[j], p, tree[p].logp + float(torch.log(probs[j, toks[j]])), tree[p].depth + 1))
                q_rows.append(probs[j])
                new.append(len(tree) - 1)
            return new
        logp = torch.log_softmax(logits.float(), dim=-1)  # [P, vocab]
        top_lp, top_tok = logp.topk(width, dim=-1)
        top_lp, top_tok = top_lp.tolist(), top_tok.tolist()  # one device sync per round
        for j, p in enumerate(parents):
            for lp, tok in zip(top_lp[j], top_tok[j]):
                tree.append(_Node(tok, p, tree[p].logp + lp, tree[p].depth + 1))
                q_rows.append(None)
                new.append(len(tree) - 1)
        return new


def _first(rows):
    return next(r for r in rows if r is not None)
