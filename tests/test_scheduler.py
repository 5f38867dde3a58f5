"""Scheduler unit cases: FIFO admission, chunked prefill under the token budget mixed with
decode, the sequence limit, preemption when blocks run out, and aborts.

The engine's part (run the pass, commit, emit) is played by `commit_plan`: a prefill chunk
commits all its rows; a verify pass commits its root and emits one token (as `ar` does).
"""
from __future__ import annotations

import pytest
import torch

from tandem.config import ConfigError
from tandem.engine.config import EngineConfig
from tandem.engine.request import Request, RequestState, SamplingParams
from tandem.engine.scheduler import Scheduler, StepPlan
from tandem.kv.paged import PagedKVPool


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, rows=1) -> Scheduler:
    cfg = EngineConfig(method="ar", block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_seqs,
                       max_num_batched_tokens=budget)
    pool = PagedKVPool(1, 1, 2, num_blocks, block_size, torch.float32, "cpu")
    return Scheduler(cfg, pool, row_budget=lambda req: rows)


def req(n: int, rid: str, first: int = 1) -> Request:
    return Request(list(range(first, first + n)), SamplingParams(max_tokens=8), request_id=rid)


def commit_plan(s: Scheduler, plan: StepPlan) -> None:
    for item in plan.scheduled:
        r = item.request
        if item.kind == "prefill":
            s.pool.commit(r.request_id, list(range(item.rows)), r.token_ids()[item.start:item.start + item.rows])
            r.num_computed += item.rows
        else:
            s.pool.commit(r.request_id, [0], [r.token_ids()[-1]])
            r.num_computed += 1
            r.output_ids.append(7)


def summary(plan: StepPlan) -> list[tuple[str, str, int, int]]:
    return [(i.request.request_id, i.kind, i.start, i.rows) for i in plan.scheduled]


def test_chunked_prefill_mixes_with_decode_under_the_budget():
    s = make(budget=16)
    for r in (req(5, "a"), req(30, "b"), req(3, "c")):
        s.add(r)
    p1 = s.plan_step()  # a: its 4 prefill rows; b: the 12 the budget has left; c waits (FIFO)
    assert summary(p1) == [("a", "prefill", 0, 4), ("b", "prefill", 0, 12)]
    assert [r.request_id for r in s.waiting] == ["c"] and p1.num_rows == 16
    commit_plan(s, p1)
    p2 = s.plan_step()  # a decodes (1 row) first, b's next chunk takes the remaining 15 rows
    assert summary(p2) == [("a", "decode", 4, 1), ("b", "prefill", 12, 15)]
    commit_plan(s, p2)
    p3 = s.plan_step()  # b's last 2 prompt rows; c is admitted with its 2
    assert summary(p3) == [("a", "decode", 5, 1), ("b", "prefill", 27, 2), ("c", "prefill", 0, 2)]
    assert p3.admitted == [s.running[2]] and s.running[2].state is RequestState.RUNNING
    commit_plan(s, p3)
    assert [i.kind for i in s.plan_step().scheduled] == ["decode"] * 3
    assert s.pool.check() == []


def test_long_prefill_token_threshold_spreads_a_long_prompt_over_steps():
    """vLLM's long_prefill_token_threshold: a prompt's chunk per step is at most that many
    tokens, so a decoding request's steps stay short while a long prompt arrives."""
    cfg = EngineConfig(method="ar", block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=16,
                       long_prefill_token_threshold=5)
    s = Scheduler(cfg, PagedKVPool(1, 1, 2, 64, 4, torch.float32, "cpu"), row_budget=lambda req: 1)
    s.add(req(3, "a"))
    commit_plan(s, s.plan_step())  # a's 2 prompt rows (within the threshold)
    s.add(req(13, "b"))
    chunks = []
    while s.running[-1].in_prefill or len(s.running) < 2:
        plan = s.plan_step()
        assert plan.scheduled[0][:2] == (s.running[0], "decode")  # a decodes in every step
        chunks += [i.rows for i in plan.prefills]
        commit_plan(s, plan)
    assert chunks == [5, 5, 2]  # b's 12 prompt rows before its first decode, 5 at most a step
    assert s.pool.check() == []
    with pytest.raises(ConfigError, match="long_prefill_token_threshold must be >= 0"):
        EngineConfig(long_prefill_token_threshold=-1).validate()


