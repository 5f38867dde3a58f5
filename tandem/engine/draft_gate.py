"""Whether a step drafts at all, and for how many requests: drafting's cost against its tokens.

Row selection (tandem.engine.row_selection) picks which drafted nodes a step verifies, but by
then the drafting is paid. In a batch that cost grows with the requests while a plain step
barely does, so past some concurrency speculation loses to plain decoding however the rows are
chosen (on the H200, 2026-12-02: the engine's EAGLE-3 `tree` at 1.35x `ar` with one request,
0.50x with 64). The gate decides *before* drafting, for R decoding requests:

    draft every request  when  (1 + a) t_plain(R) >= t_draft(R)      (more tokens per second)

a the accepted draft tokens per drafted request-step (this engine's recent steps, each weighing
by its drafted requests),
t_plain(R) and t_draft(R) the wall seconds of a step of R decoding requests without and with
drafting. Those two are *measured* (`StepCosts`, Engine.measure_step_costs: real steps of
throwaway requests when the engine starts, every cost of a step included: packing, the pass,
the drafter, accepting, committing), then kept true by the ratio of each observed step to its
prediction. An estimate of the row cost alone (RowCost) missed the H200's host overheads by
several times.

Learning a costs steps that draft, and a full drafting step at 64 requests cost eight plain ones
(H200, EAGLE-3); acceptance does not depend on the batch, so learning and the probes that keep a
current draft only a *sample* of the requests (`sample`; the others decode plain in the same
step). A sample step still cost 5-11 ms against 1.4-2.5 ms for a plain one there: most of
drafting's cost does not grow with the requests. Probes are spaced to keep what they lose under
`probe_budget` of the time.

Both step kinds are kept current whichever one runs (H200, 2026-12-03: with one kind's figure
frozen while the other ran, a noisy start-up measurement decided a whole run: drafting kept off
at 8 requests where it paid 1.3x, kept on at 64 where it lost 0.73x):
- a drafting step is modelled as a plain step plus drafting's extra,
  t_draft(R) = t_plain(R) + extra_scale (D(R) - P(R)) with D, P the start-up curves, so every
  step that drafts corrects `extra_scale`: a step where all draft by D(R) - P(R), a probe's
  second step (its sample drafted the step before too: steady) by D(k) - P(k);
- probes come in pairs (the first catches up: `probe_extra`; the second is steady);
- plain steps teach t_plain only in the off regime, the drafters outside the sample dormant, as
  P(R) is measured at start-up: a plain step that feeds every drafter (one between drafting
  steps) cost 1.5-1.7x an off-regime one and taught drafting to look cheaper by a x that
  (H200, 2026-12-03: on at 32 requests where `tree` ran 0.64x `ar`).

That model decides until it is measured. With `arms` (tandem.engine.gate_arms; the engine's gate
has them with TANDEM_GATE_ARMS=1), once drafting has run in a concurrency bucket, what decides
there is the measured throughput of both regimes.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from tandem.engine.gate_arms import GateArms
from tandem.engine.row_selection import polyline


# the most a single drafting step's observed extra may be, in multiples of the scale it corrects
OUTLIER = 4.0

# a plain step teaches the plain fit with at most this many prompt rows (plus 4 a decoding
# request): a steady state's one or two prompts a step, not a wave's chunked prefill
PREFILL_ROWS_MAX = 512


@dataclass(frozen=True)
class StepCosts:
    """Measured wall seconds of one decode step by the number of decoding requests R: `plain`
    (roots only) and `drafting` (every request drafts its full tree), at `requests` (increasing).
    Between the points linear; past the last one, the last slope (at least flat)."""

    requests: tuple[int, ...]
    plain: tuple[float, ...]
    drafting: tuple[float, ...]
    # a step where min(R, sample) of the R requests draft (a probe's second step), when measured
    probe: tuple[float, ...] | None = None
    sample: int = 4

    def plain_s(self, r: int) -> float:
        return _at(self.requests, self.plain, r)

    def drafting_s(self, r: int) -> float:
        return _at(self.requests, self.drafting, r)

    def probe_extra_s(self, r: int, k: int) -> float:
        """A step of R requests, k drafting, over a plain one: measured (the probe curve, for
        its own sample size), else drafting's extra for k requests, D(k) - P(k)."""
        if self.probe is not None and k == min(r, self.sample):
            return max(0.0, _at(self.requests, self.probe, r) - self.plain_s(r))
        return max(0.0, self.drafting_s(k) - self.plain_s(k))


@functools.lru_cache(maxsize=4096)
def _at(xs: tuple[int, ...], ys: tuple[float, ...], r: int) -> float:
    """The curve (xs, ys) at r (a step asks the gate for the same few R every time: cached)."""
    return polyline(list(zip(xs, ys)), r, rising_end=True)


