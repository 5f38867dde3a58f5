"""GPU lane: the batched engine (paged KV, one target pass over every request's rows) decodes
what an uncached forward says, for `ar` and `tree`, with 24 requests in flight and a pool small
enough to preempt. On the CPU the same check runs on tiny models (tests/test_engine.py holds
the exact solo-`ar` equality there)."""
from __future__ import annotations

import pytest

from gpu_lane import bundled_pair, cpu, cuda, first_wrong_token
from models_for_tests import check_best_first_trees, noisy_copy, tiny_model
from tandem.config import SpecConfig
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams


def _pair(device: str):
    if device == "cuda":
        return bundled_pair("cuda")
    target = tiny_model(seed=0)
    return target, noisy_copy(target, 0.1), [[5, 17, 3, 88], list(range(20, 60)), [7] * 3]


@pytest.mark.parametrize("method", ["ar", "tree"])
@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
@pytest.mark.parametrize("num_blocks", [None, 60], ids=["roomy", "preempting"])
def test_engine_matches_an_uncached_forward(device, method, num_blocks):
    target, draft, prompts = _pair(device)
    # 24 requests: every prompt cut at 8 lengths (shared prefixes exercise the prefix cache)
    requests = [p[:max(1, len(p) * k // 8)] for p in prompts for k in range(1, 9)]
    cfg = EngineConfig(method=method, spec=SpecConfig(nodes=16, width=4), block_size=16, num_blocks=num_blocks,
                       max_num_batched_tokens=256, debug_check=True, draft_gate=False)  # (every step drafts)
    engine = Engine(target, draft, config=cfg)
    ids = [engine.add_request(p, SamplingParams(max_tokens=48, ignore_eos=True)).request_id for p in requests]
    outs = {o.request_id: o for o in engine.run()}
    for rid, prompt in zip(ids, requests):
        out = outs[rid]
        assert len(out.token_ids) == 48
        assert first_wrong_token(target, prompt, out.token_ids) is None, (method, prompt)
    if num_blocks is not None:
        assert sum(o.figures.preemptions for o in outs.values()) > 0
    assert engine.pool.check() == [] and engine.pool.num_free == engine.pool.num_blocks
    # `ar` on the GPU: async scheduling by default (each pass fed the last one's tokens on the device)
    assert (engine.counters.async_steps > 0) == (method == "ar" and device == "cuda")


@pytest.mark.parametrize("kind", ["eagle3", "block"])
@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
def test_engine_with_a_batched_feature_drafter_matches_an_uncached_forward(device, kind):
    """The bundled target with its EAGLE-3 head / block drafter drafting every request at once
    (engine.batched_draft): 16 requests decode what an uncached forward of the target says, and
    the drafts are accepted."""
    from tandem.engine.batched_features import BatchedBlockDrafter, BatchedEagleDrafter
    from tandem.runtime.pair import load_pair

    pair = load_pair(None, kind, device=device, dtype="float32")
    prompts = [pair.tokenizer.encode(f"# case {i}\ndef f{i}(x):\n").ids for i in range(16)]
    cfg = EngineConfig(method="tree", spec=SpecConfig(nodes=16, width=4), block_size=16, max_num_batched_tokens=512,
                       debug_check=True, draft_gate=False)  # (every step drafts: a GPU's default gates)
    engine = Engine(pair.target, pair.draft, config=cfg)
    assert isinstance(engine.batched, {"eagle3": BatchedEagleDrafter, "block": BatchedBlockDrafter}[kind])
    ids = [engine.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True)).request_id for p in prompts]
    outs = {o.request_id: o for o in engine.run()}
    for rid, prompt in zip(ids, prompts):
        assert first_wrong_token(pair.target, prompt, outs[rid].token_ids) is None, (kind, prompt)
    assert sum(o.tau for o in outs.values()) / len(outs) > 1.5
    assert engine.pool.check() == [] and engine.batched.pool.seqs == {}


@pytest.mark.parametrize("nodes", [7, 32])
@pytest.mark.parametrize("device", [cuda("cuda", id="cuda")])
def test_block_trees_built_together_on_the_device_equal_the_heap_walks(device, nodes):
    """The block drafter's trees of a batch built on the GPU (lattice.best_first_trees, the
    engine's path from 8 requests) have the heap walk's node sets and scores (float64 on both)."""
    check_best_first_trees(nodes, device)

