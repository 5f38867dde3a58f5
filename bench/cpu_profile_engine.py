"""The batched engine's host work per step, on the CPU with a tiny model (so Python dominates):
decode-only ms/step at a few concurrencies, phases, and optionally a cProfile.

    PYTHONPATH=$PWD:$PWD/tests python -c "from conftest import save_tiny_checkpoint; \
        save_tiny_checkpoint('/tmp/tiny2','llama',max_position_embeddings=1024)"
    python bench/cpu_profile_engine.py --target /tmp/tiny2 --method ar --concurrency 1 8 64
    python bench/cpu_profile_engine.py --target /tmp/tiny2 --draft /tmp/tiny2 --method tree --concurrency 1 8 --profile
    python bench/cpu_profile_engine.py --device cuda --dtype bfloat16 --target tandem/assets/pair/target \
        --draft tandem/assets/pair/eagle3 --method tree --concurrency 8 64 --profile   (on the H200)

`--graphs emulate` (default) runs the GPU's host path: every pass packed into a row bucket's
static buffers (as a CUDA graph replay reads them), the pass itself eager. `--graphs off`: the
CPU's exact passes. Times are medians over `--steps` decode steps (prefill excluded), the best of
`--repeats` runs.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair


def build(args, concurrency: int) -> Engine:
    pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=args.method != "ar")
    cfg = EngineConfig(method=args.method, max_num_seqs=concurrency, device_verify=not args.host_verify,
                       max_num_batched_tokens=max(2048, concurrency * 33),  # (every request's 33-row tree at once)
                       async_scheduling=True if args.async_steps else None,
                       draft_gate=bool(args.gate_off))  # (a gated engine: its plain steps run async)
    eng = Engine(pair.target, pair.draft, pair.tokenizer, cfg)
    if args.gate_off:  # every step as the draft gate runs it while it keeps drafting off
        eng.gate = _Off()
    if args.graphs == "emulate" and args.device == "cpu":  # (on CUDA the engine's own graphs)  # the bucketed static buffers of the CUDA path, run eagerly
        eng.model.emulate = eng.model.use_graphs = True
        eng.model.max_seqs = concurrency
        d = eng.batched
        if d is not None and d.model.max_seq_blocks is not None:  # the drafter's captured passes and trees too
            d.model.emulate = d.model.use_graphs = True
            d.model.max_seqs = concurrency
            if hasattr(d, "_init_trees"):
                d._init_trees(getattr(d, "n_graph", None))
    return eng


class _Off:
    """A draft gate that keeps drafting off, its drafters dormant (the engine feeds its sample's only)."""
    decisions_off, sample, dormant = 0, 4, True

    def plan(self, requests: int) -> int:
        return 0

    def observe(self, *a, **k) -> None:
        pass


class HostOps(TorchFunctionMode):
    """Counts the torch calls of the host path (views and read-backs included), outside the
    passes that a GPU replays as graphs (`paused` inside them): each is a launch or more there."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))


def time_drafter_passes(eng: Engine, spent: list[float], ops: HostOps | None = None) -> None:
    """Count into spent[0] the drafter's passes (on a GPU graph replays: its context pass body,
    its whole level tree) so that drafting less them is the drafter's host work."""
    d = eng.batched
    if d is None:
        return
    depth = [0]

    def timed(fn):
        def inner(*a, **k):
            depth[0] += 1
            if ops is not None:
                ops.paused += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if ops is not None:
                    ops.paused -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - t0
        return inner

    d.model._body = timed(d.model._body)
    if hasattr(d.model, "run"):
        d.model.run = timed(d.model.run)
    if hasattr(d, "_device_tree"):
        d._device_tree = timed(d._device_tree)


