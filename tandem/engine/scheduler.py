"""The scheduler: waiting and running queues -> one `StepPlan` per engine step.

Per step, under a token budget (rows of one target pass):

1. running requests, oldest first: a decoding request gets its row budget (root + draft
   tokens; shrunk to what the budget has left, at least the root), a prefilling one its next
   chunk. Rows are reserved in the KV pool now; when the pool runs dry the newest running
   request is preempted (its blocks freed; it goes back to the front of the waiting queue and
   recomputes prompt + output when it returns) until the reservation fits.
2. if nothing was preempted, waiting requests in FIFO order are admitted (prefix-cache
   lookup, then a first chunk) while budget, sequence slots and blocks allow. A request that
   does not fit blocks the ones behind it (strict FIFO).

A prompt's chunk per step is also at most `long_prefill_token_threshold` tokens when set (as in
vLLM), so that a long prompt arriving at a busy engine spreads over several steps instead of
stretching one step for every decoding request.

Hooks: `row_budget` decides a decoding request's rows (row selection gives some zero draft
tokens); `plan_step(verify=...)` schedules only the decoding requests it accepts, so batch
parallelism reserves verify rows for the verified batch alone (the drafted batch keeps just its
committed blocks); `admit_limit` caps the step's rows up to which new prompts are admitted
(prompt admission: prompts ride in a verify step only inside the flat region of its cost).
`StepPlan.batch_id` names the batch a plan verifies.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from tandem.engine.config import EngineConfig
from tandem.engine.request import Request, RequestState
from tandem.kv.paged import PagedKVPool


class ScheduledRows(NamedTuple):
    """One request's share of a pass: `rows` new rows after its `start` committed rows. (A
    NamedTuple: a step makes one per running request, and a frozen dataclass costs ~3x to build.)"""

    request: Request
    kind: str  # "prefill" (a chunk of prompt + output) | "decode" (a verify pass: root + draft tokens)
    start: int  # committed rows before the new ones
    rows: int  # prefill: chunk tokens; decode: the row budget (root included, so >= 1)


@dataclass
class StepPlan:
    batch_id: int = 0
    scheduled: list[ScheduledRows] = field(default_factory=list)  # running order
    admitted: list[Request] = field(default_factory=list)  # moved WAITING -> RUNNING by this plan
    preempted: list[Request] = field(default_factory=list)  # moved RUNNING -> WAITING by this plan

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.scheduled)

    @property
    def prefills(self) -> list[ScheduledRows]:
        return [s for s in self.scheduled if s.kind == "prefill"]

    @property
    def prefill_rows(self) -> int:
        """The prompt rows the step runs beside its decodes."""
        return sum([s.rows for s in self.scheduled if s.kind == "prefill"])

    @property
    def decodes(self) -> list[ScheduledRows]:
        return [s for s in self.scheduled if s.kind == "decode"]

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagedKVPool, row_budget: Callable[[Request], int] | None = None):
        self.config, self.pool = config, pool
        self.row_budget = row_budget or (lambda req: config.draft_rows())
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.state = RequestState.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def plan_step(self, verify: Callable[[Request], bool] | None = None, admit_limit: int | None = None,
                  batch_id: int = 0) -> StepPlan:
        """`verify`: which decoding requests get a verify pass (default: all); `admit_limit`: in a
        step that verifies, no new prompt is admitted past this many rows (default: the budget)."""
        plan = StepPlan(batch_id=batch_id)
        budget = self.config.max_num_batched_tokens
        running, scheduled, try_reserve = self.running, plan.scheduled, self.pool.try_reserve
        row_budget = self.row_budget
        i = 0
        # (a loop over every running request, every step: kept lean; a decode's rows and its
        # prefill test inlined, as at 64 requests each call here cost the step ~5 us)
        while i < len(running) and budget > 0:
            req = running[i]
            todo = len(req.prompt_ids) + len(req.output_ids) - 1 - req.num_computed  # (prefill_target: in_prefill)
            if todo > 0:
                kind, rows = self._want(req, budget, todo)
            elif verify is not None and not verify(req):
                i += 1  # drafted, not verified, this step: no rows reserved
                continue
            else:
                kind, rows = "decode", row_budget(req)
                if not 1 <= rows <= budget:
                    rows = max(1, min(rows, budget))
            while not try_reserve(req.request_id, rows):
                victim = running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRows(req, kind, req.num_computed, rows))
                budget -= rows
                i += 1
        if plan.preempted:
            return plan
        if admit_limit is not None and plan.decodes:
            budget = min(budget, admit_limit - plan.num_rows)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            tokens = req.token_ids()
            cached = self.pool.allocate(req.request_id, tokens, max_cached=req.prefill_target)
            req.num_computed = req.figures.cached_tokens = cached
            kind, rows = self._want(req, budget)
            if not self.pool.try_reserve(req.request_id, rows):
                self.pool.free(req.request_id)  # head-of-line: wait for blocks (FIFO)
                req.num_computed = 0
                break
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            self.running.append(req)
            plan.admitted.append(req)
            plan.scheduled.append(ScheduledRows(req, kind, req.num_computed, rows))
            budget -= rows
        return plan

    def grow(self, plan: StepPlan, index: int, extra: int) -> int:
        """Add up to `extra` rows to the plan's decode entry `index` (row selection reserves the
        roots first and the chosen draft nodes after): as many as the token budget and the free
        blocks allow, never preempting. Returns the rows added."""
        item = plan.scheduled[index]
        assert item.kind == "decode", item
        extra = min(extra, self.config.max_num_batched_tokens - plan.num_rows)
        while extra > 0 and not self.pool.can_reserve(item.request.request_id, extra):
            extra -= 1
        if extra <= 0:
            return 0
        self.pool.reserve(item.request.request_id, extra)
        plan.scheduled[index] = ScheduledRows(item.request, item.kind, item.start, item.rows + extra)
        return extra

    def _want(self, req: Request, budget: int, todo: int | None = None) -> tuple[str, int]:
        """todo: its prefill rows still to compute, if the caller has them (prefill_target - num_computed)."""
        if todo is None:
            todo = req.prefill_target - req.num_computed
        if todo > 0:  # (in_prefill)
            cap = self.config.long_prefill_token_threshold
            return "prefill", min(todo, budget, cap) if cap > 0 else min(todo, budget)
        rows = self.row_budget(req)
        return "decode", rows if 1 <= rows <= budget else max(1, min(rows, budget))

    def _preempt(self, req: Request) -> None:
        """Recompute later: free its blocks and put it back at the front of the waiting queue."""
        self.running.remove(req)
        self.pool.free(req.request_id)
        req.num_computed = 0
        req.state = RequestState.WAITING
        req.figures.preemptions += 1
        self.waiting.appendleft(req)

    # ---- after a step, and aborts ----------------------------------------------------------
    def finish(self, req: Request, state: RequestState = RequestState.FINISHED) -> None:
        """Leave the queues (finished or aborted) and give the blocks back; any state, any time."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.request_id)
        req.state = state
