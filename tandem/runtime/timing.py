"""Timing one repeated piece of work: the median over runs, with CUDA events on a GPU (device
time of what the call queued) and the host clock on the CPU. Used by the async workers' start-up
profile, `tandem profile` and the GPU scripts."""
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
