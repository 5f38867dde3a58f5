"""Whether a step drafts at all: the draft-cost term of row selection's goodput.

Row selection (tandem.engine.row_selection) picks which drafted nodes a step verifies, but by
then the drafting is paid. In a batch that cost grows with the requests (each drafts its own
tree) while the target pass barely does, so past some concurrency speculation loses to plain
decoding however the rows are chosen. The gate decides *before* drafting, from running
figures of this engine:

    with drafting:     R (1 + a) / (u c(rows_spec) + R d)      tokens per second
    without drafting:  R         / (u c(rows_ar))

R decoding requests, a the accepted draft tokens per drafted request-step, d the drafting
seconds per request, u the seconds per unit of the row-cost model c (RowCost), rows_ar the
step's rows without drafts and rows_spec those plus the nodes verified per request recently.
Each figure is an exponential moving average. Until `min_samples` drafting steps have been
seen the engine drafts. While the gate keeps drafting off it still drafts a probe step now and then, so the
figures follow the workload; a probe costs what drafting loses in one step, so probes are spaced
to keep that loss under `probe_budget` of the time (at least `probe_every` steps apart, at most
`probe_max`): where a drafting step costs 12 plain steps (the engine's `tree` on the H200, 2026-12-01),
one probe in ~370 steps, not one in 16 (which would lose an estimated 11/16 of the time).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.engine.row_selection import RowCost


@dataclass
class DraftGate:
    alpha: float = 0.25  # weight of the newest observation in each moving average
    probe_every: int = 16  # fewest steps without drafting before a drafting step refreshes the figures
    probe_max: int = 1024  # most steps between probes
    probe_budget: float = 0.03  # the share of the time probes may lose
    min_samples: int = 4  # drafting steps observed before the gate may turn drafting off
    accepted: float | None = None  # a: accepted draft tokens per drafted request-step
    nodes: float | None = None  # draft nodes verified per drafted request-step
    draft_s: float | None = None  # d: drafting seconds per drafted request
    unit_s: float | None = None  # u: seconds per unit of c(rows)
    samples: int = 0  # drafting steps observed
    off_streak: int = 0
    decisions_off: int = 0  # steps it kept drafting off

    def drafts(self, requests: int, base_rows: int, cost: RowCost) -> bool:
        """Whether the next step (R = requests decoding, base_rows without drafts) drafts."""
        if requests == 0:
            return True
        if None in (self.accepted, self.nodes, self.draft_s, self.unit_s) or self.samples < self.min_samples:
            return True  # still learning (one step, e.g. a lone request early on, is a poor sample)
        spec_rows = base_rows + round(requests * self.nodes)
        t_spec = self.unit_s * cost(spec_rows) + requests * self.draft_s  # seconds of a drafting step
        t_ar = self.unit_s * cost(base_rows)  # seconds of a plain step
        with_draft = requests * (1 + self.accepted) / t_spec
        without = requests / t_ar
        if with_draft >= without:
            self.off_streak = 0
            return True
        if self.off_streak >= self.probe_interval(t_spec, t_ar, with_draft / without):
            self.off_streak = 0
            return True  # a probe
        self.off_streak += 1
        self.decisions_off += 1
        return False

    def probe_interval(self, t_spec: float, t_ar: float, ratio: float) -> int:
        """Plain steps between probes: a probe step takes t_spec and yields `ratio` of a plain
        step's throughput, so it loses t_spec (1 - ratio) seconds of plain decoding; spaced by n
        plain steps of t_ar each, the loss is at most `probe_budget` of the time."""
        loss = t_spec * (1.0 - ratio)
        n = math.ceil(loss / (self.probe_budget * t_ar)) if t_ar > 0 else self.probe_max
        return max(self.probe_every, min(self.probe_max, n))

    def observe_pass(self, seconds: float, rows: int, cost: RowCost) -> None:
        """A target pass over `rows` rows took `seconds`."""
        self.unit_s = self._ema(self.unit_s, seconds / cost(rows))

    def observe_drafting(self, seconds: float, requests: int, nodes: int, accepted: int) -> None:
        """`requests` requests drafted in `seconds`; their trees had `nodes` verified draft nodes
        and `accepted` of them were accepted."""
        if requests == 0:
            return
        self.samples += 1
        self.draft_s = self._ema(self.draft_s, seconds / requests)
        self.nodes = self._ema(self.nodes, nodes / requests)
        self.accepted = self._ema(self.accepted, accepted / requests)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