def test_a_one_token_prompt_decodes_at_once_and_row_budgets_shrink_to_the_budget():
    s = make(budget=5, rows=4)
    s.add(req(1, "a"))
    s.add(req(1, "b"))
    assert summary(s.plan_step()) == [("a", "decode", 0, 4), ("b", "decode", 0, 1)]


def test_max_num_seqs_holds_requests_back_in_order():
    s = make(max_seqs=2)
    for rid in "abc":
        s.add(req(2, rid))
    plan = s.plan_step()
    assert [r.request_id for r in plan.admitted] == ["a", "b"] and [r.request_id for r in s.waiting] == ["c"]


def test_head_of_line_request_waits_for_blocks_and_keeps_fifo():
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add(req(13, "big"))  # 12 prefill rows: 3 blocks
    s.add(req(9, "next"))  # 8 rows: 2 blocks -- does not fit after "big"
    s.add(req(2, "small"))  # would fit, but FIFO keeps it behind "next"
    plan = s.plan_step()
    assert summary(plan) == [("big", "prefill", 0, 12)]
    assert [r.request_id for r in s.waiting] == ["next", "small"]
    assert s.pool.check() == [] and s.pool.num_free == 1


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    s = make(num_blocks=3, block_size=2, budget=64)
    a, b = req(3, "a"), req(3, "b", first=10)
    s.add(a)
    s.add(b)
    commit_plan(s, s.plan_step())  # each commits 2 prompt rows (1 block each); 1 block free
    plan = s.plan_step()  # a's root takes the free block; b's root finds none: b (the newest) goes
    assert plan.preempted == [b] and b.state is RequestState.WAITING and b.num_computed == 0
    assert list(s.waiting) == [b] and b.figures.preemptions == 1 and b.request_id not in s.pool.seqs
    assert summary(plan) == [("a", "decode", 2, 1)] and s.pool.check() == []
    commit_plan(s, plan)
    plan = s.plan_step()  # a fits in its block; b is tried again but there is no block for its root
    assert summary(plan) == [("a", "decode", 3, 1)] and list(s.waiting) == [b] and s.pool.check() == []
    commit_plan(s, plan)
    s.finish(a)  # a is done: b comes back, its prompt block found in the prefix cache
    plan = s.plan_step()
    assert summary(plan) == [("b", "decode", 2, 1)] and b.figures.cached_tokens == 2
    assert s.pool.stats.hits >= 1 and s.pool.check() == []


def test_the_only_running_request_preempts_itself_when_nothing_else_can_go():
    s = make(num_blocks=2, block_size=2, budget=64, rows=3)
    a = req(4, "a")  # 3 prefill rows (2 blocks), then 3-row verify passes
    s.add(a)
    commit_plan(s, s.plan_step())
    plan = s.plan_step()  # 3 committed + 3 rows = 3 blocks > 2: a preempts itself
    assert plan.preempted == [a] and not plan.scheduled and s.pool.check() == []


def test_finish_and_abort_release_blocks_in_any_state():
    s = make(num_blocks=8, block_size=2, budget=4)
    for rid in "abc":
        s.add(req(6, rid))
    commit_plan(s, s.plan_step())  # a mid-prefill, b and c waiting
    a, b, c = s.running[0], s.waiting[0], s.waiting[1]
    s.finish(b, RequestState.ABORTED)  # waiting
    assert b.state is RequestState.ABORTED and list(s.waiting) == [c]
    s.finish(a, RequestState.ABORTED)  # running, mid-prefill
    assert s.running == [] and s.pool.num_free == 8 and s.pool.check() == []
    commit_plan(s, s.plan_step())
    s.finish(c)
    assert not s.has_unfinished() and s.pool.num_free == 8 and s.pool.check() == []