@dataclass
class PlainFit:
    """A plain step's seconds as scale x P(R) + c x prefill rows, both fitted at once to the
    observed steps by least squares, weighted (1 - alpha)^age and held toward the prior (scale 1,
    c 0) by `prior` steps' worth of weight: steps that all carry the same rows cannot tell the two
    apart, and then the prior settles it. `unit`: the seconds a prefill row is expected to cost,
    in which c is fitted (both columns near one scale, for the solve's sake)."""

    unit: float
    alpha: float = 0.25
    prior: float = 0.01
    scale: float = 1.0
    per_row: float = 0.0  # c: seconds a prefill row adds to a plain step
    _sums: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # weighted x1x1, x1x2, x2x2, x1y, x2y, and the weight

    def observe(self, p: float, rows: int, seconds: float) -> None:
        """A plain step: P(R) measured at start-up `p`, `rows` prefill rows, `seconds` observed."""
        k = 1 - self.alpha
        x2 = rows * self.unit
        s11, s12, s22, b1, b2, w = self._sums
        s11, s12, s22 = k * s11 + p * p, k * s12 + p * x2, k * s22 + x2 * x2
        b1, b2, w = k * b1 + p * seconds, k * b2 + x2 * seconds, k * w + 1
        self._sums = (s11, s12, s22, b1, b2, w)
        lam1, lam2 = self.prior * s11 / w, self.prior * s22 / w  # (`prior` steps' worth, each column's own scale)
        a, d = s11 + lam1, s22 + lam2
        y1 = b1 + lam1 * 1.0
        det = a * d - s12 * s12
        if det <= 1e-9 * a * a:  # (no prefill rows seen, and no prior: the scale alone)
            self.scale = max(1e-3, (y1 - s12 * self.per_row / self.unit) / a)
            return
        c = (a * b2 - s12 * y1) / det
        if c < 0:  # (rows that seem to make a step cheaper: noise; the scale alone, c 0)
            self.scale, self.per_row = max(1e-3, y1 / a), 0.0
            return
        self.scale = max(1e-3, (d * y1 - s12 * b2) / det)
        self.per_row = c * self.unit

    def seconds(self, p: float, rows: int = 0) -> float:
        return self.scale * p + self.per_row * rows


