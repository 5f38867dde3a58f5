"""Batched drafting with feature drafters: every decoding request's draft from an EAGLE-3 head or
a parallel block drafter, in shared passes over the drafter's own paged pool.

Both read the target's features. Per request a drafter keeps the committed tokens it has not run
yet, with the features those rows read (`start` for a prompt, `observe_many` after each verify
pass for every request at once, drafting or not), and runs them in its next pass; its passes are captured per row bucket
(BatchedModel.run_rows), the features (or the head's hidden inputs) in a static buffer.

- BatchedEagleDrafter: EAGLE-2's level tree (tandem.engine.batched_draft.BatchedTreeDrafter,
  captured whole on a GPU), each fed node reading its parent's output hidden.
- BatchedBlockDrafter: one pass of every request's context rows and B - 1 mask rows, one
  lattice per request, each request's best-first tree over it.
"""
from __future__ import annotations

import torch

from tandem.engine import batched_draft
from tandem.engine.batched_draft import BatchedTreeDrafter, split_drafted
from tandem.engine.batched_model import BatchedModel, BatchRows, Segment
from tandem.kernels.fused import add_rmsnorm, embed_norms
from tandem.kv.paged import PagedKVPool
from tandem.tree.draft_tree import DraftTree


class PendingRows:
    """A request's committed rows its feature drafter has not run yet: the tokens and each row's
    input (features, or the head's projected hidden), kept as (tensor, first row, end row) spans
    of the steps' shared tensors, so that feeding a step's rows costs neither a kernel nor a view
    per request (fed with kernels of their own, a step that did not draft took 7.6 ms against
    `ar`'s 1.45 ms at 64 requests on the H200, 2026-12-02); a pass takes its first n rows' spans."""

    __slots__ = ("tokens", "spans")

    def __init__(self, tokens: list[int], rows: torch.Tensor):
        self.tokens = list(tokens)
        self.spans: list[tuple[torch.Tensor, int, int]] = [(rows, 0, rows.shape[0])] if rows.shape[0] else []

    def append(self, tokens: list[int], rows: torch.Tensor, lo: int) -> None:
        """tokens' rows are rows[lo:lo + len(tokens)]."""
        self.tokens += tokens
        self.spans.append((rows, lo, lo + len(tokens)))

    def take(self, n: int) -> tuple[list[int], list[tuple[torch.Tensor, int, int]]]:
        """The first n tokens and their rows' spans (tensor, first row, end row), removed from here."""
        toks, self.tokens = self.tokens[:n], self.tokens[n:]
        n = len(toks)
        spans: list[tuple[torch.Tensor, int, int]] = []
        while n > 0:
            t, lo, hi = self.spans[0]
            if hi - lo <= n:
                spans.append((t, lo, hi))
                self.spans.pop(0)
                n -= hi - lo
            else:
                spans.append((t, lo, lo + n))
                self.spans[0] = (t, lo + n, hi)
                n = 0
        return toks, spans

    def rows(self) -> torch.Tensor:
        """Every pending row's input [len(tokens), F] (a copy; for inspection)."""
        return torch.cat([t[lo:hi] for t, lo, hi in self.spans])


