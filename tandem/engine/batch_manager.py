"""Batch parallelism (MineDraft): two sub-batches of decoding requests that swap roles.

Each step the target verifies one batch (the *verify batch*) while the drafter drafts the other
(`skip_batch`: it skips verification this step); at the step boundary the roles swap, so a tree
drafted in step t is verified in step t + 1, from the same committed state (the request was not
verified in between), and outputs stay exactly those of plain speculative decoding.

Differences from the paper (MineDraft s5.1, its limitations in sA):

- The *load* of a request is its KV rows plus one verify pass's rows (`load()`), not 1: a batch
  of long contexts costs more attention than one of short ones, so balancing by count alone
  leaves the step times of the two batches apart.
- `assign()` never switches off. A request joins `skip_batch` (drafted first, so its first
  verification already has a tree) unless that pushes the imbalance past `threshold`; then it
  joins the lighter batch (its first tree is drafted at verification time, serially).
- `rebalance()` runs at every step boundary: while the imbalance passes `threshold`, a request
  moves from the heavier batch to the lighter one if that strictly lowers the imbalance. Aborts,
  preemptions and bursts of arrivals therefore cannot freeze an imbalance (the paper's
  "irrecoverable" case); a request that moves pays at most one step without overlap.
- `recycle()` forgets a request on finish, abort and preemption (it is assigned again when it
  decodes again).
- When one batch holds no decoding request the step verifies the other one alone, drafting
  serially (the tail effect); `tail_fallbacks` counts those steps.

The manager knows requests by id and their loads through a callback; it holds no KV itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from tandem.engine.request import Request


@dataclass
class BatchCounters:
    assigned: int = 0  # assign() calls
    rebalances: int = 0  # requests moved between batches at a step boundary
    tail_fallbacks: int = 0  # decoding steps with one batch empty (no overlap possible)
    overlapped_steps: int = 0  # decoding steps with both batches non-empty


class BatchManager:
    """Two batch ids, 0 and 1. `skip_batch` is drafted this step; `1 - skip_batch` is verified."""

    def __init__(self, load: Callable[[Request], int], threshold: float = 0.25):
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"rebalance threshold must be in [0, 1) (got {threshold})")
        self.load, self.threshold = load, threshold
        self.skip_batch = 1  # as in the paper: batch 0 is verified first
        self.batch_of: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.counters = BatchCounters()

    # ---- membership ------------------------------------------------------------------------
    @property
    def verify_batch(self) -> int:
        return 1 - self.skip_batch

    def members(self, batch: int) -> list[Request]:
        return [self.requests[rid] for rid, b in self.batch_of.items() if b == batch]

    def loads(self) -> tuple[int, int]:
        out = [0, 0]
        for rid, b in self.batch_of.items():
            out[b] += self.load(self.requests[rid])
        return out[0], out[1]

    def imbalance(self) -> float:
        """|load 0 - load 1| / (load 0 + load 1); 0.0 when both are empty."""
        a, b = self.loads()
        return abs(a - b) / (a + b) if a + b else 0.0

    def assign(self, req: Request) -> int:
        """Put a request that starts decoding into a batch; returns the batch id."""
        assert req.request_id not in self.batch_of, f"{req.request_id} is assigned already"
        loads = list(self.loads())
        l, s = self.load(req), self.skip_batch
        after = loads.copy()
        after[s] += l
        if abs(after[0] - after[1]) <= self.threshold * (after[0] + after[1]):
            batch = s
        else:  # the lighter batch; on a tie the one drafted next
            batch = s if loads[s] <= loads[1 - s] else 1 - s
        self.batch_of[req.request_id] = batch
        self.requests[req.request_id] = req
        self.counters.assigned += 1
        return batch

    def recycle(self, req: Request) -> None:
        """Forget a request (finished, aborted or preempted); unknown ids are ignored."""
        self.batch_of.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)

    # ---- step boundary ---------------------------------------------------------------------
    def rebalance(self) -> list[tuple[Request, int]]:
        """Move requests from the heavier to the lighter batch while the imbalance passes the
        threshold and a move strictly lowers it. Returns the moves (request, new batch)."""
        moves: list[tuple[Request, int]] = []
        for _ in range(len(self.batch_of)):
            loads = self.loads()
            diff = loads[0] - loads[1]
            if abs(diff) <= self.threshold * (loads[0] + loads[1]):
                break
            heavy = 0 if diff > 0 else 1
            # the move that leaves the smallest |diff|: a load closest to diff / 2; it must be
            # below |diff| so that the imbalance strictly shrinks (no ping-pong)
            best = min(self.members(heavy), key=lambda r: (abs(abs(diff) - 2 * self.load(r)), r.request_id),
                       default=None)
            if best is None or self.load(best) >= abs(diff) or self.load(best) == 0:
                break
            self.batch_of[best.request_id] = 1 - heavy
            moves.append((best, 1 - heavy))
        self.counters.rebalances += len(moves)
        return moves

    def roles(self, decoding: Iterable[Request]) -> tuple[int, bool, bool]:
        """This step's verify batch, whether the step overlaps drafting with verification, and
        whether it is a tail fallback.

        `decoding`: the requests that decode this step (assigned). When the verify batch has
        none, the roles swap first; when either batch is then empty the step is a tail fallback
        (plain batched speculative decoding: the verified requests draft serially)."""
        has = [False, False]
        for r in decoding:
            has[self.batch_of[r.request_id]] = True
        if not has[self.verify_batch] and has[self.skip_batch]:
            self.skip_batch = 1 - self.skip_batch
        overlapped = has[0] and has[1]
        fallback = any(has) and not overlapped
        self.counters.overlapped_steps += overlapped
        self.counters.tail_fallbacks += fallback
        return self.verify_batch, overlapped, fallback

    def swap(self) -> None:
        """End of a step: the verified batch is drafted next."""
        self.skip_batch = 1 - self.skip_batch