@dataclass
class DraftGate:
    costs: StepCosts
    sample: int = 4  # requests a learning or probe step drafts (the others decode plain)
    alpha: float = 0.25  # weight of the newest observation in each moving average
    min_samples: int = 3  # drafting steps observed before the gate trusts a
    # off-regime plain steps observed before drafting may first turn on for every request: the
    # start-up curve's plain step (a forced, synchronous pair) ran 1.4x the steady async one at 32
    # requests, which made drafting look 1.4x cheaper in plain steps and turned it on for 22 steps
    # at 0.72x `ar` (H100, 2026-12-07). Plain steps cost what `ar` costs, so measuring them first
    # loses little: ~24 steps (16 before the drafters go dormant) once an engine
    min_plain: int = 8
    plain_seen: int = 0  # off-regime plain steps the plain fit has observed
    probe_every: int = 16  # fewest steps between two probes
    probe_max: int = 1024  # most steps between two probes
    probe_budget: float = 0.03  # the share of the time probes may lose
    a_alpha: float = 1 / 16  # weight of the newest drafting step in a (its requests weigh in it)
    # plain steps in a row after which the engine lets the drafters outside the sample go dormant
    # (not fed; restarted from their whole context when drafting resumes). Near break-even the
    # gate turns drafting on and off often, and restarting 60 drafters cost a step 130 ms at 64
    # requests (H200, 2026-12-02); deep in the off regime feeding them all cost every plain step
    # 0.6 ms over `ar`'s 1 ms
    dormant_after: int = 16
    # the most draft tokens one drafted request can have accepted in a step (a chain's k, a level
    # tree's depth): where even that many would not repay a drafting step (the start-up curves,
    # within `ceiling_margin`), the gate neither learns nor probes. None: no bound
    ceiling: int | None = None
    ceiling_margin: float = 1.5
    accepted: float | None = None  # a: accepted draft tokens per drafted request-step
    samples: int = 0  # drafting steps observed
    arms: GateArms | None = None  # measured throughput of both regimes: what decides, where measured
    plain: PlainFit | None = None  # plain steps: observed = plain_scale x measured + c x prefill rows
    extra_scale: float = 1.0  # observed / measured drafting's extra over a plain step (D - P; moving average)
    probe_extra: float | None = None  # seconds a probe's first step cost over a plain one (moving average)
    off_streak: int = 0
    # the drafters outside the sample are dormant (the engine reads this): since off_streak
    # reached dormant_after, until a step where every request drafts
    dormant: bool = False
    decisions_off: int = 0  # steps it kept drafting off
    probes: int = 0  # steps it drafted for a sample only (learning included)
    # what it saw, step by step, when a list: runs of steps alike, [R, "on" / "off" / "probe",
    # steps, seconds, tokens (made: a step may pass a request's max_tokens), counted (by the arms),
    # dormant] (bench: gate_trace.json)
    trace: list[list] | None = None
    _queued: list[int] = field(default_factory=list)  # the next decisions, already taken (pairs)
    _a_sums: tuple[float, float] = (0.0, 0.0)  # accepted tokens, drafted requests: decayed sums

    def __post_init__(self) -> None:
        if self.plain is None:  # (a prefill row's expected cost: a 64th of a one-request step)
            self.plain = PlainFit(unit=self.costs.plain_s(1) / 64, alpha=self.alpha)

    @property
    def plain_scale(self) -> float:
        """Observed / measured wall seconds of a plain step (prefill rows' cost apart)."""
        return self.plain.scale

    def plan(self, requests: int) -> int:
        """How many of the next step's R decoding requests draft: R, none, or a sample."""
        if requests == 0:
            return 0
        k = self._decide(requests)
        if k >= requests:
            self.off_streak = 0
            self.dormant = False
        else:
            self.dormant = self.dormant or self.off_streak >= self.dormant_after
        return k

    def _decide(self, requests: int) -> int:
        if self._queued:  # (the second step of a probe)
            return min(self._queued.pop(0), requests)
        if self.arms is not None:  # measured: the faster regime here (or the slower one's window)
            on = self.arms.choose(requests)
            if on is not None:
                return requests if on else self._off()
        if not self.could_pay(requests):
            return self._off()
        if self.accepted is None or self.samples < self.min_samples:
            return self._probe(requests)  # still learning a
        if self.plain_seen < self.min_plain and requests > self.sample:
            return self._off()  # (the steady plain step, measured before drafting is weighed against it)
        if self.pays(requests):
            return requests
        if self.off_streak >= self.probe_interval(requests):
            self.off_streak = 0
            return self._probe(requests)
        return self._off()

    def _off(self) -> int:
        self.off_streak += 1
        self.decisions_off += 1
        return 0

    def could_pay(self, requests: int) -> bool:
        """Whether drafting could pay at R at all: with every drafted token accepted (a = ceiling),
        (1 + a) plain steps must cover a drafting step, by the start-up curves and within
        `ceiling_margin` of them (they are measured once, so they keep a margin; no observed scale
        enters: a noisy one would then keep drafting off for good). Learning a and probing cost
        drafting steps, and where none could repay them they are pure loss (on a 2-core CPU, 32
        requests: a drafting step 13.6 plain ones against a depth-8 tree, 2026-12-07)."""
        if self.ceiling is None:
            return True
        p, d = self.costs.plain_s(requests), self.costs.drafting_s(requests)
        return (1 + self.ceiling) * p * self.ceiling_margin >= d

    def pays(self, requests: int) -> bool:
        """Whether drafting for every one of R requests gives more tokens per second."""
        t_plain, t_draft = self.predicted(requests)
        return (1 + (self.accepted or 0.0)) * t_plain >= t_draft

    def predicted(self, requests: int) -> tuple[float, float]:
        """(t_plain, t_draft): a step's seconds for R requests without and with drafting."""
        t_plain = self.plain_scale * self.costs.plain_s(requests)
        return t_plain, t_plain + self.extra_scale * self._extra(requests)

    def _extra(self, requests: int) -> float:
        """Drafting's measured extra over a plain step for R drafting requests (D(R) - P(R))."""
        return max(0.0, self.costs.drafting_s(requests) - self.costs.plain_s(requests))

    def _probe_extra(self, requests: int) -> float:
        """A probe step's measured extra over a plain step of R requests (its sample drafting)."""
        return self.costs.probe_extra_s(requests, min(requests, self.sample))

    def probe_interval(self, requests: int) -> int:
        """Plain steps between probes. A probe drafts for a sample of k requests in two steps:
        each costs about what drafting costs k requests, t_draft(k) - t_plain(k), and returns
        their k a accepted tokens, worth k a t_plain(R) / R of plain decoding; spaced by n plain
        steps of t_plain(R), the probes lose at most `probe_budget` of the time. (So near
        break-even, where a probe loses little, the gate looks again soon.)"""
        k = min(requests, self.sample)
        t_plain = self.plain_scale * self.costs.plain_s(requests)
        steady = self.extra_scale * self._probe_extra(requests)
        # (what a probe's first step did cost, once seen: its drafters first catch up on every
        # token since the last probe, which the steady costs leave out; 34 ms against a 1 ms plain
        # step at 64 requests on the H200, 2026-12-02, and 11 such probes took a run to 0.27x `ar`)
        first = max(steady, self.probe_extra or 0.0)
        gain = k * (self.accepted or 0.0) * t_plain / requests
        loss = max(0.0, first - gain) + max(0.0, steady - gain)
        return self._spacing(loss, t_plain)

    def _spacing(self, loss: float, step: float) -> int:
        n = math.ceil(loss / (self.probe_budget * step)) if step > 0 else self.probe_max
        return max(self.probe_every, min(self.probe_max, n))

    def observe(self, requests: int, drafted: int, seconds: float, accepted: int, prefill_rows: int = 0,
                steady: bool = True) -> None:
        """A step of R decoding requests, `drafted` of them drafting, and `prefill_rows` prompt
        rows took `seconds` and accepted `accepted` draft tokens. Every step teaches a; the cost
        only steps that are `steady`: not a drafting step in which a drafted request did not
        draft in the step before (its drafter first caught up on every token since, a prompt or a
        stretch of plain steps, and may have captured a graph for that pass), nor a plain step
        that did not wait for a pass (async scheduling: the first after a drafting step). Such a
        step is the exception once drafting is on; learned from, its cost made every later
        drafting step look dear and kept drafting off (H200, 2026-12-02: a scale of 33-60 at
        32-64 requests, 2.0 at one). What a non-steady sample step costs over a plain one is what
        a probe's first step costs (`probe_extra`), which spaces the probes. The prefill rows'
        cost (the plain fit's c) comes off every drafting step before it teaches. A plain step
        teaches only in the off regime (`dormant`), as P(R) was measured. With `arms`, every
        step also joins its regime's measured throughput (tokens: a token a request, plus the
        accepted ones)."""
        if requests == 0:
            return
        on = True if drafted >= requests else (False if drafted == 0 else None)
        counts = steady and (bool(on) or self.dormant)
        if self.arms is not None:
            self.arms.observe(requests, on, requests + accepted, seconds, counts=counts)
        if self.trace is not None:
            kind = {True: "on", False: "off", None: "probe"}[on]
            last = self.trace[-1] if self.trace else None
            if last is not None and (last[0], last[1], last[6]) == (requests, kind, self.dormant):
                last[2:6] = [last[2] + 1, last[3] + seconds, last[4] + requests + accepted, last[5] + counts]
            else:
                self.trace.append([requests, kind, 1, seconds, requests + accepted, int(counts), self.dormant])
        if drafted:
            self.samples += 1
            # a, request-weighted: a probe's 4 requests weigh 4 / 64 of a full step at 64 (its
            # moving average of per-step means read 7.5 where a drafted request made 5.6 tokens
            # in all, H200 2026-12-03); the first steps weigh alike (a just-started drafter's weak
            # first step must not dominate), then older steps fade by a_alpha a step
            k = 1.0 if self.samples <= self.min_samples else 1 - self.a_alpha
            acc, n = self._a_sums
            self._a_sums = acc, n = k * acc + accepted, k * n + drafted
            self.accepted = acc / n
        p = self.costs.plain_s(requests)
        if drafted == 0:
            # (not a step that is mostly prefill, as when a wave of prompts arrives: two or three
            # of those taught a scale of 2.7 at 32-64 requests, H200 2026-12-03, drafting's favour)
            if steady and self.dormant and prefill_rows <= PREFILL_ROWS_MAX + 4 * requests:
                self.plain.observe(p, prefill_rows, seconds)
                self.plain_seen += 1
            return
        over = seconds - self.plain.seconds(p, prefill_rows)  # (what drafting added)
        if steady:  # every request drafting, or a probe's second step: drafting's extra, scaled
            extra = self._extra(drafted) if drafted >= requests else self._probe_extra(requests)
            if extra > 0:
                # one step teaches at most OUTLIER x the scale it corrects: a step that waited for a
                # capture, a compile or the collector (233 ms over a ~1.4 ms extra) took the scale
                # to 150 at one request and kept drafting off for good (H100, 2026-12-07)
                ratio = min(max(0.0, over) / extra, OUTLIER * self.extra_scale)
                self.extra_scale = self._ema(self.extra_scale, ratio)
        elif drafted < requests:  # a probe's first step (or a learning step): its cost over a plain step
            self.probe_extra = self._ema(self.probe_extra, max(0.0, over))

    def _probe(self, requests: int) -> int:
        """A sample drafts this step and the next (the second one steady: it teaches the cost)."""
        k = min(requests, self.sample)
        if k < requests:
            self.probes += 2
            self._queued = [k]
        return k

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
