"""Summary statistics for benchmark figures, and the paired speed-ratio confidence interval.

A speed ratio is paired by prompt: method B's per-request tokens/s over method A's on the
same prompt. Its centre is the geometric mean of the per-prompt ratios (ratios multiply, so
their mean lives in log space); its 95% CI comes from a seeded percentile bootstrap that
resamples prompts with replacement.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float | None
    median: float | None
    p5: float | None
    p95: float | None
    min: float | None
    max: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(values: list[float]) -> Summary:
    """Mean, median, 5th/95th percentiles (linear interpolation), min, max of `values`."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return Summary(0, None, None, None, None, None, None)
    p5, med, p95 = np.percentile(v, [5, 50, 95])
    return Summary(int(v.size), float(v.mean()), float(med), float(p5), float(p95), float(v.min()), float(v.max()))


@dataclass(frozen=True)
class RatioCI:
    """Geometric-mean ratio (method / baseline) with a bootstrap 95% CI over prompts."""

    n: int  # prompts with a positive figure for both methods
    geomean: float | None
    lo: float | None
    hi: float | None

    def to_dict(self) -> dict:
        return {"n": self.n, "geomean": self.geomean, "ci95": [self.lo, self.hi]}


def paired_ratio_ci(method: list[float], baseline: list[float], n_boot: int = 2000, seed: int = 0,
                    level: float = 0.95) -> RatioCI:
    """Paired geometric-mean ratio of `method` over `baseline` (same prompt order) and its CI.

    Prompts where either figure is missing or not positive are left out (no ratio exists).
    """
    if len(method) != len(baseline):
        raise ValueError(f"paired figures need equal lengths ({len(method)} != {len(baseline)})")
    logs = np.asarray([math.log(a / b) for a, b in zip(method, baseline)
                       if a is not None and b is not None and a > 0 and b > 0], dtype=np.float64)
    if logs.size == 0:
        return RatioCI(0, None, None, None)
    centre = float(math.exp(logs.mean()))
    if logs.size == 1:
        return RatioCI(1, centre, centre, centre)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, logs.size, size=(n_boot, logs.size))  # [n_boot, n] resampled prompts
    boot = logs[idx].mean(axis=1)  # [n_boot] log geometric means
    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(boot, [alpha, 1.0 - alpha])
    return RatioCI(int(logs.size), centre, float(math.exp(lo)), float(math.exp(hi)))


def histogram(values: list[int]) -> dict[int, int]:
    """Counts of each integer value, keys sorted."""
    out: dict[int, int] = {}
    for v in values:
        out[int(v)] = out.get(int(v), 0) + 1
    return dict(sorted(out.items()))
