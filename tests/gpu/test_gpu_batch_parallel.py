"""GPU lane: batch parallelism (the drafter on its own CUDA stream, queued beside the target pass)
and shared-budget row selection decode what an uncached forward says, with 24 requests in flight
and a pool small enough to preempt; the overlap figure comes from CUDA events. On the CPU the
same check runs on tiny models (tests/test_batch_parallel.py holds the exact solo-`ar` equality)."""
from __future__ import annotations

import pytest

from gpu_lane import bundled_pair, cpu, cuda, first_wrong_token
from models_for_tests import noisy_copy, tiny_model
from tandem.config import SpecConfig
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.engine.row_selection import RowCost


def _pair(device: str):
    if device == "cuda":
        return bundled_pair("cuda")
    target = tiny_model(seed=0)
    return target, noisy_copy(target, 0.1), [[5, 17, 3, 88], list(range(20, 60)), [7] * 3]


@pytest.mark.parametrize("selection", [False, True], ids=["bp", "bp+selection"])
@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
def test_batch_parallel_matches_an_uncached_forward(device, selection):
    target, draft, prompts = _pair(device)
    requests = [p[:max(1, len(p) * k // 8)] for p in prompts for k in range(1, 9)]
    cfg = EngineConfig(method="tree", spec=SpecConfig(nodes=16, width=4), block_size=16, num_blocks=60,
                       max_num_batched_tokens=256, batch_parallel=True, row_selection=selection,
                       row_cost=RowCost(tile=128), prompt_admission=selection, debug_check=True)
    engine = Engine(target, draft, config=cfg)
    ids = [engine.add_request(p, SamplingParams(max_tokens=48, ignore_eos=True)).request_id for p in requests]
    outs = {o.request_id: o for o in engine.run()}
    for rid, prompt in zip(ids, requests):
        assert len(outs[rid].token_ids) == 48
        assert first_wrong_token(target, prompt, outs[rid].token_ids) is None, prompt
    m = engine.metrics()
    assert m["batch_parallel_steps"] > 0 and m["draft_s"] > 0 and 0.0 <= m["overlap"] <= 1.0
    if device == "cpu":
        assert m["overlap"] == 0.0
    print(f"\n{device} selection={selection}: {m['batch_parallel_steps']} overlapped steps, "
          f"{m['tail_fallbacks']} fallbacks, {m['rebalances']} rebalances, overlap {m['overlap']:.2f}, "
          f"{m['rows_per_step']:.1f} rows/step")
    assert engine.pool.check() == [] and engine.pool.num_free == engine.pool.num_blocks
