"""Capture the batched engine's CUDA graphs for the bundled target bucket by bucket, replay each
against the eager pass, and print where a capture fails (with its traceback).

    python bench/gpu_engine_graphs.py [--dtype bfloat16] [--max-rows 2048]
"""
from __future__ import annotations

import argparse
import time
import traceback

import torch

from tandem.engine.batched_model import GRAPH_BUCKETS, BatchedModel, Segment
from tandem.kv.paged import PagedKVPool
from tandem.runtime.pair import load_pair


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-rows", type=int, default=2048)
    args = ap.parse_args()
    pair = load_pair(None, None, "cuda", args.dtype, need_draft=False)
    target = pair.target
    pool = PagedKVPool.for_model(target, 2048, 16)
    bm = BatchedModel(target, pool, max_seqs=64, max_seq_blocks=40)
    eager = BatchedModel(target, pool, max_seqs=64, max_seq_blocks=40, use_graphs=False)
    pool.allocate("a", [], 0)
    pool.reserve("a", 40)
    for b in GRAPH_BUCKETS:
        if b > args.max_rows:
            break
        t0 = time.perf_counter()
        try:
            bm._graph(b)
            torch.cuda.synchronize()
        except Exception:
            print(f"bucket {b}: capture FAILED")
            traceback.print_exc()
            return 1
        seg = [Segment.chunk(list(range(1, 1 + min(b, 40))), 0, pool.seqs["a"].blocks, logits=True)]
        got = bm.forward(bm.rows(seg))
        want = eager.forward(eager.rows(seg))
        print(f"bucket {b}: captured in {time.perf_counter() - t0:.3f} s; replay vs eager max diff "
              f"{(got.float() - want.float()).abs().max().item():.3g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
