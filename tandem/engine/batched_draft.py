"""Batched drafting: one draft pass per chain position for all decoding requests together.

Drafting one request at a time costs a small forward per request and round: at batch 32 the
drafts outweigh the target pass they feed (measured: `tree` at 0.10x of `ar` at concurrency
32, engine_concurrency in bench/results/h200-2026-12-01-resident/). Here the small draft model
runs over a paged KV pool of its own with the target's `BatchedModel`, so a greedy chain of k
tokens for R requests costs k batched passes:

    pass 1:  each request's rows the draft has not seen yet (the tokens committed since its
             last chain, the root last), committed to the draft pool -> d1 = argmax at the root
    pass j:  each request's d_(j-1) as one reserved row -> d_j                 (j = 2 .. k)
    end:     the reserved rows are dropped; the next chain re-feeds what the target accepted

Only greedy chains of a plain draft model are drafted this way (the engine keeps per-request
drafters for trees, sampling and feature drafters). A chain's node log-probs are the draft's
own, as the per-request drafters give them to row selection.
"""
from __future__ import annotations

import torch

from tandem.engine.batched_model import BatchedModel, BatchRows, Segment
from tandem.kv.paged import PagedKVPool
from tandem.tree.draft_tree import DraftTree


class BatchedChainDrafter:
    def __init__(self, draft, num_blocks: int, block_size: int):
        self.draft = draft
        self.pool = PagedKVPool.for_model(draft, num_blocks, block_size, prefix_caching=False)
        self.model = BatchedModel(draft, self.pool)

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: its draft rows go (rebuilt on return)."""
        self.pool.free(request_id)

    @torch.no_grad()
    def propose(self, chains: list[tuple[str, list[int], int]]) -> dict[str, DraftTree]:
        """chains: (request id, every token so far (the root last), chain length k >= 0) ->
        request id -> the greedy chain [root, d1 .. dk] with cumulative draft log-probs."""
        out: dict[str, DraftTree] = {}
        live = [(rid, toks, k) for rid, toks, k in chains if k > 0]
        for rid, toks, k in chains:
            if k <= 0:
                out[rid] = DraftTree.chain([toks[-1]])
        if not live:
            return out
        drafted: dict[str, list[int]] = {rid: [] for rid, _, _ in live}
        logp: dict[str, list[float]] = {rid: [0.0] for rid, _, _ in live}
        # pass 1: catch up on the committed tokens, the root last
        segs, new = [], {}
        for rid, toks, _ in live:
            if rid not in self.pool.seqs:
                self.pool.allocate(rid, [], 0)
            fed = self.pool.seqs[rid].length
            rows = toks[fed:]
            self.pool.reserve(rid, len(rows))
            new[rid] = rows
            segs.append(Segment(rows, list(range(fed, len(toks))), self.pool.slots(rid, 0, len(toks)),
                                torch.ones(len(rows), len(rows), dtype=torch.bool).tril(), logits=True))
        logits = self.model.forward(BatchRows.build(segs, self.draft.device, self.draft.dtype))  # [sum rows, V]
        ends = torch.tensor([len(s.tokens) for s in segs]).cumsum(0) - 1
        self._take(live, logits[ends.to(logits.device)], drafted, logp)
        for rid, toks, _ in live:
            self.pool.commit(rid, list(range(len(new[rid]))), new[rid])
        # passes 2 .. k: one reserved row per request still drafting
        for j in range(2, max(k for _, _, k in live) + 1):
            going = [(rid, toks, k) for rid, toks, k in live if k >= j]
            segs = []
            for rid, toks, _ in going:
                L = len(toks)
                self.pool.reserve(rid, 1)
                segs.append(Segment([drafted[rid][-1]], [L + j - 2], self.pool.slots(rid, 0, L + j - 1),
                                    torch.ones(1, 1, dtype=torch.bool), logits=True))
            self._take(going, self.model.forward(BatchRows.build(segs, self.draft.device, self.draft.dtype)),
                       drafted, logp)
        for rid, toks, _ in live:
            self.pool.commit(rid, [], [])  # drop the chain's rows: the target decides what stays
            out[rid] = DraftTree(tokens=[toks[-1]] + drafted[rid], parents=list(range(-1, len(drafted[rid]))),
                                 logp=logp[rid])
        return out

    @staticmethod
    def _take(reqs, logits: torch.Tensor, drafted: dict[str, list[int]], logp: dict[str, list[float]]) -> None:
        """logits [len(reqs), V]: each request's next chain token (argmax) and its log-prob."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        best, tok = lp.max(-1)
        for (rid, _, _), t, b in zip(reqs, tok.tolist(), best.tolist()):
            drafted[rid].append(t)
            logp[rid].append(logp[rid][-1] + b)