def span_views(spans: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
    """Views of the spans' rows in order, adjacent spans of one tensor as one view: the requests'
    rows fed by one observe_many are usually one stretch of its tensor, so a step's context pass
    reads them with one copy and no view per request."""
    out: list[tuple[torch.Tensor, int, int]] = []
    for t, lo, hi in spans:
        if lo == hi:
            continue
        if out and out[-1][0] is t and out[-1][2] == lo:
            out[-1] = (t, out[-1][1], hi)
        else:
            out.append((t, lo, hi))
    return [t[lo:hi] for t, lo, hi in out]


def feed(pending: dict[str, PendingRows], items: list[tuple[str, list[int]]], rows: torch.Tensor) -> None:
    """rows [sum of len(tokens), F]: the items' rows in order; each request's join its pending ones."""
    at = 0
    for rid, tokens in items:
        pending[rid].append(tokens, rows, at)
        at += len(tokens)


class BatchedHead(BatchedModel):
    """An EAGLE-3 head (tandem.models.eagle3) over a paged pool of its own: its one layer reads
    cat(input_layernorm(embed(token)), hidden_norm(h)) per row, h given with the rows. Its
    context pass is captured per row bucket (`context`); the level passes inside the tree's graph."""

    rows = BatchedModel.exact_rows  # (its passes are not the target's: no `_body` to capture per bucket)

    def context(self, segments: list[Segment], hidden: "torch.Tensor | list[torch.Tensor]", last: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass over the segments' rows with their hidden inputs [M, H] (or its chunks in row
        order) -> rows `last`'s logits [len(last), draft_vocab] and output hidden [len(last), H]."""
        return self.run_rows(segments, hidden, self.run, picked=last)

    @torch.no_grad()
    def run(self, rows: BatchRows, hidden: torch.Tensor, logit_rows: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [M, H] each row's hidden input -> (logits [n, draft_vocab] of `logit_rows`
        (default: every row), out [M, H] every row's pre-norm output hidden)."""
        head = self.model
        m = head.midlayer
        hidden = hidden.to(head.dtype)  # [M, H]
        ln, hln, pln = m.input_layernorm, m.hidden_norm, m.post_attention_layernorm
        assert ln.eps == hln.eps
        x, hn = embed_norms(rows.tokens[:rows.num_rows], head.embed_weight(), hidden, ln.weight, hln.weight, ln.eps)
        a = self._attention(m.self_attn, 0, x[None], rows)  # [1, M, H]
        # the residual and the next norm in one kernel each (a + b == b + a: the same sums)
        r, h = add_rmsnorm(a, (hn if head.econfig.norm_before_residual else hidden)[None], pln.weight, pln.eps)
        out, normed = add_rmsnorm(m.mlp(h), r, head.norm.weight, head.norm.eps)  # [1, M, H] each
        out, normed = out[0], normed[0]
        return head.lm_head(normed if logit_rows is None else normed[logit_rows]), out


class BatchedEagleDrafter(BatchedTreeDrafter):
    """EAGLE-2's level tree from an EAGLE-3 head for every request at once (the per-request
    EagleDrafter's tree, batched). Per request the head keeps the committed tokens it has not
    run yet, each with its hidden input fc(target features of the position before it): `start`
    gives the prompt's, `observe_many` each verify pass's (the root and the accepted nodes). A step
    runs them all as one context pass (their rows join the head's pool), then the levels on the
    device: a fed node reads its parent's output hidden (the root's row for level 1)."""

    def __init__(self, head, num_blocks: int, block_size: int, width: int, depth: int,
                 max_seqs: int | None = None, max_seq_blocks: int | None = None,
                 use_graphs: bool | str | None = None, nodes: int | None = None):
        self.check_fits(width, depth)
        self.draft, self.w, self.depth = head, width, depth
        c = head.config
        self.pool = PagedKVPool(1, c.num_key_value_heads, c.head_dim, num_blocks, block_size, head.dtype, head.device,
                                prefix_caching=False)
        self.model = BatchedHead(head, self.pool, max_seqs=max_seqs, max_seq_blocks=max_seq_blocks, use_graphs=use_graphs)
        # rid -> its last root's logits and output hidden: row i of (logits [n, draft_vocab], out [n, H])
        # of the context pass it ran in (no per-request tensors: the common step stacks nothing)
        self.root_logits: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.pending: dict[str, PendingRows] = {}  # rid -> its tokens not run yet, their hidden inputs [n, H]
        self._level_out: torch.Tensor | None = None  # [R, w, H] the last level's output hidden
        self._init_trees(nodes)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.pending.pop(request_id, None)

    def start(self, request_id: str, prompt: list[int], features: torch.Tensor | None) -> None:
        """prompt: every token so far (the root last); features: [len - 1, F] the target's features
        of all but the root, or None (zeros: the first proposals are weaker, never wrong)."""
        self.release(request_id)
        head = self.draft
        hidden = torch.zeros(len(prompt), head.config.hidden_size, device=head.device, dtype=head.dtype)
        if features is not None and len(prompt) > 1:  # row i reads the features of position i - 1
            hidden[1:] = head.project(features[-(len(prompt) - 1):])
        self.pool.allocate(request_id, [], 0)
        self.pending[request_id] = PendingRows(prompt, hidden)

    def observe_many(self, items: list[tuple[str, list[int]]], features: torch.Tensor) -> None:
        """A verify pass committed each request's `tokens` (accepted nodes, then the bonus);
        features [sum of lens, F]: the target's features of the roots and the accepted nodes, the
        inputs of those tokens' rows, in the items' order (one projection for all). They join the
        rows the head has not run (several passes' worth when steps skip drafting)."""
        feed(self.pending, items, self.draft.project(features))

    def _roots(self, live: list[tuple[str, list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The context pass: every request's pending rows (in chunks of CATCH_UP_CHUNK), joined to
        its pool rows -> the roots' logits [R, draft_vocab] and output hidden [R, H]."""
        # (a request drafted again before its verify, as batch parallelism may, has nothing new:
        # its root_logits entry stands)
        todo = [rid for rid, _, _ in live if self.pending[rid].tokens]
        while todo:
            segs, hid, last, fed = [], [], [], []
            rows = 0
            for rid in todo:
                part, spans = self.pending[rid].take(batched_draft.CATCH_UP_CHUNK)
                start = self.pool.seqs[rid].length
                self.pool.reserve(rid, len(part))
                segs.append(Segment.chunk(part, start, self.pool.seqs[rid].blocks))
                hid += spans
                fed.append((rid, list(range(len(part))), part))
                rows += len(part)
                last.append(rows - 1)  # (each request's last row in the pass)
            out_logits, out = self.model.context(segs, span_views(hid), last)  # [len(todo), V'], [len(todo), H]
            self.pool.commit_many(fed)
            for i, rid in enumerate(todo):
                if not self.pending[rid].tokens:  # its root ran: nothing pending until the next observe_many
                    self.root_logits[rid] = (out_logits, out, i)
            todo = [rid for rid in todo if self.pending[rid].tokens]
        roots = [self.root_logits[rid] for rid, _, _ in live]
        first = roots[0]
        if all(r[0] is first[0] and r[2] == i for i, r in enumerate(roots)) and len(roots) == first[0].shape[0]:
            return first[0], first[1]  # every root from one pass, in order (a step's usual case)
        return (torch.stack([lg[i] for lg, _, i in roots]),  # [R, draft_vocab]
                torch.stack([o[i] for _, o, i in roots]))  # [R, H]

    # ---- run_accepts (BatchedTreeDrafter): the head's pass over a step's accepts --------------
    def can_run_accepts(self, reqs: list[tuple[str, int]]) -> bool:
        """Each request has run every row it was given (its last context pass ran its root)."""
        return all(rid in self.pool.seqs and rid in self.pending and not self.pending[rid].tokens for rid, _ in reqs)

    def _accept_feature_width(self) -> int | None:
        return self.draft.fc.in_features

    def _accept_pass(self, rows: BatchRows, features: torch.Tensor | None, feature_rows: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
        return self.model.run(rows, self.draft.project(features[feature_rows]))  # [M, V'], [M, H]

    def _keep_roots(self, rids: list[str], roots: tuple[torch.Tensor, ...]) -> None:
        for i, rid in enumerate(rids):
            self.root_logits[rid] = (roots[0], roots[1], i)

    def _root_specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        h = self.draft
        return [((h.econfig.draft_vocab_size,), h.dtype), ((h.config.hidden_size,), h.dtype)]

    def _warm_context(self, max_seqs: int) -> None:
        h = self.draft  # (a step's context pass: each request's accepted rows and bonus; a new
        # request's prompt, a catch-up chunk at a time: uncaptured, its first token paid a capture)
        like = torch.zeros(1, h.config.hidden_size, dtype=h.dtype, device=h.device)
        self.model.warmup_inputs(max(max_seqs * (self.depth + 1), batched_draft.CATCH_UP_CHUNK), like, self.model.run)

    def _level(self, rows: BatchRows, parent_row: torch.Tensor | None, roots: tuple[torch.Tensor, ...]) -> torch.Tensor:
        root_out = roots[1]  # [R, H]
        R, w = root_out.shape[0], self.w
        if parent_row is None:  # level 1: every fed node's parent is its request's root
            hidden = root_out[:, None].expand(R, w, -1)
        else:
            hidden = self._level_out.gather(1, parent_row[:, :, None].expand(R, w, self._level_out.shape[-1]))
        logits, out = self.model.run(rows, hidden.reshape(R * w, -1))
        self._level_out = out.view(R, w, -1)
        return logits  # [R * w, draft_vocab]

    def _d2t(self) -> torch.Tensor | None:
        return self.draft.d2t


class BatchedBlock(BatchedModel):
    """A parallel block drafter (tandem.models.block_drafter) over a paged pool of its own: rows
    are embed(token) + fc(norm(features)) (mask rows: the mask embedding), through its decoder
    layers; a pass returns each lattice row (`BlockDrafter.lattice_rows`), captured per row
    bucket (`context`)."""

    rows = BatchedModel.exact_rows  # (no `_body` of a target to capture per bucket)

    def context(self, segments: list[Segment], feats: "torch.Tensor | list[torch.Tensor]", picked: list[int]
                ) -> torch.Tensor:
        """A pass over the segments' rows with their features [M, F] (or its chunks in row order)
        -> the lattice rows [len(picked), 3K + K*K] of rows `picked` (every row's is computed: the
        same values, a row's lattice reads only its own and the previous row's)."""
        (lattice,) = self.run_rows(segments, feats, self.every_lattice, picked=picked)
        return lattice

    def every_lattice(self, rows: BatchRows, feats: torch.Tensor) -> tuple[torch.Tensor]:
        """run() over every row, as run_rows' body (its captured pass)."""
        return (self.run(rows, feats),)

    @torch.no_grad()
    def run(self, rows: BatchRows, feats: torch.Tensor, picked: torch.Tensor | None = None) -> torch.Tensor:
        """feats: [M, F] each row's target features (mask rows: ignored) -> the lattice rows
        [len(picked), 3K + K*K] of the rows `picked` (default: every row)."""
        d = self.model
        ids = rows.tokens[:rows.num_rows][None]  # [1, M]
        if picked is None:
            picked = slice(None)
        x, delta = d.embed(ids, feats[None]), None  # [1, M, hidden]
        for i, layer in enumerate(d.layers):
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            x, h = add_rmsnorm(x, delta, ln1.weight, ln1.eps)
            a = self._attention(layer.self_attn, i, h, rows)
            x, h = add_rmsnorm(x, a, ln2.weight, ln2.eps)
            delta = layer.mlp(h)
        h = add_rmsnorm(x, delta, d.norm.weight, d.norm.eps)[1][0, picked]  # [n, hidden]
        return d.lattice_rows(d.shared["lm_head"](h)[None], ids[:, picked])[0]  # [n, 3K + K*K]


class BatchedBlockDrafter:
    """A parallel block drafter's lattice trees for every request at once (the per-request
    LatticeDrafter's, batched): per request its pending context rows (committed tokens with the
    target features of the position before each; the root last) and B - 1 mask rows after the
    root, all requests in one causal pass; the context rows join the drafter's pool, the mask rows
    are dropped; each request's root and mask rows give its lattice, and the best-first tree (or
    the greedy chain) over it is built on the host, as the per-request drafter builds it."""

    def __init__(self, drafter, num_blocks: int, block_size: int, nodes: int, chain: bool, context_window: int,
                 max_seqs: int | None = None, max_seq_blocks: int | None = None, use_graphs: bool | str | None = None):
        self.draft, self.nodes, self.chain, self.context_window = drafter, nodes, chain, context_window
        c = drafter.config
        self.block, self.k = drafter.bconfig.block_size, drafter.bconfig.num_candidates
        self.pool = PagedKVPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_blocks, block_size,
                                drafter.dtype, drafter.device, prefix_caching=False)
        self.model = BatchedBlock(drafter, self.pool, max_seqs=max_seqs, max_seq_blocks=max_seq_blocks,
                                  use_graphs=use_graphs)
        self.pending: dict[str, PendingRows] = {}  # rid -> its tokens not run yet, their features [n, F]
        # from this many requests on, their trees are built together on the device
        # (lattice.best_first_trees: a fixed number of kernels) rather than by a heap walk each on
        # the host; never on the CPU, where the walk is cheaper at every batch (measured on this
        # project's 2-core machine, bench/cpu_lattice_trees.py: 0.18 / 11.7 ms for 1 / 64 requests
        # against 1.6 / 36.1 ms all together). The GPU threshold is a guess, not yet measured.
        self.device_trees_from: int | None = 8 if drafter.device.type == "cuda" else None

    def warmup(self, max_seqs: int) -> None:
        """The pass's captures for a step's rows (each request's accepted rows and B - 1 mask rows)."""
        d = self.draft
        like = torch.zeros(1, d.bconfig.feature_size, dtype=d.dtype, device=d.device)
        self.model.warmup_inputs(max_seqs * 2 * self.block, like, self.model.every_lattice)

    def release(self, request_id: str) -> None:
        self.pool.free(request_id)
        self.pending.pop(request_id, None)

    def start(self, request_id: str, prompt: list[int], features: torch.Tensor | None) -> None:
        """As BatchedEagleDrafter.start: row i pairs token i with the features of position i - 1."""
        self.release(request_id)
        d = self.draft
        feats = torch.zeros(len(prompt), d.bconfig.feature_size, device=d.device, dtype=d.dtype)
        if features is not None and len(prompt) > 1:
            feats[1:] = features[-(len(prompt) - 1):].to(d.dtype)
        self.pool.allocate(request_id, [], 0)
        self.pending[request_id] = PendingRows(prompt, feats)

    def observe_many(self, items: list[tuple[str, list[int]]], features: torch.Tensor) -> None:
        """As BatchedEagleDrafter.observe_many: the committed rows join the pending ones."""
        feed(self.pending, items, features.to(self.draft.dtype))

    @torch.no_grad()
    def propose(self, trees: list[tuple[str, list[int], int]]) -> dict[str, DraftTree]:
        """trees: (request id, every token so far, node budget N) -> request id -> its tree."""
        from tandem.drafting.lattice import best_chain, best_first_tree, best_first_trees, unpack_lattice

        # (a request drafted already and not verified since has nothing to draft)
        out, live = split_drafted(trees, lambda rid: bool(self.pending[rid].tokens))
        if not live:
            return out
        # a long backlog (a new prompt) first: context-only passes of batched_draft.CATCH_UP_CHUNK rows
        while True:
            early = [rid for rid, _, _ in live if len(self.pending[rid].tokens) > batched_draft.CATCH_UP_CHUNK]
            if not early:
                break
            self._pass([(rid, batched_draft.CATCH_UP_CHUNK, 0) for rid in early])
        # then every request's remaining rows (the root last) and its mask rows
        plan = []
        for rid, _, _ in live:
            P = len(self.pending[rid].tokens)
            room = self.context_window - (self.pool.seqs[rid].length + P)  # drafts past the window are useless
            plan.append((rid, P, max(0, min(self.block - 1, room))))
        lattice = self._pass(plan)  # [sum of 1 + masks, 3K + K*K]: each request's root row, then its mask rows
        starts = [0]
        for _, _, masks in plan:
            starts.append(starts[-1] + 1 + masks)
        together = [i for i, (_, _, n) in enumerate(live) if n == self.nodes and not self.chain]
        if self.device_trees_from is not None and len(together) >= self.device_trees_from:
            # every full-budget tree at once on the device (a fixed number of kernels), read back once
            idx = torch.full((len(together), self.block), -1, dtype=torch.long)
            for j, i in enumerate(together):
                idx[j, :starts[i + 1] - starts[i]] = torch.arange(starts[i], starts[i + 1])
            rows = lattice[idx.clamp(min=0).to(lattice.device)]  # [T, B, 3K + K*K] (padding rows: -inf below)
            positions = [starts[i + 1] - starts[i] for i in together]
            trees = best_first_trees(rows, positions, [live[i][1][-1] for i in together], self.k, self.nodes)
            out.update((live[i][0], t) for i, t in zip(together, trees))
        rest = [i for i in range(len(live)) if live[i][0] not in out]
        if rest:
            host = lattice.cpu()  # (one device-to-host copy for those requests' lattices)
            for i in rest:
                rid, toks, n = live[i]
                lat = unpack_lattice(host[starts[i]:starts[i + 1]], self.k)  # the root's row, then the mask rows
                out[rid] = best_chain(lat, toks[-1], n) if self.chain else best_first_tree(lat, toks[-1], n)
        return out

    def _pass(self, plan: list[tuple[str, int, int]]) -> torch.Tensor:
        """plan: (request id, context rows to feed from its pending ones, mask rows). One pass;
        the context rows are committed, the mask rows dropped. Returns the lattice rows of each
        request's last context row and its mask rows (none for a context-only entry), in order."""
        d = self.draft
        zeros = torch.zeros(max(m for _, _, m in plan), d.bconfig.feature_size, dtype=d.dtype, device=d.device)
        segs, feats, picked, fed = [], [], [], []
        row = 0
        for rid, P, masks in plan:
            toks, spans = self.pending[rid].take(P)
            start = self.pool.seqs[rid].length
            self.pool.reserve(rid, P + masks)
            segs.append(Segment.chunk(toks + [d.mask_id] * masks, start, self.pool.seqs[rid].blocks))
            feats += spans + [(zeros, 0, masks)]  # (the mask rows read no features)
            if not self.pending[rid].tokens:  # the root is in this pass: its row and the mask rows make the lattice
                picked += range(row + P - 1, row + P + masks)
            row += P + masks
            fed.append((rid, list(range(P)), toks))  # the mask rows go
        lattice = self.model.context(segs, span_views(feats), picked)
        self.pool.commit_many(fed)
        return lattice
