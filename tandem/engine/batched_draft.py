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

Trees (BatchedTreeDrafter) grow as EAGLE-2's dynamic tree, as the single-request resident loop
grows a draft model's: after the catch-up pass the root's top-w children are level 1; at each
level the w best new nodes by cumulative log-prob are fed (w reserved rows per request, each
seeing the committed rows and its own ancestors' rows), and each gives its top-w children; the
N best nodes by cumulative log-prob form the tree. `depth - 1` batched passes after the catch-up.

Every request is drafted this way: a greedy chain takes argmaxes; a sampled chain draws each
token from the draft's processed distribution q with the request's generator and keeps q with
the tree (rejection sampling needs it); a tree's nodes are point masses, greedy or sampled, so
rejection sampling over them stays lossless. Feature drafters keep their own drafters. Node
log-probs are the draft's own, as the per-request drafters give them to row selection. A new
request's prompt is caught up in chunks of CATCH_UP_CHUNK rows (the passes' masks stay small).
"""
from __future__ import annotations

import torch

from tandem.config import SamplingConfig
from tandem.engine.batched_model import BatchedModel, Segment
from tandem.kernels.resident import topk_logprobs
from tandem.kv.paged import PagedKVPool
from tandem.tree.draft_tree import DraftTree
from tandem.verify.sampling import probs_from_logits

CATCH_UP_CHUNK = 128  # rows per request in one catch-up pass


class BatchedDrafter:
    """The draft model over a paged pool of its own: per request, the rows it has seen."""

    def __init__(self, draft, num_blocks: int, block_size: int, max_seqs: int | None = None,
                 max_seq_blocks: int | None = None, use_graphs: bool | str | None = None):
        """max_seqs, max_seq_blocks: requests per pass and block-table width at most (with both,
        the passes are CUDA graphs on a GPU: tandem.engine.batched_model)."""
        self.draft = draft
        self.pool = PagedKVPool.for_model(draft, num_blocks, block_size, prefix_caching=False)
        self.model = BatchedModel(draft, self.pool, max_seqs=max_seqs, max_seq_blocks=max_seq_blocks,
                                  use_graphs=use_graphs)
        # request id -> the root logits [V] of its last catch-up: a request drafted again before
        # the target verified (batch parallelism) has nothing new to feed
        self.root_logits: dict[str, torch.Tensor] = {}

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: its draft rows go (rebuilt on return)."""
        self.pool.free(request_id)
        self.root_logits.pop(request_id, None)

    def _forward(self, segs: list[Segment]) -> torch.Tensor:
        return self.model.forward(self.model.rows(segs))

    def _feed(self, reqs: list[tuple[str, list[int]]], logits: bool) -> torch.Tensor | None:
        """One causal pass over each request's tokens past what its pool holds, committed; with
        `logits`, the logits [len(reqs), V] of each one's last token."""
        segs = []
        for rid, toks in reqs:
            fed = self.pool.seqs[rid].length
            rows = toks[fed:]
            self.pool.reserve(rid, len(rows))
            segs.append(Segment.chunk(rows, fed, self.pool.seqs[rid].blocks, logits=logits))
        out = self._forward(segs)  # [sum rows, V] (empty without logits)
        for seg, (rid, _) in zip(segs, reqs):
            self.pool.commit(rid, list(range(len(seg.tokens))), seg.tokens)
        if not logits:
            return None
        ends = torch.tensor([len(seg.tokens) for seg in segs]).cumsum(0) - 1
        return out[ends.to(out.device)]

    def _catch_up(self, reqs: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Each request's tokens the draft has not seen (the root last) as one pass, committed;
        returns the roots' logits [len(reqs), V]."""
        for rid, _ in reqs:
            if rid not in self.pool.seqs:
                self.pool.allocate(rid, [], 0)
        while True:  # a long backlog (a new prompt) first, in chunks that end before the root
            early = [(rid, toks[:self.pool.seqs[rid].length + CATCH_UP_CHUNK]) for rid, toks in reqs
                     if len(toks) - self.pool.seqs[rid].length > CATCH_UP_CHUNK]
            if not early:
                break
            self._feed(early, logits=False)
        # then the rest, the root last (a request drafted again with nothing new keeps its logits)
        fresh = [(rid, toks) for rid, toks in reqs if len(toks) > self.pool.seqs[rid].length]
        if fresh:
            self.root_logits.update(zip((rid for rid, _ in fresh), self._feed(fresh, logits=True)))
        return torch.stack([self.root_logits[rid] for rid, _ in reqs])


class BatchedChainDrafter(BatchedDrafter):

    @torch.no_grad()
    def propose(self, chains: list[tuple[str, list[int], int]],
                sampled: dict[str, tuple[SamplingConfig, torch.Generator]] | None = None) -> dict[str, DraftTree]:
        """chains: (request id, every token so far (the root last), chain length k >= 0) ->
        request id -> the chain [root, d1 .. dk] with cumulative draft log-probs: greedy, or for
        the requests in `sampled` each token drawn from the draft's processed distribution q
        with the request's generator, q kept with the tree (row i: what node i was drawn from)."""
        sampled = sampled or {}
        out: dict[str, DraftTree] = {}
        live = [(rid, toks, k) for rid, toks, k in chains if k > 0]
        for rid, toks, k in chains:
            if k <= 0:
                out[rid] = DraftTree.chain([toks[-1]])
        if not live:
            return out
        drafted: dict[str, list[int]] = {rid: [] for rid, _, _ in live}
        logp: dict[str, list[float]] = {rid: [0.0] for rid, _, _ in live}
        qs: dict[str, list[torch.Tensor]] = {rid: [] for rid, _, _ in live if rid in sampled}
        # pass 1: catch up on the committed tokens, the root last
        self._take(live, self._catch_up([(rid, toks) for rid, toks, _ in live]), drafted, logp, sampled, qs)
        # passes 2 .. k: one reserved row per request still drafting
        for j in range(2, max(k for _, _, k in live) + 1):
            going = [(rid, toks, k) for rid, toks, k in live if k >= j]
            segs = []
            for rid, toks, _ in going:
                L = len(toks)
                self.pool.reserve(rid, 1)
                segs.append(Segment([drafted[rid][-1]], [L + j - 2], self.pool.seqs[rid].blocks, L + j - 1,
                                    logits=True))  # (causal: it sees every column up to its own)
            self._take(going, self._forward(segs), drafted, logp, sampled, qs)
        for rid, toks, _ in live:
            self.pool.commit(rid, [], [])  # drop the chain's rows: the target decides what stays
            q = None
            if rid in qs:
                q = torch.stack([torch.zeros_like(qs[rid][0])] + qs[rid])  # [k + 1, V]
            out[rid] = DraftTree(tokens=[toks[-1]] + drafted[rid], parents=list(range(-1, len(drafted[rid]))),
                                 logp=logp[rid], q=q)
        return out

    @staticmethod
    def _take(reqs, logits: torch.Tensor, drafted: dict[str, list[int]], logp: dict[str, list[float]],
              sampled: dict[str, tuple[SamplingConfig, torch.Generator]], qs: dict[str, list[torch.Tensor]]) -> None:
        """logits [len(reqs), V]: each request's next chain token (the argmax, or a draw from q)
        and its cumulative log-prob."""
        best, tok = topk_logprobs(logits, 1)  # [n, 1] each
        for i, ((rid, _, _), t, b) in enumerate(zip(reqs, tok[:, 0].tolist(), best[:, 0].tolist())):
            if rid in sampled:  # as the per-request ChainDrafter draws: q processed like the target's
                sampling, g = sampled[rid]
                q = probs_from_logits(logits[i][None], sampling)[0]  # [V]
                t = int(torch.multinomial(q.cpu(), 1, generator=g))
                b = float(torch.log(q[t].clamp_min(1e-30)))
                qs[rid].append(q)
            drafted[rid].append(t)
            logp[rid].append(logp[rid][-1] + b)


class BatchedTreeDrafter(BatchedDrafter):
    def __init__(self, draft, num_blocks: int, block_size: int, width: int, depth: int,
                 max_seqs: int | None = None, max_seq_blocks: int | None = None,
                 use_graphs: bool | str | None = None):
        super().__init__(draft, num_blocks, block_size, max_seqs, max_seq_blocks, use_graphs)
        self.w, self.depth = width, depth

    @torch.no_grad()
    def propose(self, trees: list[tuple[str, list[int], int]]) -> dict[str, DraftTree]:
        """trees: (request id, every token so far (the root last), node budget N >= 0) ->
        request id -> the N best nodes of its level tree (module docstring), prefix-closed."""
        out: dict[str, DraftTree] = {}
        live = [(rid, toks, n) for rid, toks, n in trees if n > 0]
        for rid, toks, n in trees:
            if n <= 0:
                out[rid] = DraftTree.chain([toks[-1]])
        if not live:
            return out
        w = self.w
        # per request: nodes as (token, parent node or -1, cumulative log-prob), and for each fed
        # node the reserved rows it sees (its ancestors' and its own)
        nodes: dict[str, list[tuple[int, int, float]]] = {rid: [] for rid, _, _ in live}
        lp, tok = topk_logprobs(self._catch_up([(rid, toks) for rid, toks, _ in live]), w)  # [R, w] each
        for (rid, _, _), ls, ts in zip(live, lp.tolist(), tok.tolist()):
            nodes[rid] = [(t, -1, l) for t, l in zip(ts, ls)]
        newest = {rid: list(range(w)) for rid, _, _ in live}  # the nodes of the last level
        rows: dict[str, dict[int, int]] = {rid: {} for rid, _, _ in live}  # fed node -> bitmask of the rows it sees
        for d in range(1, self.depth):
            segs, fed_of = [], []
            for rid, toks, _ in live:
                ns = nodes[rid]
                fed = sorted(newest[rid], key=lambda i: (-ns[i][2], i))[:w]  # the w best, ties to the earlier
                L, base = len(toks), (d - 1) * w
                self.pool.reserve(rid, len(fed))
                S = L + base + len(fed)
                bits = []  # each fed row sees the committed rows and, among the levels' rows, its own
                for s_, i in enumerate(fed):
                    par = ns[i][1]
                    rows[rid][i] = (rows[rid][par] if par >= 0 else 0) | 1 << (base + s_)
                    bits.append(rows[rid][i])
                segs.append(Segment([ns[i][0] for i in fed], [L - 1 + d] * len(fed), self.pool.seqs[rid].blocks, S,
                                    logits=True, prefix=L, bits=bits))
                fed_of.append(fed)
            lp, tok = topk_logprobs(self._forward(segs), w)  # [sum fed, w] each
            lp, tok, k = lp.tolist(), tok.tolist(), 0
            for (rid, _, _), fed in zip(live, fed_of):
                ns, first = nodes[rid], len(nodes[rid])
                for i in fed:
                    ns += [(t, i, ns[i][2] + l) for t, l in zip(tok[k], lp[k])]
                    k += 1
                newest[rid] = list(range(first, len(ns)))
        for rid, toks, n in live:
            self.pool.commit(rid, [], [])  # drop the levels' rows: the target decides what stays
            ns = nodes[rid]
            keep = sorted(sorted(range(len(ns)), key=lambda i: (-ns[i][2], i))[:n])  # parents come first
            index = {old: new + 1 for new, old in enumerate(keep)}
            out[rid] = DraftTree(tokens=[toks[-1]] + [ns[i][0] for i in keep],
                                 parents=[-1] + [index[ns[i][1]] if ns[i][1] >= 0 else 0 for i in keep],
                                 logp=[0.0] + [ns[i][2] for i in keep])
        return out
