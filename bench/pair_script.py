"""What the bundled-pair GPU scripts share (gpu_async_check, gpu_profile_tree, gpu_tp_check):
their common flags, and the loaded pair with the MBPP prompts as token ids.

Imported as a sibling module (`python bench/<script>.py` puts bench/ on sys.path); it puts the
repository root on sys.path so the scripts run from a checkout without installing.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tandem.bench.workloads import load_workload  # noqa: E402
from tandem.runtime.pair import load_pair  # noqa: E402


def parser(doc: str, num_prompts: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--data-dir", default=".data")
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    return ap


def pair_and_prompts(args):
    """(the bundled pair on args.device, the first args.num_prompts MBPP prompts as token ids)."""
    os.makedirs(args.out, exist_ok=True)
    pair = load_pair(device=args.device, dtype=args.dtype)
    prompts = [pair.tokenizer.encode(p.text).ids for p in load_workload("mbpp", args.num_prompts, args.data_dir)]
    return pair, prompts