def decode_steps(eng: Engine, concurrency: int, steps: int, seed: int, ops: HostOps | None = None
                 ) -> tuple[list[float], list[float], list[float]]:
    """Wall seconds of `steps` decode-only steps of `concurrency` requests, and of each step's
    host work: the step less the target's layers (`BatchedModel._body`: on a GPU those are one
    graph replay) and less drafting (the drafter's own work, StepRecord.drafting_s; not for `ar`),
    and of the drafter's host work: drafting less its passes (`time_drafter_passes`). With `ops`,
    the steps' host-path torch calls are counted into it (the steps run under its mode)."""
    g = torch.Generator().manual_seed(seed)
    vocab = eng.target.config.vocab_size
    params = SamplingParams(max_tokens=10 ** 6, ignore_eos=True)
    reqs = [eng.add_request(torch.randint(0, vocab, (16,), generator=g).tolist(), params)
            for _ in range(concurrency)]
    while any(r.in_prefill or r.state.value == "waiting" for r in reqs):
        eng.step()
    times, host, dhost = [], [], []
    body, spent, dspent = eng.model._body, [0.0], [0.0]

    def timed_body(*a, **k):
        if ops is not None:
            ops.paused += 1
        t0 = time.perf_counter()
        out = body(*a, **k)
        spent[0] += time.perf_counter() - t0
        if ops is not None:
            ops.paused -= 1
        return out

    eng.model._body = timed_body
    if not hasattr(eng, "_drafter_timed"):
        eng._drafter_timed = dspent
        time_drafter_passes(eng, dspent, ops)
    dspent = eng._drafter_timed
    for _ in range(steps):
        spent[0] = dspent[0] = 0.0
        t0 = time.perf_counter()
        if ops is not None:
            with ops:
                eng.step()
        else:
            eng.step()
        times.append(time.perf_counter() - t0)
        drafting = eng.counters.records[-1].drafting_s if eng.config.method != "ar" else 0.0
        host.append(times[-1] - spent[0] - drafting)
        dhost.append(drafting - dspent[0])
    del eng.model._body
    for r in reqs:
        eng.abort(r.request_id)
    return times, host, dhost


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="/tmp/tiny2")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--method", default="ar")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--graphs", choices=("emulate", "off"), default="emulate")
    ap.add_argument("--device", default="cpu", help="cuda: the real graphs; the cProfile then shows the host "
                    "path with the GPU's waits in the read-backs")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--host-verify", action="store_true", help="trees read back and verified on the host "
                    "(EngineConfig.device_verify False)")
    ap.add_argument("--gate-off", action="store_true", help="a speculative method's steps with the draft gate "
                    "keeping drafting off (what they cost beside `ar`'s)")
    ap.add_argument("--async", dest="async_steps", action="store_true", help="async scheduling, as a GPU runs "
                    "`ar` and the gate's plain steps (the CPU's default is synchronous)")
    ap.add_argument("--profile", action="store_true", help="cProfile the last run's steps")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--ops", action="store_true", help="count the host path's torch calls per step (one more run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for c in args.concurrency:
        eng = build(args, c)
        # (steps are long enough to stay in one bucket and context size: 16 + steps * tau << window)
        decode_steps(eng, c, 20, 99)  # warm-up
        runs = [decode_steps(eng, c, args.steps, rep) for rep in range(args.repeats)]
        meds = [statistics.median(t) * 1e3 for t, _, _ in runs]
        hosts = [statistics.median(h) * 1e3 for _, h, _ in runs]
        dhosts = [statistics.median(h) * 1e3 for _, _, h in runs]
        print(f"{args.method} C={c}: step {min(meds):.3f} ms, engine host (less layers, drafting) {min(hosts):.3f} ms, "
              f"drafter host (drafting less its passes) {min(dhosts):.3f} ms (best of {args.repeats} medians; "
              f"all: {', '.join(f'{m:.3f}/{h:.3f}/{d:.3f}' for m, h, d in zip(meds, hosts, dhosts))})", flush=True)
        if args.ops:
            ops = HostOps()
            eng2 = build(args, c)  # (a fresh engine: its drafter's passes paused for this counter)
            decode_steps(eng2, c, 20, 99, ops)
            ops.count = 0
            decode_steps(eng2, c, args.steps, 5, ops)
            print(f"{args.method} C={c}: {ops.count / args.steps:.1f} torch calls a step on the host path", flush=True)
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            decode_steps(eng, c, args.steps, 7)
            pr.disable()
            st = pstats.Stats(pr)
            st.sort_stats("tottime").print_stats(args.top)
            st.sort_stats("cumtime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
