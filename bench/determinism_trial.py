"""Batch invariance, measured: one greedy prompt decoded alone and among 3 and 15 other requests,
with `ar` and with `tree`, by the engine in its default mode and with deterministic=True; prints
the number of distinct outputs and the wall time of each mode. bf16, tiny random models (CPU).

    python bench/determinism_trial.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from models_for_tests import noisy_copy, tiny_model  # noqa: E402
from tandem.config import SpecConfig  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.engine.request import SamplingParams  # noqa: E402


def main() -> None:
    target = tiny_model(seed=0).to(torch.bfloat16)
    draft = noisy_copy(tiny_model(seed=0), 0.1).to(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 95, (30,), generator=g).tolist()
    others = [torch.randint(0, 95, (int(torch.randint(1, 60, (), generator=g)),), generator=g).tolist()
              for _ in range(15)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for deterministic in (False, True):
        outs, t0 = set(), time.perf_counter()
        for method in ("ar", "tree"):
            for n in (1, 4, 16):
                cfg = EngineConfig(method=method, spec=SpecConfig(nodes=8, width=2), block_size=8,
                                   deterministic=deterministic)
                engine = Engine(target, draft if method != "ar" else None, config=cfg)
                req = engine.add_request(prompt, params)
                for p in others[:n - 1]:
                    engine.add_request(p, params)
                done = {o.request_id: o for o in engine.run()}
                outs.add(tuple(done[req.request_id].token_ids))
        print(f"deterministic={deterministic}: {len(outs)} distinct output(s) over batches 1 / 4 / 16 x ar / tree, "
              f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # (--help; no options)
    main()
