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
Each figure is an exponential moving average. Until every figure has been seen the engine
drafts; while the gate keeps drafting off it still drafts one step in `probe_every`, so the
figures follow the workload.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.row_selection import RowCost


@dataclass
class DraftGate:
    alpha: float = 0.25  # weight of the newest observation in each moving average
    probe_every: int = 16  # steps without drafting before one drafting step refreshes the figures
    accepted: float | None = None  # a: accepted draft tokens per drafted request-step
    nodes: float | None = None  # draft nodes verified per drafted request-step
    draft_s: float | None = None  # d: drafting seconds per drafted request
    unit_s: float | None = None  # u: seconds per unit of c(rows)
    off_streak: int = 0
    decisions_off: int = 0  # steps it kept drafting off

    def drafts(self, requests: int, base_rows: int, cost: RowCost) -> bool:
        """Whether the next step (R = requests decoding, base_rows without drafts) drafts."""
        if requests == 0:
            return True
        if None in (self.accepted, self.nodes, self.draft_s, self.unit_s):
            return True  # still learning
        if self.off_streak >= self.probe_every:
            self.off_streak = 0
            return True  # a probe
        spec_rows = base_rows + round(requests * self.nodes)
        with_draft = requests * (1 + self.accepted) / (self.unit_s * cost(spec_rows) + requests * self.draft_s)
        without = requests / (self.unit_s * cost(base_rows))
        if with_draft >= without:
            self.off_streak = 0
            return True
        self.off_streak += 1
        self.decisions_off += 1
        return False

    def observe_pass(self, seconds: float, rows: int, cost: RowCost) -> None:
        """A target pass over `rows` rows took `seconds`."""
        self.unit_s = self._ema(self.unit_s, seconds / cost(rows))

    def observe_drafting(self, seconds: float, requests: int, nodes: int, accepted: int) -> None:
        """`requests` requests drafted in `seconds`; their trees had `nodes` verified draft nodes
        and `accepted` of them were accepted."""
        if requests == 0:
            return
        self.draft_s = self._ema(self.draft_s, seconds / requests)
        self.nodes = self._ema(self.nodes, nodes / requests)
        self.accepted = self._ema(self.accepted, accepted / requests)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
