"""Batch parallelism (MineDraft) and batch-aware row selection (SpecPilot s4.4) in the engine.

Batch Manager unit cases (balance by KV load, skip_batch, recycle, rebalancing, the tail
fallback); the engine in batch-parallel mode (exact greedy outputs for 32 concurrent requests
with aborts and preemptions, verify rows reserved for the verified batch only); shared-budget
row selection (prefix-closed, budget exact, cost model) and its outputs.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import replace

import pytest
import torch

from models_for_tests import assert_clean, noisy_copy, run_all, tiny_model
from tandem.config import ConfigError, GenerationConfig, SpecConfig
from tandem.engine.batch_manager import BatchManager
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import Request, RequestState, SamplingParams
from tandem.engine.row_selection import RowCost, choose_nodes, select_rows, select_step
from tandem.runtime.generate import Generator
from tandem.tree.draft_tree import DraftTree

MAX_NEW = 24
TREE = SpecConfig(nodes=8, width=2)


# ---- Batch Manager ---------------------------------------------------------------------------
def req(rid: str, kv: int) -> Request:
    r = Request([1] * kv, request_id=rid)
    r.num_computed = kv
    return r


def manager(threshold: float = 0.25) -> BatchManager:
    return BatchManager(load=lambda r: r.num_computed, threshold=threshold)


def test_assign_balances_by_kv_tokens_not_by_count():
    bm = manager(threshold=0.0)
    long = req("long", 100)
    assert bm.assign(long) == bm.skip_batch == 1  # first request: the batch drafted first
    shorts = [req(f"s{i}", 10) for i in range(10)]
    for r in shorts:
        bm.assign(r)
    # ten short requests balance one long one: equal KV load, 1 request against 10
    assert bm.members(1) == [long] and bm.members(0) == shorts
    assert bm.loads() == (100, 100) and bm.imbalance() == 0.0
    # with a tolerance, newcomers join skip_batch (drafted first) while the loads stay within it
    bm = manager(threshold=0.25)
    for r in [long] + shorts:
        bm.assign(r)
    assert bm.imbalance() <= 0.25 and len(bm.members(0)) >= 2 * len(bm.members(1))


def test_new_requests_join_skip_batch_while_balanced_and_roles_alternate():
    bm = manager()
    reqs = [req(f"r{i}", 10) for i in range(4)]
    for r in reqs:
        bm.assign(r)
    assert bm.loads() == (20, 20)
    verified = []
    for _ in range(4):
        v, overlapped, fallback = bm.roles(reqs)
        assert overlapped and not fallback
        verified.append(v)
        bm.swap()
    assert verified == [0, 1, 0, 1]
    # a newcomer that keeps the balance within the threshold joins the batch drafted now
    skip = bm.skip_batch
    assert bm.assign(req("new", 5)) == skip and bm.counters.overlapped_steps == 4


def test_recycle_on_finish_abort_and_preemption_frees_the_load():
    bm = manager()
    reqs = [req(f"r{i}", 10 + i) for i in range(6)]
    for r in reqs:
        bm.assign(r)
    before = sum(bm.loads())
    for r in reqs[:3]:  # finish, abort, preemption all recycle the same way
        bm.recycle(r)
    assert sum(bm.loads()) == before - (10 + 11 + 12)
    assert set(bm.batch_of) == {"r3", "r4", "r5"}
    bm.recycle(reqs[0])  # twice, or unknown: ignored
    assert bm.assign(reqs[0]) in (0, 1)  # a preempted request is assigned again when it decodes


def test_rebalancing_after_aborts_cannot_freeze_an_imbalance():
    bm = manager(threshold=0.0)
    reqs = [req(f"r{i}", 10) for i in range(8)]
    for r in reqs:
        bm.assign(r)
    assert bm.loads() == (40, 40)
    for r in bm.members(0):  # every request of batch 0 is aborted
        bm.recycle(r)
    assert bm.loads() == (0, 40) and bm.imbalance() == 1.0
    moves = bm.rebalance()
    assert len(moves) == 2 and all(b == 0 for _, b in moves)
    assert bm.loads() == (20, 20) and bm.counters.rebalances == 2
    # an odd split no single move can improve stays put: no ping-pong
    bm.recycle(bm.members(0)[0])
    assert bm.loads() == (10, 20) and bm.rebalance() == [] and bm.rebalance() == []


def test_rebalance_moves_the_request_that_best_evens_the_loads():
    bm = manager(threshold=0.05)
    a, b, c = req("a", 50), req("b", 30), req("c", 12)
    bm.batch_of, bm.requests = {"a": 0, "b": 0, "c": 0}, {"a": a, "b": b, "c": c}
    moves = bm.rebalance()  # 92 : 0 -> moving b (30) leaves 62 : 30, a (50) leaves 42 : 50 (closest)
    assert [(r.request_id, to) for r, to in moves][0] == ("a", 1)
    assert bm.imbalance() <= 0.2


def test_tail_fallback_when_one_batch_is_empty_is_counted_and_verifies_the_other():
    bm = manager()
    r = req("only", 10)
    bm.assign(r)  # batch 1 = skip_batch; batch 0 (verify) empty
    v, overlapped, fallback = bm.roles([r])
    assert v == 1 and not overlapped and fallback  # roles swapped so the lone request is verified
    assert bm.counters.tail_fallbacks == 1 and bm.counters.overlapped_steps == 0
    assert bm.roles([]) == (bm.verify_batch, False, False)  # nothing decoding: not a fallback
    assert bm.counters.tail_fallbacks == 1


# ---- the engine in batch-parallel mode -------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    target = tiny_model(seed=0)
    return target, noisy_copy(target, 0.1)


@pytest.fixture(scope="module")
def solo(models):
    """32 prompts (1-40 tokens) and each one's solo greedy `ar` output."""
    target, draft = models
    g = Generator(target, draft)
    rng = torch.Generator().manual_seed(2024)
    prompts = [torch.randint(0, 95, (int(torch.randint(1, 41, (), generator=rng)),), generator=rng).tolist()
               for _ in range(32)]
    gen = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    return prompts, [g.generate(p, "ar", gen=gen).token_ids for p in prompts]


PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("method,spec", [("tree", TREE), ("chain", SpecConfig(k=4))])
def test_batch_parallel_32_concurrent_requests_equal_their_solo_ar_outputs(models, solo, method, spec):
    prompts, refs = solo
    engine = Engine(*models, config=EngineConfig(method=method, spec=spec, block_size=8, max_num_batched_tokens=96,
                                                 batch_parallel=True, debug_check=True))
    outs = run_all(engine, prompts)
    assert [o.token_ids for o in outs] == refs
    assert_clean(engine)
    c = engine.counters
    assert c.batch_parallel_steps > 0.5 * c.decode_steps  # most steps verify one batch while drafting the other
    assert c.tail_fallbacks >= 1  # the last request alone
    assert sum(r.drafted for r in c.records) > 0 and max(o.tau for o in outs) > 2.0
    verified = [r.verify_batch for r in c.records if r.overlapped]
    assert set(verified) == {0, 1}
    m = engine.metrics()
    assert m["batch_parallel_steps"] == c.batch_parallel_steps and m["rows_per_step"] > 1
    assert m["overlap"] == 0.0  # on the CPU the drafting runs after the target pass


def test_batch_parallel_with_aborts_and_preemptions_stays_exact(models, solo):
    prompts, refs = solo
    # 40 blocks of 4 rows: preemptions; a token budget of 64 rows: chunked prefill beside verify passes
    cfg = EngineConfig(method="tree", spec=TREE, block_size=4, num_blocks=40, max_num_batched_tokens=64,
                       batch_parallel=True, debug_check=True)
    engine = Engine(*models, config=cfg)
    reqs = [engine.add_request(p, PARAMS) for p in prompts[:20]]
    outs, aborted = [], set()
    while engine.has_unfinished():
        outs += engine.step()
        if engine.steps in (3, 8, 15):  # abort a decoding request of each batch in turn
            live = [r for r in reqs if r.state is RequestState.RUNNING and r.output_ids]
            if live:
                victim = live[engine.steps % len(live)]
                assert engine.abort(victim.request_id)
                aborted.add(victim.request_id)
    assert len(aborted) == 3 and not aborted & {o.request_id for o in outs}
    assert len(outs) == 17
    for o in outs:
        assert o.token_ids == refs[prompts.index(o.prompt_token_ids)]
    assert sum(o.figures.preemptions for o in outs) > 0
    assert engine.counters.batch_parallel_steps > 0
    assert_clean(engine)


def test_kv_rows_are_reserved_for_the_verified_batch_only(models, solo):
    prompts, _ = solo
    engine = Engine(*models, config=EngineConfig(method="tree", spec=TREE, block_size=8, batch_parallel=True))
    seen = []
    forward = engine.model.forward

    def inspecting_forward(rows):  # the real pass, after a look at the pool mid-step
        bm, pool = engine.batches, engine.pool
        drafted = [r.request_id for r in bm.members(bm.skip_batch)]
        verified = [r.request_id for r in bm.members(bm.verify_batch)]
        seen.append(([pool.seqs[i].reserved for i in drafted], [pool.seqs[i].reserved for i in verified]))
        return forward(rows)

    engine.model.forward = inspecting_forward
    run_all(engine, prompts[:12])
    both = [(d, v) for d, v in seen if d and v]
    assert len(both) > 5
    assert all(x == 0 for d, _ in both for x in d)  # drafted batch: committed blocks only
    assert all(x >= 1 for _, v in both for x in v)  # verified batch: root + its tree
    assert_clean(engine)


def test_sampled_chain_in_batch_parallel_mode_equals_plain_batched_mode(models, solo):
    prompts, _ = solo
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    outs = []
    for bp in (False, True):
        engine = Engine(*models, config=EngineConfig(method="chain", spec=SpecConfig(k=3), batch_parallel=bp))
        outs.append([o.token_ids for o in run_all(engine, prompts[:8], params)])
        assert_clean(engine)
    assert outs[0] == outs[1]  # each request draws from its own stream: draft, then accept, in turn


def test_batch_parallel_and_row_selection_need_a_drafting_method(models):
    with pytest.raises(ConfigError, match="batch_parallel needs a drafting method"):
        Engine(models[0], None, config=EngineConfig(method="ar", batch_parallel=True))
    with pytest.raises(ConfigError, match="row_selection needs a drafting method"):
        EngineConfig(method="ar", row_selection=True).validate()
    with pytest.raises(ConfigError, match="rebalance_threshold must be in"):
        EngineConfig(batch_parallel=True, rebalance_threshold=1.5).validate()
    with pytest.raises(ConfigError, match="increasing rows"):
        EngineConfig(row_cost=RowCost(points=((64, 1.0), (32, 2.0)))).validate()


# ---- row selection ---------------------------------------------------------------------------
def random_tree(rng: random.Random, n: int) -> DraftTree:
    """A best-first-like tree: each node under a random earlier node, path log-probs falling."""
    parents, logp = [-1], [0.0]
    for i in range(1, n):
        p = rng.randrange(i)
        parents.append(p)
        logp.append(logp[p] + math.log(rng.uniform(0.05, 1.0)))
    return DraftTree(tokens=list(range(n)), parents=parents, logp=logp)


