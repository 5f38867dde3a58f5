"""Measured throughput of drafting and of plain decoding, by concurrency: what the draft gate decides by.

The gate's cost model (tandem.engine.draft_gate) predicts a step's seconds from start-up curves,
kept current by the steps it sees. On the H200 that prediction decided wrongly where it matters:
the few plain steps a drafting run has (prompt waves, the steps after a probe, the tail) taught it
a plain step 1.5-3.7x the off regime's, and it kept drafting on at 32-64 requests in five runs of
five, where `tree` ran 0.54-0.94x `ar` in four (2026-12-03, bench/results/h200-2026-12-03-session15).
A model of costs is only as good as its least representative input.

Here both regimes are *measured* where they run, as tokens per second over windows of whole
steps, in each concurrency bucket (R decoding requests rounded to a power of two: 23-45 requests
are one bucket, 46-90 the next):
- on: every request drafts (steady steps: the first after plain ones restarts the drafters);
- off: none does, its drafters dormant (the plain steps before they go dormant feed them all,
  which the off regime does not).
A window counts everything its steps cost: the prompts that ride in them, acceptance, host
drift. The faster regime runs; the slower one runs again for one window when the time since it
last ran is long enough that the window's expected loss stays within `budget` of it (a two-armed
bandit with a fixed exploration budget). What a switch takes (its steps before they count) is
measured too and charged to exploring.

Exploring is not symmetric. Switching drafting off costs a few plain steps that still feed the
drafters; switching it on after they went dormant restarts every drafter from its whole context
(130 ms at 64 requests on the H200, 2026-12-02, against 1 ms plain steps). So the gate's cost
model decides a bucket until drafting has run a window there (`choose` answers None): it keeps
drafting off where it predicts a loss, probing a sample of the requests under its own budget,
and turns it on where it predicts a gain. Once drafting ran, plain decoding runs a window at once
(cheap to try), and from then on the measured rates decide.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def bucket(requests: int) -> int:
    """R decoding requests -> its bucket: log2 R, rounded (R = 1 -> 0, 6-11 -> 3, 46-90 -> 6)."""
    return round(math.log2(max(1, requests)))


@dataclass
class Rate:
    """One regime's counted steps in one bucket: sums over its windows, older windows decayed."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0
    windows: int = 0

    def per_s(self) -> float | None:
        """Tokens per second, None before a window."""
        return self.tokens / self.seconds if self.windows and self.seconds > 0 else None

    def step_s(self) -> float | None:
        return self.seconds / self.steps if self.windows and self.steps else None

    def add(self, w: "Window", decay: float) -> None:
        self.tokens = decay * self.tokens + w.tokens
        self.seconds = decay * self.seconds + w.seconds
        self.steps = decay * self.steps + w.steps
        self.windows += 1


@dataclass
class Bucket:
    """Both regimes' rates in one bucket, what switching into each took (its steps before they
    counted: seconds and tokens, moving averages), and the seconds run in the bucket since a
    window last explored."""

    on: Rate = field(default_factory=Rate)
    off: Rate = field(default_factory=Rate)
    entry_on: tuple[float, float] | None = None
    entry_off: tuple[float, float] | None = None
    since: float = 0.0

    def rate(self, on: bool) -> Rate:
        return self.on if on else self.off

    def entry(self, on: bool) -> tuple[float, float] | None:
        return self.entry_on if on else self.entry_off


@dataclass
class Window:
    """Steps of one regime in one bucket, in a row. `fresh`: it began at a switch of regime, so
    the steps before its first counted one (`entry_*`) are the switch's."""

    bucket: int
    on: bool
    fresh: bool
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    entry_tokens: float = 0.0
    entry_seconds: float = 0.0


