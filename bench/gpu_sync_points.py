"""Where a decode step waits for the device: every synchronizing CUDA call of a few steady steps,
by the Tandem call site that made it (torch.cuda.set_sync_debug_mode). A step that drafts ahead
(EngineConfig.draft_ahead) should wait once, at its read-back; each further wait stalls the host
until the device has drained its queue, and the drafting queued ahead no longer overlaps anything.

    python bench/gpu_sync_points.py --method tree --concurrency 1 8 --data-dir .data

Prints per concurrency: steps observed, waits per step, and the count per call site.
"""
from __future__ import annotations

import argparse
import collections
import json
import traceback
import warnings

import torch

from tandem.bench.workloads import load_workload
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair


def _site() -> str:
    """The innermost frames in tandem/ of the current stack, as file:line function (two of them)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/tandem/" in f.filename and "/bench/gpu_" not in f.filename]
    return " <- ".join(f"{f.filename.split('/tandem/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-2:]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tandem/assets/pair/target")
    ap.add_argument("--draft", default="tandem/assets/pair/eagle3")
    ap.add_argument("--method", default="tree")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--data-dir", default=".data")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-draft-ahead", action="store_true")
    ap.add_argument("--no-device-context", action="store_true")
    args = ap.parse_args()
    pair = load_pair(args.target, args.draft if args.method != "ar" else None, "cuda", args.dtype,
                     need_draft=args.method != "ar")
    for c in args.concurrency:
        prompts = [pair.tokenizer.encode(p.text).ids[-256:] for p in load_workload("mbpp", c, args.data_dir)]
        eng = Engine(pair.target, pair.draft if args.method != "ar" else None, pair.tokenizer,
                     EngineConfig(method=args.method, max_num_seqs=c, max_num_batched_tokens=max(2048, 33 * c),
                                  draft_ahead=not args.no_draft_ahead, device_context=not args.no_device_context,
                                  draft_gate=False))
        for p in prompts:
            eng.add_request(p, SamplingParams(max_tokens=96, ignore_eos=True))
        for _ in range(4):  # prefill, then steady decode steps
            eng.step()
        sites: collections.Counter = collections.Counter()
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message):
                sites[_site()] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                for _ in range(args.steps):
                    eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
        print(json.dumps({"method": args.method, "C": c, "steps": args.steps,
                          "waits_per_step": round(sum(sites.values()) / args.steps, 2),
                          "sites": dict(sites.most_common())}, indent=1))
        while eng.has_unfinished():
            eng.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