def is_prefix_closed(tree: DraftTree, keep: list[int]) -> bool:
    s = set(keep)
    return 0 in s and all(tree.parents[i] in s for i in keep if i)


def test_shared_budget_is_exact_prefix_closed_and_takes_the_best_nodes():
    rng = random.Random(7)
    for trial in range(20):
        trees = {f"r{k}": random_tree(rng, rng.randint(1, 12)) for k in range(rng.randint(1, 6))}
        offered = sum(len(t) - 1 for t in trees.values())
        for budget in (0, 1, 5, offered // 2, offered, offered + 3):
            keep = select_rows(trees, budget)
            assert sum(len(k) - 1 for k in keep.values()) == min(budget, offered)
            assert all(is_prefix_closed(trees[r], k) and k == sorted(k) for r, k in keep.items())
            kept = [trees[r].logp[i] for r, k in keep.items() for i in k if i]
            left = [t.logp[i] for r, t in trees.items() for i in range(1, len(t)) if i not in keep[r]]
            if kept and left:  # path scores fall along paths, so best-first is the global top-k
                assert min(kept) >= max(left)


def test_shared_budget_hand_case_gives_one_request_zero_draft_nodes():
    a = DraftTree(tokens=[0, 1, 2, 3], parents=[-1, 0, 1, 0], logp=[0.0, -0.1, -0.3, -2.0])
    b = DraftTree(tokens=[0, 4, 5], parents=[-1, 0, 1], logp=[0.0, -1.5, -1.6])
    assert select_rows({"a": a, "b": b}, 2) == {"a": [0, 1, 2], "b": [0]}
    assert select_rows({"a": a, "b": b}, 4) == {"a": [0, 1, 2], "b": [0, 1, 2]}


def test_row_cost_curve_and_the_goodput_choice():
    c = RowCost(tile=64, slope=1.0)
    assert (c(1), c(64), c(96), c(128)) == (1.0, 1.0, 1.5, 2.0)
    measured = RowCost(points=((1, 1.0), (64, 1.0), (128, 1.8)))
    assert (measured(32), measured(96), measured(192)) == (1.0, 1.4, 2.6)
    # flat region: every node with a chance is free, so n fills up to the tile and no further
    assert choose_nodes([0.5] * 100, requests=4, base_rows=4, cost=c, max_nodes=100) == 60
    # a node pays beyond the tile only if its probability beats the goodput it dilutes
    assert choose_nodes([0.9] * 100, requests=1, base_rows=64, cost=RowCost(tile=64, slope=0.01),
                        max_nodes=100) == 100
    # steep cost past the tile, already past it: speculation off for the step
    assert choose_nodes([0.3] * 10, requests=8, base_rows=70, cost=RowCost(tile=64, slope=5.0), max_nodes=10) == 0
    assert choose_nodes([0.9] * 10, requests=2, base_rows=2, cost=c, max_nodes=3) == 3  # the cap holds
    sel = select_step({"a": DraftTree(tokens=[0, 1], parents=[-1, 0], logp=[0.0, -3.0])}, 70,
                      RowCost(tile=64, slope=5.0), 10)
    assert sel.off and sel.keep == {"a": [0]} and sel.expected_tokens == 1.0


@pytest.mark.parametrize("bp", [False, True])
def test_row_selection_keeps_outputs_exact_and_steps_inside_the_budget(models, solo, bp):
    prompts, refs = solo
    tile = 40
    cfg = EngineConfig(method="tree", spec=TREE, block_size=8, max_num_batched_tokens=96, batch_parallel=bp,
                       row_selection=True, row_cost=RowCost(tile=tile, slope=1000.0), prompt_admission=True,
                       debug_check=True, draft_gate=False)  # (the gate has its own test)
    engine = Engine(*models, config=cfg)
    outs = run_all(engine, prompts[:16])
    assert [o.token_ids for o in outs] == refs[:16]
    assert_clean(engine)
    c = engine.counters
    assert 0 < c.nodes_selected < c.nodes_offered  # the shared budget cut the trees
    for r in c.records:  # past the flat region a node costs far more than it can return
        assert r.nodes == 0 or r.rows <= tile
        assert r.rows <= cfg.max_num_batched_tokens
    assert any(r.nodes for r in c.records) and max(o.tau for o in outs) > 1.5


def test_prompt_admission_holds_new_prompts_to_the_flat_region_and_changes_no_output(models, solo):
    prompts, refs = solo
    tile, outs, over = 32, [], []
    for admission in (False, True):
        cfg = EngineConfig(method="tree", spec=TREE, block_size=8, max_num_batched_tokens=128, row_selection=True,
                           row_cost=RowCost(tile=tile), prompt_admission=admission, debug_check=True, draft_gate=False)
        engine = Engine(*models, config=cfg)
        plans = []
        plan_step = engine.scheduler.plan_step

        def recording_plan_step(*args, **kw):  # the real planner; its plan is looked at before rows grow
            plan = plan_step(*args, **kw)
            before = sum(s.rows for s in plan.scheduled if s.request not in plan.admitted)
            verifying = any(s.kind == "decode" and s.request not in plan.admitted for s in plan.scheduled)
            if verifying and plan.admitted:  # rows before the admissions, rows admitted
                plans.append((before, plan.num_rows - before))
            return plan

        engine.scheduler.plan_step = recording_plan_step
        reqs = [engine.add_request(p, PARAMS) for p in prompts[:4]]
        while not any(r.output_ids for r in reqs):
            engine.step()
        reqs += [engine.add_request(p, PARAMS) for p in prompts[4:12]]  # arrive while others decode
        done = {o.request_id: o for o in engine.run()}
        outs.append([done[r.request_id].token_ids for r in reqs])
        over.append(plans)
        assert_clean(engine)
    # prompts rode in verify steps; with admission control only inside the flat region's rows
    assert over[1] and all(before + admitted <= tile for before, admitted in over[1])
    assert any(before + admitted > tile for before, admitted in over[0])
    assert outs[0] == outs[1] == refs[:12]


def test_the_draft_gate_weighs_measured_step_costs_against_accepted_tokens():
    """DraftGate: learns the acceptance on a sample of the requests (two steps a probe); drafts
    for all of them where (1 + a) plain steps' time covers a drafting step's, for none where it
    does not (a sample now and then, a probe), and again for all once the acceptance repays it."""
    from tandem.engine.draft_gate import DraftGate, StepCosts

    # plain steps 10 ms at any batch; drafting 20 ms for one request, 30 for 4, 50 ms for 8
    costs = StepCosts((1, 4, 8), plain=(0.010, 0.010, 0.010), drafting=(0.020, 0.030, 0.050))
    g = DraftGate(costs, sample=4, alpha=1.0, a_alpha=1.0, min_samples=1, min_plain=0, probe_every=3, probe_budget=10.0)
    assert [g.plan(8), g.plan(8)] == [4, 4]  # learning: a sample of 4 drafts, two steps
    g.observe(8, 4, 0.030, accepted=4)  # 1 accepted token each; drafting's extra as measured
    assert g.accepted == 1.0 and g.extra_scale == 1.0
    assert g.plan(1) == 1  # alone: 2 tokens in 20 ms against 1 in 10 ms, it pays (ties draft)
    # 8 requests: 16 tokens in 50 ms against 8 in 10 ms: off; the 4th decision a probe (the floor of 3), two steps
    assert [g.plan(8) for _ in range(5)] == [0, 0, 0, 4, 4]
    assert g.decisions_off == 3 and g.probes == 4
    g.observe(8, 4, 0.030, accepted=20)  # 5 accepted each: 48 tokens in 50 ms
    assert g.plan(8) == 8
    assert g.predicted(2) == pytest.approx((0.010, 0.020 + 0.010 / 3))  # (linear between the measured points)


def test_the_draft_gate_neither_learns_nor_probes_where_no_acceptance_could_pay():
    """With its ceiling (the most draft tokens a request can have accepted in a step, a tree's
    depth), the gate spends no drafting step where even a fully accepted tree would not repay one:
    plain steps 10 ms; drafting 40 ms alone (5 x 10 x 1.5 covers it: it learns), 100 ms for 8
    (75 ms at most: never drafts, however long it runs)."""
    from tandem.engine.draft_gate import DraftGate, StepCosts

    costs = StepCosts((1, 8), plain=(0.010, 0.010), drafting=(0.040, 0.100))
    g = DraftGate(costs, ceiling=4, min_samples=1, probe_every=2, probe_budget=10.0)
    assert g.could_pay(1) and not g.could_pay(8)
    assert [g.plan(8) for _ in range(50)] == [0] * 50 and g.probes == 0 and g.accepted is None
    assert g.plan(1) == 1  # alone it could pay: it drafts to learn a
    free = DraftGate(costs, sample=4)  # (no ceiling: no bound; it learns everywhere)
    assert free.could_pay(8) and free.plan(8) == 4


def test_the_draft_gate_learns_the_acceptance_per_drafted_request():
    """a is accepted tokens per drafted request: while learning (min_samples steps) every request
    weighs the same, so a request's slow first step (its drafter just started) does not dominate;
    after that older steps fade by a_alpha a step, and a step weighs by its drafted requests (a
    probe's 4 requests far less than a step where 64 draft)."""
    from tandem.engine.draft_gate import DraftGate, StepCosts

    g = DraftGate(StepCosts((1,), (0.01,), (0.02,)), a_alpha=0.5, min_samples=3)
    for accepted in (0, 3, 6):
        assert g.plan(1) == 1  # learning
        g.observe(1, 1, 0.02, accepted=accepted)
    assert g.accepted == 3.0
    g.observe(1, 1, 0.02, accepted=1)  # (0.5 x 9 + 1) / (0.5 x 3 + 1)
    assert g.accepted == pytest.approx(2.2)
    g.observe(64, 64, 0.02, accepted=64 * 5)  # a full step at 64: 5 each
    g.observe(64, 4, 0.02, accepted=4 * 9)  # then a probe's 4: 9 each
    assert g.accepted == pytest.approx((0.25 * 5.5 + 0.5 * 320 + 36) / (0.25 * 2.5 + 0.5 * 64 + 4))
    assert 5 < g.accepted < 5.6


def test_one_outlying_drafting_step_moves_the_gates_scale_at_most_by_its_clamp():
    """A steady drafting step teaches drafting's extra scale by at most OUTLIER x the scale it
    corrects: a step that waited for a capture or the collector (on an H100, 233 ms over a 1.4 ms
    extra) would otherwise take the scale to ~150 and keep drafting off where it paid."""
    from tandem.engine.draft_gate import OUTLIER, DraftGate, StepCosts

    g = DraftGate(StepCosts((1,), (0.001,), (0.002,)), alpha=0.25)  # extra D - P = 1 ms
    g.observe(1, 1, 0.001 + 0.233, accepted=6)
    assert g.extra_scale == pytest.approx(0.75 + 0.25 * OUTLIER)  # (not 0.75 + 0.25 x 233)
    for _ in range(12):  # steady steps at the measured cost bring it back
        g.observe(1, 1, 0.002, accepted=6)
    assert g.extra_scale == pytest.approx(1.0, abs=0.05) and g.pays(1)


def test_the_draft_gate_measures_the_steady_plain_step_before_drafting_for_every_request():
    """Past its sample's size the gate first decodes plain until the off regime has taught its
    plain fit min_plain steps: the start-up curve's plain step (a forced pair) can be far dearer
    than a steady one, and drafting then looks cheaper in plain steps than it is. With the steady
    plain step measured, drafting that the start-up curve would turn on stays off."""
    from tandem.engine.draft_gate import DraftGate, StepCosts

    costs = StepCosts((1, 32), (0.001, 0.0008), (0.002, 0.004))  # start-up: plain 0.8 ms, drafting 4 ms at 32
    g = DraftGate(costs, sample=4, min_samples=1, min_plain=8, dormant_after=2)
    for _ in range(2):  # learning a on the sample: a probe's pair
        assert g.plan(32) == 4
        g.observe(32, 4, 0.002, accepted=4 * 5)  # a = 5: (1 + 5) 0.8 ms = 4.8 ms >= 4 ms, by the start-up curve
    assert g.pays(32)
    decided = []
    for _ in range(12):
        k = g.plan(32)
        decided.append(k)
        g.observe(32, k, 0.0005, accepted=0)  # steady plain steps cost 0.5 ms, not 0.8
    assert decided[:10] == [0] * 10 and g.plain_seen >= 8  # (2 before dormant, then 8 measured)
    assert g.plain_scale == pytest.approx(0.5 / 0.8, rel=0.05)
    assert not g.pays(32) and g.plan(32) == 0  # (1 + 5) 0.5 = 3.0 ms < 0.5 + 3.2 ms
    assert DraftGate(costs, sample=4, min_samples=1).plan(2) == 2  # (at or under the sample, as before)


def test_the_draft_gate_follows_observed_steps_and_its_probes_lose_at_most_their_budget():
    """Each step kind's predictions follow the observed steps: plain steps by a fit of their
    measured time and their prefill rows, drafting's extra over a plain step by a moving average,
    with the prefill rows' cost taken off (steps that are not steady left out); probes are spaced
    by what they lose: each of a probe's two steps costs drafting's extra for 4 requests, 40 - 10
    ms, and returns 4 tokens worth 4 x 10 / 8 ms of plain decoding, so with a 3% budget of 10 ms
    plain steps, one probe per 167 of them; one that loses nothing comes at the floor."""
    from tandem.engine.draft_gate import DraftGate, PlainFit, StepCosts

    costs = StepCosts((1, 4, 8), plain=(0.010, 0.010, 0.010), drafting=(0.020, 0.040, 0.050))
    g = DraftGate(costs, sample=4, alpha=0.5, a_alpha=0.5, min_samples=1, min_plain=0, probe_every=16, probe_max=1024,
                  probe_budget=0.03, plain=PlainFit(unit=1e-4, alpha=0.5, prior=0.0))
    g.observe(8, 4, 0.040, accepted=4)  # a = 1: off at 8 requests
    decisions = [g.plan(8) for _ in range(340)]
    assert [i for i, k in enumerate(decisions) if k] == [167, 168, 336, 337] and decisions[167] == 4  # ceil(50 / 0.3)
    # the probes' loss over those steps: 4 x 25 ms against 334 plain steps of 10 ms, within 3%
    assert 4 * 0.025 <= 0.03 * 334 * 0.010
    assert g.probe_interval(1) == 16  # alone: 20 ms for 2 tokens against 10 ms for 1, no loss: the floor
    assert DraftGate(costs, probe_every=80).probe_interval(1) == 80
    assert g.dormant  # (16 plain decisions in a row: plain steps now run as the off regime runs them)
    g.observe(8, 0, 0.020, accepted=0)  # plain steps take twice the measured time
    assert g.plain_scale == pytest.approx(2.0)
    g.observe(8, 0, 0.025, accepted=0, prefill_rows=100)  # and 100 prompt rows beside them 5 ms more
    assert g.plain_scale == pytest.approx(2.0) and g.plain.per_row == pytest.approx(50e-6)
    g.observe(8, 0, 0.001, accepted=0, steady=False)  # a step that waited for no pass teaches nothing
    g.observe(8, 0, 0.900, accepted=0, prefill_rows=2048)  # nor one that is mostly a wave's prefill
    assert g.plain_scale == pytest.approx(2.0) and g.plain.per_row == pytest.approx(50e-6)
    g.observe(8, 8, 0.060, accepted=8)  # 20 ms plain + 40 ms drafting's extra: as measured
    assert g.extra_scale == pytest.approx(1.0) and g.accepted == 1.0
    g.observe(8, 8, 0.065, accepted=8, prefill_rows=100)  # the same, and 100 prompt rows' 5 ms
    assert g.extra_scale == pytest.approx(1.0)
    # a drafting step whose drafter first caught up (not steady) teaches the acceptance, not the cost
    # (a: 4 + 8 + 8 accepted of 4 + 8 + 8 drafted, faded by half a step, then 40 of 8)
    g.observe(8, 8, 5.0, accepted=40, steady=False)
    assert g.extra_scale == pytest.approx(1.0) and g.accepted == pytest.approx((6.5 + 40) / (6.5 + 8))
    g.observe(8, 8, 0.140, accepted=8)  # the extra 120 ms: 3x
    assert g.extra_scale == pytest.approx(2.0)  # (1 + 3) / 2: alpha 0.5
    g.observe(8, 4, 0.140, accepted=4)  # a probe's second step: 4 requests' extra, 120 ms: 4x
    assert g.extra_scale == pytest.approx(3.0)
    assert g.predicted(8) == pytest.approx((0.020, 0.020 + 3 * 0.040))
    assert DraftGate(StepCosts((1,), (0.01,), (10.0,)), probe_max=1024).probe_interval(1) == 1024  # the ceiling


def test_the_plain_fit_tells_a_steps_cost_from_its_prefill_rows():
    """PlainFit recovers both terms from steps that mix prompt rows in or not (least squares,
    recent steps weighing more), follows a change, and with only one kind of step leans on its
    prior instead of swinging the per-row cost."""
    from tandem.engine.draft_gate import PlainFit

    fit = PlainFit(unit=1e-6, alpha=0.25)
    for i in range(40):  # P 1 ms; observed 0.5 ms + 2 us a prompt row
        rows = (0, 150, 0, 300)[i % 4]
        fit.observe(0.001, rows, 0.0005 + 2e-6 * rows)
    assert fit.scale == pytest.approx(0.5, rel=0.03) and fit.per_row == pytest.approx(2e-6, rel=0.03)
    for i in range(40):  # the host slows down: 0.8 ms a step, 3 us a row
        rows = (0, 150, 0, 300)[i % 4]
        fit.observe(0.001, rows, 0.0008 + 3e-6 * rows)
    assert fit.scale == pytest.approx(0.8, rel=0.03) and fit.per_row == pytest.approx(3e-6, rel=0.03)
    assert fit.seconds(0.001, 100) == pytest.approx(0.0011, rel=0.03)
    alone = PlainFit(unit=1e-6)
    for _ in range(40):  # decode-only steps: the scale, and no per-row cost out of nothing
        alone.observe(0.002, 0, 0.001)
    assert alone.scale == pytest.approx(0.5, rel=0.03) and alone.per_row == 0.0


def test_the_draft_gate_spaces_its_probes_by_what_probes_did_cost():
    """A probe's drafters first catch up on every token since they last drafted, which the
    steady drafting costs leave out: once a probe's first step (a sample step after plain ones,
    not steady) is seen, its cost over a plain step spaces the next probes."""
    from tandem.engine.draft_gate import DraftGate, StepCosts

    costs = StepCosts((1, 4, 8), plain=(0.010, 0.010, 0.010), drafting=(0.020, 0.040, 0.050))
    g = DraftGate(costs, sample=4, alpha=0.5, min_samples=1, probe_every=16, probe_max=1024, probe_budget=0.03)
    g.observe(8, 4, 0.040, accepted=4)  # learning (steady: the same sample): a = 1
    assert g.probe_extra is None and g.probe_interval(8) == 167  # (the steady costs: 2 x 25 ms lost a probe)
    g.observe(8, 4, 0.110, accepted=4, steady=False)  # a probe: 100 ms over a plain step
    assert g.probe_extra == pytest.approx(0.100) and g.extra_scale == 1.0
    assert g.probe_interval(8) == 400  # ceil(((100 - 4 x 1 x 10 / 8) + (30 - 5)) / 0.3)
    g.observe(8, 4, 0.030, accepted=4, steady=False)  # a cheaper one: the average follows
    assert g.probe_extra == pytest.approx(0.060)
    g.observe(8, 8, 5.0, accepted=40, steady=False)  # every request drafting: not a probe
    assert g.probe_extra == pytest.approx(0.060)


def test_a_probe_is_judged_against_the_measured_probe_step():
    """With a measured probe curve, a probe's second step corrects drafting's extra by what a probe
    step cost at start-up (its synchronous path for the others included), not by drafting's extra
    for 4 requests: a probe that costs what it cost at start-up leaves the scale at 1."""
    from tandem.engine.draft_gate import DraftGate, PlainFit, StepCosts

    # a probe at 8 requests cost 35 ms at start-up: 25 over a plain step, where D(4) - P(4) is 10
    costs = StepCosts((1, 4, 8), plain=(0.010, 0.010, 0.010), drafting=(0.020, 0.020, 0.050),
                      probe=(0.020, 0.020, 0.035), sample=4)
    g = DraftGate(costs, alpha=1.0, min_samples=1, min_plain=0, plain=PlainFit(unit=1e-4, alpha=1.0, prior=0.0))
    g.observe(8, 4, 0.035, accepted=12)  # as at start-up
    assert g.extra_scale == pytest.approx(1.0)
    g.observe(8, 4, 0.060, accepted=12)  # 50 ms over a plain step: twice the measured probe's
    assert g.extra_scale == pytest.approx(2.0) and g.predicted(8) == pytest.approx((0.010, 0.090))
    # without the curve (or for another sample size) the old estimate, D(k) - P(k)
    assert StepCosts((1, 4, 8), (0.01,) * 3, (0.02, 0.02, 0.05)).probe_extra_s(8, 4) == pytest.approx(0.010)
    assert costs.probe_extra_s(8, 2) == pytest.approx(0.010)


def test_the_draft_gate_keeps_both_step_kinds_current_whichever_runs():
    """A start-up measurement that was off must not decide the whole run. Plain steps teach
    t_plain once the drafters outside the sample are dormant (the off regime, as P(R) is
    measured), not the plain steps before that, which feed every drafter; plain steps faster than
    measured turn drafting off. While it is off, a probe's second step (steady) corrects
    drafting's extra: drafting cheaper than measured turns it back on."""
    from tandem.engine.draft_gate import DraftGate, PlainFit, StepCosts

    costs = StepCosts((1, 4, 8), plain=(0.010, 0.010, 0.010), drafting=(0.020, 0.030, 0.050))
    g = DraftGate(costs, alpha=1.0, min_samples=1, min_plain=0, probe_every=4, probe_budget=0.03, dormant_after=2,
                  plain=PlainFit(unit=1e-4, alpha=1.0, prior=0.0))
    g.observe(8, 8, 0.050, accepted=40)  # a = 5: 48 tokens in 50 ms against 8 in 10: on
    assert [g.plan(8) for _ in range(3)] == [8] * 3 and not g.dormant
    g.observe(8, 0, 0.004, accepted=0)  # a plain step between drafting ones: its drafters fed, it does not teach
    assert g.plain_scale == 1.0
    g.extra_scale = 3.0  # (drafting got dear: 6 x 10 < 10 + 3 x 40 ms)
    assert [g.plan(8) for _ in range(3)] == [0, 0, 0] and g.dormant  # dormant from the third (after 2 off)
    g.observe(8, 0, 0.004, accepted=0)  # now plain steps take 4 ms, not 10
    assert g.plain_scale == pytest.approx(0.4) and g.predicted(8) == pytest.approx((0.004, 0.124))
    assert g.plan(8) == 0
    g.extra_scale = 0.4  # (drafting got cheap: 6 x 4 >= 4 + 0.4 x 40 ms) every drafter restarts
    assert g.plan(8) == 8 and not g.dormant

    g = DraftGate(costs, alpha=1.0, min_samples=1, min_plain=0, probe_every=2, probe_budget=10.0)
    g.observe(8, 4, 0.030, accepted=12)  # a = 3: 32 tokens in 50 ms against 8 in 10: off
    assert [g.plan(8) for _ in range(4)] == [0, 0, 4, 4]  # a probe, two steps
    g.observe(8, 4, 0.030, accepted=12, steady=False)  # its first step (caught up)
    assert g.extra_scale == 1.0
    g.observe(8, 4, 0.020, accepted=12)  # its second: 4 requests' extra is 10 ms, not 20
    assert g.extra_scale == pytest.approx(0.5) and g.predicted(8) == pytest.approx((0.010, 0.030))
    assert g.plan(8) == 8  # 4 x 10 >= 30 ms: drafting pays


@pytest.mark.parametrize("selection", [True, False], ids=["with-row-selection", "gate-alone"])
def test_the_draft_gate_turns_drafting_off_where_it_does_not_pay_and_outputs_stay_exact(models, solo, selection,
                                                                                       monkeypatch):
    """A slow per-request drafter over 16 requests costs more than the tokens it adds (the
    engine measures that when it starts), so the gate keeps drafting off in most steps; every
    output still equals solo ar. The gate works with row selection (its default there) and on its
    own (draft_gate=True)."""
    prompts, refs = solo
    cfg = EngineConfig(method="tree", spec=TREE, block_size=8, max_num_batched_tokens=256, row_selection=selection,
                       row_cost=RowCost(tile=256), debug_check=True, draft_gate=None if selection else True,
                       batched_drafting=False, max_num_seqs=16)
    # a drafter that is slow (as a per-request draft is, next to a batched target pass)
    slow = Engine._proposal

    def proposal(self, req):
        time.sleep(0.02)
        return slow(self, req)

    monkeypatch.setattr(Engine, "_proposal", proposal)
    engine = Engine(*models, config=cfg)
    costs = engine.gate.costs
    assert costs.requests == (1, 4, 16) and costs.drafting_s(16) > 16 * 0.02 > costs.plain_s(16)
    # the probe curve: where the sample is every request (1, 4) a drafting step; at 16 the sample's 4
    # drafters' 80 ms over a plain step, far below every drafter's 320
    assert costs.probe[:2] == costs.drafting[:2] and costs.sample == engine.gate.sample == 4
    assert 4 * 0.02 < costs.probe_extra_s(16, 4) < costs.drafting_s(16) - costs.plain_s(16) - 8 * 0.02
    outs = run_all(engine, prompts[:16])
    assert [o.token_ids for o in outs] == refs[:16]
    assert_clean(engine)
    c = engine.counters
    assert c.gate_off_steps > c.steps / 2 and engine.gate.decisions_off == c.gate_off_steps
    # the tree is 4 deep (8 nodes, width 2): a drafting step drafts only where 5 accepted tokens a
    # request could repay it (learning and probes: the unit tests above)
    gate = engine.gate
    assert gate.ceiling == 4
    assert all(gate.could_pay(r.verified) for r in c.records if r.nodes > 0)


def test_draft_length_calibration_and_cut():
    """draft_length: rho is accepted over predicted (moving averages, clamped); `confident` keeps
    the nodes whose calibrated acceptance reaches the threshold, prefix-closed; `calibrated` moves
    every node's log-prob by log rho, capped at certainty."""
    from tandem.engine import draft_length as dl

    # root, a (0.9), a's child b (0.45), root's second child c (0.2), c's child d (0.02)
    tree = DraftTree(tokens=[1, 2, 3, 4, 5], parents=[-1, 0, 1, 0, 3],
                     logp=[0.0, math.log(0.9), math.log(0.45), math.log(0.2), math.log(0.02)])
    c = dl.Calibration(alpha=1.0)
    assert c.rho == 1.0
    c.observe(tree, 1)  # predicted 1.57, accepted 1
    assert abs(c.rho - 1 / 1.57) < 1e-9
    c.observe(tree, 0)
    assert c.rho == dl.RHO_MIN
    cut = dl.confident(tree, rho=1.0, min_prob=0.1)
    assert cut.tokens == [1, 2, 3, 4] and cut.parents == [-1, 0, 1, 0]
    cut = dl.confident(tree, rho=0.6, min_prob=0.1)  # 0.54, 0.27, 0.12, 0.012
    assert cut.tokens == [1, 2, 3, 4]
    cut = dl.confident(tree, rho=0.2, min_prob=0.1)  # 0.18, 0.09, 0.04, 0.004
    assert cut.tokens == [1, 2] and cut.parents == [-1, 0]
    up = dl.calibrated(tree, rho=2.0)
    assert up.logp[1] == 0.0 and abs(up.logp[2] - math.log(0.9)) < 1e-12 and up.logp[0] == 0.0


@pytest.mark.parametrize("selection", [False, True], ids=["cut", "with-row-selection"])
def test_adaptive_draft_length_calibrates_an_overconfident_draft_and_outputs_stay_exact(models, solo, selection,
                                                                                       monkeypatch):
    """A draft that believes its proposals far more than the target accepts them (a noisier,
    sharpened copy). Without row selection: verifying only the nodes its *calibrated* confidence
    puts at >= 0.3 verifies fewer nodes than the same threshold on its raw confidence (rho held at
    1), and fewer than no cut. With row selection the calibrated probabilities are ranked. Every
    output equals solo ar either way."""
    from tandem.engine import draft_length

    prompts, refs = solo
    target, _ = models
    poor = noisy_copy(target, 0.6, seed=5)
    with torch.no_grad():
        poor.lm_head.weight.mul_(4.0)
    nodes = {}
    for mode in ("off", "raw", "calibrated"):
        if mode == "raw":
            monkeypatch.setattr(draft_length.Calibration, "rho", property(lambda self: 1.0))
        else:
            monkeypatch.undo()
        cfg = EngineConfig(method="tree", spec=SpecConfig(nodes=16, width=4), block_size=8, max_num_batched_tokens=512,
                           row_selection=selection, row_cost=RowCost(tile=512), draft_gate=False,
                           adaptive_draft=mode != "off", min_node_prob=0.3, debug_check=True)
        engine = Engine(target, poor, config=cfg)
        outs = run_all(engine, prompts[:12])
        assert [o.token_ids for o in outs] == refs[:12]
        assert_clean(engine)
        c = engine.counters
        nodes[mode] = sum(r.nodes for r in c.records) / max(1, sum(r.verified for r in c.records))
    if not selection:
        assert nodes["calibrated"] < nodes["raw"] < nodes["off"], nodes


def test_row_selection_can_measure_its_cost_curve_on_the_engine(models, solo):
    """measure_row_cost times this engine's own prefill passes of 1, 8, 16, .. rows: the points
    grow with the rows and never fall; the throwaway requests leave no block, step or counter
    behind; row selection then runs on those points, and outputs equal solo ar."""
    prompts, refs = solo
    cfg = EngineConfig(method="tree", spec=TREE, block_size=8, max_num_batched_tokens=64, row_selection=True,
                       measure_row_cost=True, draft_gate=False, debug_check=True)
    engine = Engine(*models, config=cfg)
    pts = engine.row_cost.points
    assert [r for r, _ in pts] == [1, 8, 16, 32, 64]
    assert all(c > 0 for _, c in pts) and all(a[1] <= b[1] for a, b in zip(pts, pts[1:]))
    assert engine.steps == 0 and engine.counters.steps == 0 and not engine.requests
    assert engine.pool.check() == []
    outs = run_all(engine, prompts[:6])
    assert [o.token_ids for o in outs] == refs[:6]
    assert_clean(engine)
    given = RowCost(points=((1, 1.0), (64, 1.05), (128, 2.0)))
    assert given.flat_rows() == 64 and RowCost(tile=32).flat_rows() == 32
    assert Engine(*models, config=replace(cfg, row_cost=given)).row_cost is given  # given points are kept


def test_a_pool_too_small_for_the_gates_measurement_is_a_clear_error(models):
    """The gate measures steps of 16-token requests when the engine starts: a pool that cannot
    hold even one says so in one line, instead of failing somewhere inside a step."""
    cfg = EngineConfig(method="tree", spec=TREE, block_size=8, num_blocks=2, draft_gate=True)
    with pytest.raises(ConfigError, match="the draft gate cannot measure this engine's steps: request needs"):
        Engine(*models, config=cfg)


def test_measured_costs_are_one_polyline_extended_past_the_last_point():
    """RowCost's points and the gate's StepCosts read one polyline: linear between points, the
    first value before them; past the last, RowCost extends the last segment as it is and
    StepCosts never lets a cost fall (a noisy last point must not make more requests cheaper)."""
    from tandem.engine.draft_gate import StepCosts

    rc = RowCost(points=((1, 1.0), (64, 1.0), (128, 3.0)))
    assert rc(0) == 1.0 and rc(96) == 2.0 and rc(192) == 5.0
    assert RowCost(points=((1, 2.0), (3, 1.0)))(5) == 0.0  # (a falling last segment, extended as it is)
    sc = StepCosts((1, 4, 8), plain=(1.0, 2.0, 1.5), drafting=(2.0, 4.0, 8.0))
    assert sc.plain_s(2) == pytest.approx(4 / 3) and sc.plain_s(16) == 1.5  # flat, not falling
    assert sc.drafting_s(16) == 16.0 and sc.drafting_s(0) == 2.0
