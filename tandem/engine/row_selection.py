"""Batch-aware row selection (SpecPilot s4.4): which draft nodes the step's target pass verifies.

In a batch every verification row costs time, so instead of a fixed node budget N per request,
the step has ONE node budget shared by all decoding requests: their best-first trees' nodes
compete by path score (cumulative draft log-prob, `DraftTree.logp`) and are taken best first.
A node is a candidate only once its parent is taken, so each request's share is prefix-closed
(a valid tree, the root always kept), and a request may get zero draft nodes (an `ar` step).

The budget comes from a cost model of one target pass, c(rows) (`RowCost`): by default flat up
to `tile` rows (the weights are read once whatever the row count) and linear after it. The
step's node count n is the one of highest expected goodput

    g(n) = (R + sum of the n best nodes' path probabilities) / c(base + n)

where R is the number of decoding requests (each commits at least its bonus token), base the
rows the step holds anyway (roots and prefill chunks), and a node's path probability exp(logp)
is the draft's estimate that the target accepts it. n = 0 switches speculation off for the step
(`StepSelection.off`). Selection only picks rows, so outputs are unchanged (lossless).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from tandem.tree.draft_tree import DraftTree, children_of


def polyline(points: Sequence[tuple[float, float]], x: float, rising_end: bool = False) -> float:
    """y at x on the line through `points` (sorted by x): the first point's y before it, linear
    between points, past the last one its last segment extended (never falling: `rising_end`)."""
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    rise = max(0.0, y1 - y0) if rising_end else y1 - y0
    return y1 + rise * (x - x1) / (x1 - x0)


@dataclass(frozen=True)
class RowCost:
    """c(rows): relative time of one target pass over `rows` rows.

    `points` ((rows, cost), ...) sorted by rows, e.g. measured by `tandem profile`, is
    interpolated linearly (extrapolated from its last two points). Without points: 1.0 up to
    `tile` rows, then `slope` more per further tile."""

    tile: int = 64
    slope: float = 1.0
    points: tuple[tuple[int, float], ...] = ()

    def __call__(self, rows: int) -> float:
        if self.points:
            return polyline(self.points, rows)
        return 1.0 if rows <= self.tile else 1.0 + self.slope * (rows - self.tile) / self.tile

    def flat_rows(self, tolerance: float = 0.1) -> int:
        """The flat region's end: the most rows a pass takes within `tolerance` of one row's cost
        (`tile` without points)."""
        if not self.points:
            return self.tile
        base = self(1)
        return max([r for r, c in self.points if c <= (1 + tolerance) * base], default=1)

    def validate(self) -> None:
        if self.tile < 1 or self.slope < 0:
            raise ValueError(f"row cost needs tile >= 1 and slope >= 0 (got {self.tile}, {self.slope})")
        rows = [r for r, _ in self.points]
        if rows != sorted(set(rows)) or any(c <= 0 for _, c in self.points):
            raise ValueError("row cost points must have increasing rows and positive costs")


@dataclass(frozen=True)
class StepSelection:
    keep: dict[str, list[int]]  # request id -> node indices kept (sorted, prefix-closed, 0 included)
    nodes: int  # draft nodes kept over all requests (roots excluded)
    offered: int  # draft nodes the trees offered
    expected_tokens: float  # R + sum of the kept nodes' path probabilities

    @property
    def off(self) -> bool:
        """Speculation switched off for the step: roots only."""
        return self.nodes == 0 and self.offered > 0


def ranked_nodes(trees: dict[str, DraftTree]) -> list[tuple[str, int, float]]:
    """Every draft node of every tree, best first, each after its parent: (request id, node, logp).

    A best-first merge over the frontier: the next node is the best child of a node already
    taken, by (-logp, depth, request order, index). Path log-probs never rise along a path, so
    this is the global order by score; the frontier makes prefix-closure hold even when they do.
    """
    order = {rid: k for k, rid in enumerate(trees)}
    kids = {rid: children_of(t.parents) for rid, t in trees.items()}
    depth = {rid: t.depth for rid, t in trees.items()}
    heap: list[tuple[float, int, int, int, str]] = []

    def push(rid: str, node: int) -> None:
        t = trees[rid]
        for c in kids[rid][node]:
            heapq.heappush(heap, (-t.logp[c], depth[rid][c], order[rid], c, rid))

    for rid in trees:
        push(rid, 0)
    out = []
    while heap:
        neg, _, _, c, rid = heapq.heappop(heap)
        out.append((rid, c, -neg))
        push(rid, c)
    return out


def select_rows(trees: dict[str, DraftTree], budget: int) -> dict[str, list[int]]:
    """The `budget` best draft nodes over all trees (fewer if they offer fewer), prefix-closed
    per request: request id -> sorted kept node indices, root (0) included."""
    keep = {rid: [0] for rid in trees}
    for rid, node, _ in ranked_nodes(trees)[:max(0, budget)]:
        keep[rid].append(node)
    return {rid: sorted(k) for rid, k in keep.items()}


def choose_nodes(probs: list[float], requests: int, base_rows: int, cost: RowCost, max_nodes: int) -> int:
    """The node count n <= max_nodes of highest goodput (module docstring); `probs` are the
    ranked nodes' path probabilities, best first. Ties go to the smaller n."""
    best_n, best_g, expected = 0, requests / cost(base_rows), float(requests)
    for n, p in enumerate(probs[:max(0, max_nodes)], start=1):
        expected += p
        g = expected / cost(base_rows + n)
        if g > best_g * (1 + 1e-12):
            best_n, best_g = n, g
    return best_n


def select_step(trees: dict[str, DraftTree], base_rows: int, cost: RowCost, max_nodes: int) -> StepSelection:
    """Shared-budget selection for one step: the goodput-best node count, filled best first."""
    ranked = ranked_nodes(trees)
    n = choose_nodes([math.exp(lp) for _, _, lp in ranked], len(trees), base_rows, cost, max_nodes)
    keep = {rid: [0] for rid in trees}
    expected = float(len(trees))
    for rid, node, lp in ranked[:n]:
        keep[rid].append(node)
        expected += math.exp(lp)
    return StepSelection({rid: sorted(k) for rid, k in keep.items()}, n, len(ranked), expected)
