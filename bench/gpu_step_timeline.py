"""Where a batched engine step's time goes on a GPU: the device's busy time, its idle gaps, and
which host phase each gap belongs to.

A step's wall time is the device's busy time plus the gaps in which the device waits for the
host. This runs `--steps` decode steps under torch.profiler with the engine's phases labelled
(record_function around the methods in PHASES), then, per step:
- busy: the union of the step's kernel and copy intervals on the device;
- idle: the step's wall time less busy, split over the host phases running during each gap
  (the innermost labelled phase at each instant; "unlabelled" where none is);
- host: each phase's exclusive host time.

    python bench/gpu_step_timeline.py --draft tandem/assets/pair/eagle3 --method tree --concurrency 1 64 --out $OUT
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tandem.engine.config import EngineConfig
from tandem.engine.draft_gate import DraftGate, StepCosts
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair

# (object path from the engine, method names): the phases labelled
PHASES = [
    ("", ["_rows", "_boundary", "_async_step", "_read", "_async_plain", "_hand_over", "_skip_draft", "_feature_handle", "_drain", "_gate_drafts", "_device_nodes", "_device_drafts", "_verify_on_device", "_apply", "_feed",
          "_commit", "_emit", "_record", "_forward", "_host_drafts", "_feature_handles", "_draft_ahead",
          "_run_accepts"]),
    ("scheduler", ["plan_step"]),
    ("model", ["rows", "forward", "load_rows"]),
    ("batched", ["propose_device", "_roots", "_device_tree", "propose", "observe_many", "context", "run_accepts",
                 "_accepts_body", "commit_accepts"]),
    ("batched.model", ["rows", "run", "run_rows"]),
    ("pool", ["commit_many", "try_reserve", "trim", "reserve"]),
    ("gate", ["plan", "observe"]),
]


# (module, function names): module-level functions the engine calls through their module
FUNCTIONS = [
    ("tandem.engine.device_verify", ["launch", "read"]),
    ("tandem.engine.engine", ["upload", "download"]),  # (the engine's own names for them)
    ("tandem.kernels.tree_verify", ["fill_tree_rows", "accept_paths"]),
]


def _resolve(eng: Engine, path: str):
    obj = eng
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class HostClock:
    """Exclusive host seconds per phase, by perf_counter (no profiler: its per-op cost would
    inflate the phases that launch many small ops)."""

    def __init__(self):
        self.stack: list[list] = []  # [label, start, child seconds]
        self.spent: dict[str, float] = collections.defaultdict(float)

    def wrap(self, fn, label: str):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            self.stack.append([label, t0, 0.0])
            try:
                return fn(*a, **k)
            finally:
                _, start, child = self.stack.pop()
                dt = time.perf_counter() - start
                self.spent[label] += dt - child
                if self.stack:
                    self.stack[-1][2] += dt
        return wrapped


def _labelled(fn, label: str):
    def wrapped(*a, **k):
        with record_function("P:" + label):
            return fn(*a, **k)
    return wrapped


def label_phases(eng: Engine, clock: HostClock | None = None) -> None:
    wrap = clock.wrap if clock is not None else _labelled
    for path, names in PHASES:
        obj = _resolve(eng, path)
        if obj is None:
            continue
        for name in names:
            fn = getattr(obj, name, None)
            if fn is None or not callable(fn):
                continue
            setattr(obj, name, wrap(fn, f"{type(obj).__name__}.{name}"))
    for mod_name, names in FUNCTIONS:
        mod = importlib.import_module(mod_name)
        for name in names:
            fn = getattr(mod, name)
            setattr(mod, name, wrap(getattr(fn, "__wrapped_fn__", fn), f"{mod_name.rsplit('.', 1)[1]}.{name}"))
            getattr(mod, name).__wrapped_fn__ = getattr(fn, "__wrapped_fn__", fn)


def build(args, concurrency: int) -> Engine:
    pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=args.method != "ar")
    cfg = EngineConfig(method=args.method, max_num_seqs=concurrency, device_verify=not args.host_verify,
                       draft_ahead=not args.no_draft_ahead, device_context=not args.no_device_context,
                       async_scheduling=not args.no_async_scheduling, max_num_batched_tokens=max(2048, concurrency * 33),
                       draft_gate=False)  # (every step drafts; --gate-off: a gate that never does)
    if args.gate_off:  # a gated engine whose gate keeps drafting off: its plain steps against `ar`'s
        cfg = dataclasses.replace(cfg, draft_gate=True, step_costs=StepCosts((1,), (1e-3,), (2e-3,)))
    eng = Engine(pair.target, pair.draft, pair.tokenizer, cfg)
    if args.gate_off:  # (--gate-off real: the engine's DraftGate, taught that drafting never pays)
        eng.gate = _Off() if args.gate_off == "stub" else DraftGate(
            StepCosts((1, 64), (1e-3, 1e-3), (1.0, 1.0)), accepted=0.5, samples=5)
    return eng


class _Off:
    """A draft gate that never drafts (its off streak counts, so the drafters go dormant as with DraftGate)."""
    decisions_off = off_streak = probes = 0
    sample, dormant_after = 4, 16

    @property
    def dormant(self) -> bool:
        return self.off_streak >= self.dormant_after

    def plan(self, requests: int) -> int:
        self.off_streak += requests > 0
        self.decisions_off += requests > 0
        return 0

    def observe(self, *a, **k) -> None:
        pass


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _innermost(ranges: list[tuple[float, float, str]], t0: float, t1: float) -> dict[str, float]:
    """Seconds of [t0, t1] under each innermost labelled range (nested ranges: the deepest wins)."""
    pts = sorted({t0, t1} | {x for a, b, _ in ranges for x in (a, b) if t0 < x < t1})
    out: dict[str, float] = collections.defaultdict(float)
    for a, b in zip(pts, pts[1:]):
        mid = (a + b) / 2
        best, width = "unlabelled", float("inf")
        for ra, rb, name in ranges:
            if ra <= mid < rb and rb - ra < width:
                best, width = name, rb - ra
        out[best] += b - a
    return out


def analyse(trace: dict) -> dict:
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"] == "STEP")
    dev = [(e["ts"], e["ts"] + e["dur"]) for e in ev
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    phases = [(e["ts"], e["ts"] + e["dur"], e["name"][2:]) for e in ev if e["name"].startswith("P:")]
    n = len(steps)
    wall = busy = 0.0
    idle: dict[str, float] = collections.defaultdict(float)
    host: dict[str, float] = collections.defaultdict(float)
    for s0, s1 in steps:
        wall += s1 - s0
        iv = _union([(max(a, s0), min(b, s1)) for a, b in dev if b > s0 and a < s1])
        busy += sum(b - a for a, b in iv)
        inside = [(a, b, nm) for a, b, nm in phases if b > s0 and a < s1]
        gaps, t = [], s0
        for a, b in iv:
            if a > t:
                gaps.append((t, a))
            t = max(t, b)
        if t < s1:
            gaps.append((t, s1))
        for a, b in gaps:
            for k, v in _innermost(inside, a, b).items():
                idle[k] += v
        for k, v in _innermost(inside, s0, s1).items():
            host[k] += v
    us = lambda d: {k: round(v / n, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return {"steps": n, "wall_us": round(wall / n, 1), "busy_us": round(busy / n, 1),
            "idle_us": round((wall - busy) / n, 1), "idle_by_phase_us": us(idle), "host_by_phase_us": us(host)}


def run(args, c: int) -> dict:
    eng = build(args, c)
    g = torch.Generator().manual_seed(0)
    vocab = eng.target.config.vocab_size
    reqs = [eng.add_request(torch.randint(0, vocab, (16,), generator=g).tolist(),
                            SamplingParams(max_tokens=10 ** 6, ignore_eos=True)) for _ in range(c)]
    while any(r.in_prefill or r.state.value == "waiting" for r in reqs):
        eng.step()
    for _ in range(args.warmup):
        eng.step()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    sync()
    plain_ms = (time.perf_counter() - t0) / args.steps * 1e3  # unprofiled, unlabelled
    if args.host_only:  # exclusive host time per phase, no profiler
        clock = HostClock()
        label_phases(eng, clock)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            clock.wrap(eng.step, "Engine.step")()
        sync()
        wall = (time.perf_counter() - t0) / args.steps * 1e6
        host = {k: round(v / args.steps * 1e6, 1) for k, v in sorted(clock.spent.items(), key=lambda kv: -kv[1])}
        return {"method": args.method, "concurrency": c, "step_ms_unprofiled": round(plain_ms, 3),
                "wall_us": round(wall, 1), "host_by_phase_us": host, "drafted_ahead": eng.counters.drafted_ahead,
                "accepts_on_device": eng.counters.accepts_on_device, "trees_before_read": eng.counters.trees_before_read,
                "ahead_dropped": eng.counters.ahead_dropped, "steps": eng.steps,
                "async_steps": eng.counters.async_steps, "gate_off": args.gate_off or False}
    label_phases(eng)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            with record_function("STEP"):
                eng.step()
        sync()
    path = os.path.join(args.out, f"trace_{args.method}_c{c}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        res = analyse(json.load(f))
    if not args.keep_traces:
        os.remove(path)
    res.update(method=args.method, concurrency=c, step_ms_unprofiled=round(plain_ms, 3))
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tandem/assets/pair/target")
    ap.add_argument("--draft", default="tandem/assets/pair/eagle3")
    ap.add_argument("--method", default="tree")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the tool (no device timeline)")
    ap.add_argument("--host-verify", action="store_true")
    ap.add_argument("--no-draft-ahead", action="store_true", help="each step drafts its trees at its start")
    ap.add_argument("--no-device-context", action="store_true", help="the head is fed the accepts after the read")
    ap.add_argument("--no-async-scheduling", action="store_true", help="ar: each step reads its tokens before the next")
    ap.add_argument("--gate-off", nargs="?", const="stub", choices=["stub", "real"],
                    help="a gated engine whose gate never drafts (its plain steps): a stub gate, or the real one taught so")
    ap.add_argument("--host-only", action="store_true", help="exclusive host time per phase by perf_counter "
                    "(no profiler; where the device waits, the phase that waits holds the time)")
    ap.add_argument("--keep-traces", action="store_true")
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for c in args.concurrency:
        res = run(args, c)
        print(json.dumps(res))
        with open(os.path.join(args.out, "timeline.jsonl"), "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