@dataclass
class GateArms:
    window: int = 16  # counted steps a window
    decay: float = 0.5  # weight of a regime's older windows when a new one ends
    budget: float = 0.02  # the share of a bucket's time exploring may lose
    alpha: float = 0.5  # weight of the newest switch in the entry costs' moving averages
    buckets: dict[int, Bucket] = field(default_factory=dict)
    current: Window | None = None
    exploring: tuple[int, bool] | None = None  # (bucket, regime) run until a window of it ends
    explorations: int = 0

    def choose(self, requests: int) -> bool | None:
        """Whether the next step of R decoding requests drafts (True), decodes plain (False), or
        None: drafting has not run a window in this bucket yet (the cost model decides)."""
        b = bucket(requests)
        if self.exploring is not None:
            if self.exploring[0] == b:
                return self.exploring[1]
            self.exploring = None  # (the bucket changed: exploring it again is for the budget to decide)
        bk = self.buckets.get(b)
        if bk is None or not bk.on.windows:
            return None
        if not bk.off.windows:  # drafting ran first: plain decoding now (switching to it is cheap)
            return self._explore(b, False)
        on, off = bk.on.per_s(), bk.off.per_s()
        best = on >= off
        ratio = min(on, off) / max(on, off)
        return self._explore(b, not best) if self._due(bk, best, ratio) else best

    def _due(self, bk: Bucket, best: bool, ratio: float) -> bool:
        """Whether the regime that is not `best` runs a window now: what it would lose against the
        best's rate (its window at `ratio` of it, both switches' steps) is within `budget` of the
        bucket's seconds since the last exploration."""
        rate = bk.rate(best).per_s()
        loss = self.window * bk.rate(not best).step_s() * (1 - ratio)
        for on in (True, False):  # (a switch never seen: a window's worth of its steps, making nothing)
            seconds, tokens = bk.entry(on) or (self.window * bk.rate(on).step_s(), 0.0)
            loss += max(0.0, seconds - tokens / rate)
        return bk.since * self.budget >= loss

    def _explore(self, b: int, on: bool) -> bool:
        self.exploring = (b, on)
        self.explorations += 1
        return on

    def observe(self, requests: int, on: bool | None, tokens: float, seconds: float, counts: bool) -> None:
        """A step of R decoding requests: every one drafting (on), none (off), or some (None: a
        probe, in neither regime); it made `tokens` and took `seconds`. counts: the step is one
        of its regime's steady steps (else, at a window's start, the switch's)."""
        b = bucket(requests)
        bk = self.buckets.setdefault(b, Bucket())
        bk.since += seconds
        w = self.current
        if w is not None and (on is None or w.bucket != b or w.on != on):
            self._close(w)
            w = None
        if on is None:
            self.current = None
            return
        if w is None:
            fresh = self.current is None or self.current.on != on
            w = self.current = Window(b, on, fresh=fresh)
        if counts:
            w.tokens += tokens
            w.seconds += seconds
            w.steps += 1
        elif w.steps == 0:
            w.entry_tokens += tokens
            w.entry_seconds += seconds
        if w.steps >= self.window:
            self._close(w)
            self.current = Window(b, on, fresh=False)

    def _close(self, w: Window) -> None:
        """A window ends: long enough (half a window), its steps join its regime's rate, and a
        fresh one's switch steps the switch's."""
        if w.steps < self.window // 2:
            return
        bk = self.buckets[w.bucket]
        rate = bk.rate(w.on)
        rate.add(w, self.decay)
        if w.fresh and w.entry_seconds:
            old = bk.entry(w.on)
            new = (w.entry_seconds, w.entry_tokens) if old is None else \
                tuple((1 - self.alpha) * o + self.alpha * n for o, n in zip(old, (w.entry_seconds, w.entry_tokens)))
            if w.on:
                bk.entry_on = new
            else:
                bk.entry_off = new
        if self.exploring == (w.bucket, w.on):
            self.exploring = None
            bk.since = 0.0

    def summary(self) -> str:
        """Each bucket's rates (tokens/s, windows) and switch costs, for logs and bench tables."""
        parts = []
        for b in sorted(self.buckets):
            bk = self.buckets[b]
            if not (bk.on.windows or bk.off.windows):
                continue
            def r(x: Rate) -> str:
                return f"{x.per_s():.0f}/{x.windows}" if x.windows else "-"
            def e(x: tuple[float, float] | None) -> str:
                return "-" if x is None else f"{x[0] * 1e3:.1f}"
            parts.append(f"R~{2 ** b}: on {r(bk.on)} off {r(bk.off)} tok/s/windows, "
                         f"switches {e(bk.entry_on)} / {e(bk.entry_off)} ms")
        return "; ".join(parts) + f"; {self.explorations} explorations" if parts else "nothing measured"
