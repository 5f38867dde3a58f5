"""KV capacity of one request, computed once: how many cache rows the target and the draft need.

Every loop sizes its caches from one `RequestPlan` (the serial loop, the hybrid loop, `async`
and its worker pools, the batched engine's per-request draft caches), so the rules live here:

- the target holds the prompt, the new tokens and one verify's tree beyond the last commit
  (the method's `slack`), plus the row the next root is written to;
- a draft model holds the target's rows plus a tree: its nodes and chain tokens beyond the
  commit and the evolving tree's region (`tree_rows`: the fed nodes it may keep).

NOTE: the serial loop's and the hybrid loop's slacks differ for `tree` (the hybrid target's
verify needs no room for an extra expansion round) and `async` keeps a bigger tree region
(the draft grows its tree while the target verifies); these are the numbers each loop used
before they were gathered here.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.config import SpecConfig
from tandem.drafting.tree_drafter import tree_rows as serial_tree_rows


@dataclass(frozen=True)
class RequestPlan:
    """Cache rows for one request (a runner adds one more row of its own)."""

    target_rows: int  # the target's KV cache (serial loops and async)
    draft_rows: int  # a draft model's KV cache, its tree region included
    tree_rows: int  # the evolving tree's region: fed nodes kept across passes


def plan_request(method: str, prompt_len: int, max_new: int, spec: SpecConfig, hybrid: bool = False) -> RequestPlan:
    """The plan of a request of `prompt_len` prompt tokens and up to `max_new` new ones.

    `method`: ar | chain | tree (the serial loop, or the hybrid loop with `hybrid`), async, or
    engine (the batched engine: its target lives in the paged pool, so only the draft's rows count)."""
    if method == "async":
        tree = max(2 * spec.nodes, spec.nodes + 16 * spec.width) + spec.width
        target = prompt_len + max_new + spec.nodes + 2
        return RequestPlan(target, target + tree + 1, tree)
    if hybrid:
        slack = {"ar": 1, "chain": spec.k + 1, "tree": spec.nodes + 1}[method]
    else:
        slack = {"ar": 1, "chain": spec.k + 1, "tree": spec.nodes + 1 + spec.width * (spec.resolved_depth() + 1),
                 "engine": 1}[method]  # engine: target_rows unused (paged); the draft's tree is in draft_rows
    target = prompt_len + max_new + slack + 1
    tree = serial_tree_rows(spec)
    return RequestPlan(target, target + spec.nodes + spec.k + tree, tree)
