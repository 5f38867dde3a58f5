"""A per-request draft length from recent acceptance and the draft's confidence (SpecPilot s4.4).

A drafted node carries the draft's path probability exp(logp): its own belief that the target
accepts the node. Drafts are not calibrated, and how wrong they are differs per request (a
request in boilerplate code accepts far more than one in prose). Each request therefore keeps
a calibration ratio

    rho = EMA(accepted draft tokens per verify) / EMA(sum of exp(logp) over its verified nodes)

(the tokens it accepted over the tokens its draft predicted it would), clamped to
[RHO_MIN, RHO_MAX]. Its nodes' calibrated acceptance is min(1, rho exp(logp)). Without row
selection a request verifies the nodes whose calibrated acceptance is at least `min_prob`
(prefix-closed: a child's probability never exceeds its parent's), so a request that keeps
rejecting drafts drafts short and one that keeps accepting drafts long; with row selection the
calibrated probabilities are what its shared budget ranks. Outputs never change: only which
drafted nodes are verified does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tandem.tree.draft_tree import DraftTree

RHO_MIN, RHO_MAX = 0.05, 4.0


@dataclass
class Calibration:
    alpha: float = 0.3  # weight of the newest verify in each moving average
    accepted: float | None = None  # EMA of accepted draft tokens per verify
    predicted: float | None = None  # EMA of the verified nodes' summed path probabilities

    @property
    def rho(self) -> float:
        if not self.predicted:  # nothing predicted yet: trust the draft
            return 1.0
        return min(RHO_MAX, max(RHO_MIN, self.accepted / self.predicted))

    def observe(self, tree: DraftTree, accepted: int) -> None:
        """One verify of `tree` (root included) accepted `accepted` draft tokens."""
        if len(tree.tokens) <= 1:  # no draft nodes: nothing learned
            return
        predicted = sum(math.exp(lp) for lp in tree.logp[1:])
        a = self.alpha
        self.accepted = accepted if self.accepted is None else (1 - a) * self.accepted + a * accepted
        self.predicted = predicted if self.predicted is None else (1 - a) * self.predicted + a * predicted


def calibrated(tree: DraftTree, rho: float) -> DraftTree:
    """The tree with each node's logp moved to log min(1, rho exp(logp)) (the root keeps 0)."""
    shift = math.log(rho)
    return replace(tree, logp=[tree.logp[0]] + [min(0.0, lp + shift) for lp in tree.logp[1:]])


def confident(tree: DraftTree, rho: float, min_prob: float) -> DraftTree:
    """The root and the nodes whose calibrated acceptance is at least `min_prob` (prefix-closed,
    since a node's path probability never exceeds its parent's)."""
    cut = math.log(min_prob) - math.log(rho)
    keep = [0] + [i for i in range(1, len(tree.tokens)) if tree.logp[i] >= cut]
    return tree if len(keep) == len(tree.tokens) else tree.subset(keep)
