"""What the draft gate measured and learned, on the bundled pair with a drafter: its StepCosts at
engine start, then after a run of C requests its acceptance, scales, decisions and the engine's
preemptions, beside the same run without the gate and `ar`'s (wall time, steps).

    python bench/gpu_gate_check.py --draft eagle3 --concurrency 1 64 [--workload mbpp --data-dir .data] [--max-tokens 128] [--phases]
    python bench/gpu_gate_check.py --draft eagle3 --concurrency 64 --requests 256 --phases   (a steady state)

The measured round is one wave of C requests, or with `--requests N` a steady state: N requests, at
most C in flight, the next admitted as one finishes (as `tandem bench --requests`), so prompts
arrive while others decode.

Prompts: the workload's (MBPP by default, cycled), or with `--workload random` random token ids
(--prompt-tokens of them: on random text the drafters accept little, so the gate should stay off).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from tandem.bench.concurrency import gate_summary
from tandem.bench.stack_sampler import StackSampler
from tandem.bench.workloads import load_workload
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_step_timeline as timeline  # noqa: E402  (its phase labels and host clock)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="eagle3")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--workload", default="mbpp")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-ungated", action="store_true", help="ar and tree+gate only")
    ap.add_argument("--async-steps", action="store_true", help="async scheduling on the CPU too (a GPU has it by default)")
    ap.add_argument("--requests", type=int, default=None,
                    help="the measured round: this many requests, at most C in flight (default: one wave of C)")
    ap.add_argument("--stacks", action="store_true", help="the measured round's stack, sampled (tandem.bench."
                    "stack_sampler): where its wall time goes, by function")
    ap.add_argument("--phases", action="store_true", help="the measured round's exclusive host time per phase "
                    "(bench/gpu_step_timeline.py's labels and clock), us a step")
    a = ap.parse_args()
    pair = load_pair(None, None if a.draft == "draft" else a.draft, a.device,
                     "bfloat16" if a.device == "cuda" else "float32")
    for c in a.concurrency:
        runs = (("ar", False), ("tree", False), ("tree", True))
        for method, gate in (runs[::2] if a.skip_ungated else runs):
            t0 = time.perf_counter()
            eng = Engine(pair.target, pair.draft if method != "ar" else None, pair.tokenizer,
                         EngineConfig(method=method, max_num_seqs=c, draft_gate=gate,
                                      async_scheduling=True if a.async_steps else None))
            start_s = time.perf_counter() - t0
            g = torch.Generator().manual_seed(0)
            texts = None if a.workload == "random" else [p.text for p in load_workload(a.workload, 2 * c, a.data_dir)]

            def add(i: int) -> None:
                ids = (torch.randint(10, 8000, (a.prompt_tokens,), generator=g).tolist() if texts is None
                       else pair.tokenizer.encode(texts[i % len(texts)]).ids[-256:])
                eng.add_request(ids, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True))

            for rnd in range(2):  # a warm-up round, then the measured one
                total = (a.requests or c) if rnd == 1 else c
                for i in range(c):
                    add(rnd * c + i)
                clock = None
                if rnd == 1 and a.phases:
                    clock = timeline.HostClock()
                    timeline.label_phases(eng, clock)
                    eng.step = clock.wrap(eng.step, "Engine.step")
                sampler = StackSampler(mode="cpu").start() if rnd == 1 and a.stacks else None
                s0, t = eng.steps, time.perf_counter()
                added = c
                while eng.has_unfinished():
                    for _ in eng.step():  # (each request that finished: the next one in, up to `total`)
                        if added < total:
                            add(rnd * c + added)
                            added += 1
                if a.device == "cuda":
                    torch.cuda.synchronize()
                wall, steps = time.perf_counter() - t, eng.steps - s0
                if sampler is not None:
                    print(sampler.stop().report(25))
            k = eng.counters
            print(f"C={c} {method} gate={gate}: {total * a.max_tokens / wall:.0f} tok/s, {steps} steps, {wall / steps * 1e3:.2f} ms/step, "
                  f"preemptions {k.preemptions}, engine start {start_s:.1f} s")
            if clock is not None:
                top = sorted(clock.spent.items(), key=lambda kv: -kv[1])[:16]
                print("  host us a step: " + ", ".join(f"{name} {sec / steps * 1e6:.0f}" for name, sec in top))
            # the measured round's steps by kind: where its time went (of the engine's latest 4,096 steps)
            recs = [r for r in k.records if r.step >= s0]
            kinds = {"prefill": [r for r in recs if r.rows > r.verified + r.nodes],  # (prefill rows in it)
                     "plain": [r for r in recs if r.rows == r.verified and r.nodes == 0],
                     "drafting": [r for r in recs if r.rows == r.verified + r.nodes and r.nodes > 0],
                     "no rows": [r for r in recs if r.rows == 0]}
            print(f"  async steps {k.async_steps} of {eng.steps}; {len(recs)} of the round's {steps} steps kept: " + ", ".join(
                f"{name} {len(rs)} steps, {sum(r.seconds for r in rs) * 1e3:.1f} ms"
                f" (median {statistics.median([r.seconds for r in rs]) * 1e3:.3f})" for name, rs in kinds.items() if rs))
            gt = eng.gate
            if gt is not None:
                cs = gt.costs
                probe = cs.probe or (float("nan"),) * len(cs.requests)
                print("  step costs (ms): " + ", ".join(
                    f"R={r}: plain {p * 1e3:.2f} / probe {q * 1e3:.2f} / drafting {d * 1e3:.2f}"
                    for r, p, q, d in zip(cs.requests, cs.plain, probe, cs.drafting)))
                print(f"  learned ({gt.samples} drafting steps): {gate_summary(gt, c)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
