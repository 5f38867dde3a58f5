"""Timing one repeated piece of work: the median over runs, with CUDA events on a GPU (device
time of what the call queued) and the host clock on the CPU. Used by the async workers' start-up
profile, `tandem profile` and the GPU scripts; PassClock: the serial loop's draft / verify split."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(device: torch.device, fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Median seconds of fn() over `iters` timed runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class PassClock:
    """Draft and verify time of every pass without stalling the loop: CUDA events recorded on the
    stream (read once, after the request's final sync), host time on the CPU. `mark()` is called
    before the draft, between draft and verify, and after the verify."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def totals(self) -> tuple[float, float]:
        """(draft seconds, verify seconds) summed over the passes; call after a sync."""
        m = self.marks
        span = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)
        draft = sum(span(m[i], m[i + 1]) for i in range(0, len(m) - 2, 3))
        verify = sum(span(m[i + 1], m[i + 2]) for i in range(0, len(m) - 2, 3))
        return draft, verify
