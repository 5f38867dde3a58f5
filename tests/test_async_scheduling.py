"""Async scheduling of `ar` steps (EngineConfig.async_scheduling): each step's pass is queued
before the previous step's tokens are read, its decode rows fed from the previous pass's argmax
on the device. The outputs must equal the synchronous engine's and solo `ar`'s, token for token,
through preemption, EOS and stop strings, aborts of a request whose step is still queued, and a
sampled request that turns the mode off while it runs."""
from __future__ import annotations

import pytest
import torch

from models_for_tests import assert_clean, run_all, tiny_model
from tandem.config import GenerationConfig
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import RequestState, SamplingParams
from tandem.runtime.generate import Generator

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def solo(target):
    """20 prompts (1-40 tokens) and each one's solo greedy `ar` output."""
    g = Generator(target, None)
    rng = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 95, (int(torch.randint(1, 41, (), generator=rng)),), generator=rng).tolist()
               for _ in range(20)]
    gen = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    return prompts, [g.generate(p, "ar", gen=gen).token_ids for p in prompts]


def engine(target, graphs: str | None = None, **kw) -> Engine:
    cfg = dict(method="ar", async_scheduling=True, block_size=8, max_num_batched_tokens=96, debug_check=True)
    e = Engine(target, None, config=EngineConfig(**{**cfg, **kw}))
    if graphs == "emulate":  # the CUDA path's bucketed static buffers (the feed's too), run eagerly
        e.model.emulate = e.model.use_graphs = True
    return e


@pytest.mark.parametrize("graphs", [None, "emulate"])
@pytest.mark.parametrize("pool", ["roomy", "tiny"])
def test_async_ar_equals_solo_ar(target, solo, graphs, pool):
    """Every step after the first is queued before the last one is read; the tiny pool preempts
    requests whose token is still on its way (they recompute with it)."""
    prompts, refs = solo
    kw = dict(block_size=4, num_blocks=30, max_num_batched_tokens=64) if pool == "tiny" else {}
    e = engine(target, graphs, **kw)
    outs = run_all(e, prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    assert all(o.finish_reason == "length" and o.figures.target_passes == MAX_NEW for o in outs)
    # every step with a pass queued it before reading the last (the last step only reads; with
    # the tiny pool, so do steps whose plan preempted and scheduled nothing)
    assert e.counters.async_steps == sum(1 for r in e.counters.records if r.rows)
    if pool == "roomy":
        assert e.counters.async_steps == e.steps - 1
    assert e.counters.spare_rows == 0  # (max_tokens is known ahead: no row past it is planned)
    if pool == "tiny":
        assert e.counters.preemptions > 0
    assert_clean(e)


def test_requests_that_end_at_eos_equal_the_synchronous_engine(target, solo):
    """An EOS is seen one step late: the request's row in the step queued meanwhile is spare
    (dropped), its output and finish reason are the synchronous engine's."""
    prompts, refs = solo
    eos = max(set(t for r in refs for t in r[2:12]), key=lambda t: sum(r[2:12].count(t) for r in refs))
    params = SamplingParams(max_tokens=MAX_NEW)
    outs = {}
    for mode in (False, True):
        e = engine(target, async_scheduling=mode)
        e.eos = {eos}
        outs[mode] = run_all(e, prompts, params)
        if mode:
            assert e.counters.spare_rows > 0
        assert_clean(e)
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert [o.finish_reason for o in outs[True]] == [o.finish_reason for o in outs[False]]
    ended = [o for o in outs[True] if o.finish_reason == "eos"]
    assert ended and all(o.token_ids[-1] == eos for o in ended)
    for o, ref in zip(outs[True], refs):  # each one its solo output, cut after its first EOS
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert o.token_ids == ref[:cut]


def test_an_abort_while_its_step_is_queued_leaves_the_others_exact(target, solo):
    prompts, refs = solo
    e = engine(target)
    reqs = [e.add_request(p, GREEDY) for p in prompts[:8]]
    while not all(r.output_ids for r in reqs):
        e.step()
    queued = [s.request for s in e._inflight.plan.decodes]
    victim = queued[3]
    assert e.abort(victim.request_id) and victim.state is RequestState.ABORTED
    done = {o.request_id: o for o in e.run()}
    assert victim.request_id not in done and victim.finish_reason == "abort"
    assert e.counters.spare_rows >= 1  # (its row in the queued step)
    for r, ref in zip(reqs, refs):
        if r is not victim:
            assert done[r.request_id].token_ids == ref
    assert_clean(e)
    # every request aborted with a step queued: nothing is unfinished, the next step reads it away
    reqs = [e.add_request(p, GREEDY) for p in prompts[:3]]
    for _ in range(4):
        e.step()
    assert e._inflight is not None
    for r in reqs:
        assert e.abort(r.request_id)
    assert not e.has_unfinished()
    assert e.step() == [] and e._inflight is None
    assert_clean(e)


def test_a_sampled_request_runs_its_steps_synchronously(target, solo):
    """A sampled request joining drains the queued step and turns async scheduling off while it
    runs; it draws what it draws in a synchronous engine (its own seeded stream), the greedy ones
    stay exact, and async scheduling resumes once it is gone."""
    prompts, refs = solo
    sampled = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    sync = engine(target, async_scheduling=False)
    want = run_all(sync, [prompts[5]], sampled)[0].token_ids
    e = engine(target)
    reqs = [e.add_request(p, GREEDY) for p in prompts[:4]]
    for _ in range(6):
        e.step()
    before = e.counters.async_steps
    s = e.add_request(prompts[5], sampled)
    while not s.done:
        e.step()
    assert e.counters.async_steps == before and e._inflight is None
    assert s.output_ids == want
    done = {o.request_id: o for o in e.run()}
    assert e.counters.async_steps > before
    assert [done[r.request_id].token_ids for r in reqs] == refs[:4]
    assert_clean(e)


def test_stop_strings_on_the_bundled_pair_equal_the_synchronous_engine():
    from tandem import LLM
    from tandem.runtime.pair import bundled_available

    if not bundled_available():
        pytest.skip("the bundled pair is not in this checkout")
    prompts = ["def fib(n):", "import os\n", "class Stack:\n"]
    plain = LLM(method="ar", engine_config=EngineConfig(async_scheduling=False)).generate(
        prompts, SamplingParams(max_tokens=16))
    stops = [o.text[len(o.text) // 2:len(o.text) // 2 + 2] for o in plain]
    params = [SamplingParams(max_tokens=16, stop=st) for st in stops]
    outs = {mode: LLM(method="ar", engine_config=EngineConfig(async_scheduling=mode)).generate(prompts, params)
            for mode in (False, True)}
    for a, b, o, st in zip(outs[True], outs[False], plain, stops):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.finish_reason == "stop" and a.text == o.text[:o.text.find(st)]
