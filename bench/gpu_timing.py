"""CUDA-event timings shared by the GPU benchmarks: eager calls, and calls inside a CUDA graph.

Eager timing of a call made of several launches counts the host's launch gaps between them (a
slow host can double it); graph timing is the GPU's own time, as the engine's graph runners see it.
Both cycle over `fns` (one per copy of the weights, so that reads come from HBM, not L2).
"""
from __future__ import annotations

import statistics

import torch


def median_ms(fns, iters: int, warmup: int = 10) -> float:
    """Median ms of one call, cycling over fns, each call timed on its own."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fns[i % len(fns)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fns, iters: int, per_graph: int = 10) -> float:
    """Median ms of one call within a CUDA graph of per_graph calls cycling over fns, over iters // per_graph
    replays (at least 5). The first calls (compiling) run outside the graph."""
    per_graph = -(-per_graph // len(fns)) * len(fns)
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(5, iters // per_graph)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_graph)
    del graph
    return statistics.median(times)
