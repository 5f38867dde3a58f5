"""Batched drafting: every decoding request's draft from shared passes of the drafter.

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
N best nodes by cumulative log-prob form the tree. `depth - 1` batched passes after the catch-up,
grown on the device (one read-back per step); on a GPU the whole tree is one CUDA graph per
request bucket.

Every request is drafted this way: a greedy chain takes argmaxes; a sampled chain draws each
token from the draft's processed distribution q with the request's generator and keeps q with
the tree (rejection sampling needs it); a tree's nodes are point masses, greedy or sampled, so
rejection sampling over them stays lossless. Node log-probs are the draft's own, as the
per-request drafters give them to row selection. A new request's prompt is caught up in chunks
of CATCH_UP_CHUNK rows (the passes' masks stay small).

Feature drafters (an EAGLE-3 head, a block drafter) are batched the same way, in
tandem.engine.batched_features.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from tandem.config import SamplingConfig
from tandem.engine.batched_model import BatchedModel, BatchRows, Capacity, Segment, StaticRows
from tandem.kernels import level_tree, tree_verify
from tandem.kernels.resident import topk_logprobs
from tandem.kv.paged import PagedKVPool
from tandem.tree.draft_tree import DraftTree
from tandem.verify.sampling import probs_from_logits
from tandem.kernels.upload import upload

CATCH_UP_CHUNK = 128  # rows per request in one catch-up pass


def split_drafted(requests: list[tuple[str, list[int], int]], can_draft=lambda rid: True
                  ) -> tuple[dict[str, DraftTree], list[tuple[str, list[int], int]]]:
    """(request id, tokens, budget) entries -> (the root alone for those with nothing to draft: a
    zero budget, or `can_draft` false; the entries to draft)."""
    out = {rid: DraftTree.chain([toks[-1]]) for rid, toks, n in requests if n <= 0 or not can_draft(rid)}
    return out, [(rid, toks, n) for rid, toks, n in requests if rid not in out]


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

    def warmup(self, max_seqs: int) -> None:
        """Capture now what steps of up to `max_seqs` requests replay (server start-up)."""
        self.model.warmup(max(max_seqs * 4, CATCH_UP_CHUNK))  # (catch-up passes: about tau rows a request; a prompt's chunk)

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
        ends = np.cumsum([len(seg.tokens) for seg in segs]) - 1
        return out[upload(ends, out.device)]

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


def level_segments(lengths: list[int], tables: list[list[int]], w: int) -> list[Segment]:
    """A level tree's first level as Segments (what BatchRows.pack_level packs): request r's w
    children of the root after its lengths[r] committed columns, each seeing those and itself."""
    bits = [1 << s for s in range(w)]
    return [Segment([0] * w, [L] * w, blocks, L + w, logits=True, prefix=L, bits=bits)
            for L, blocks in zip(lengths, tables)]


MAX_LEVEL_ROWS = 64  # a tree's level rows per request: one int64 mask word (tandem.kernels.paged_attention)
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # requests per captured tree (padded up)


def tree_depth_bits(par_pos: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trees of n nodes below a root (par_pos [R, n]: node q's parent's tree position, 0 the
    root, nodes at positions 1..n) -> each position's depth and ancestor mask [R, n + 1] int64
    (bit j: position j is the node itself or an ancestor; the root's is 1), for trees of at
    most 63 nodes and `max_depth` levels. Pointer jumping, a fixed number of rounds (what a
    CUDA graph captures), as draft_tree.tree_masks does on the host."""
    R, n = par_pos.shape
    dev = par_pos.device
    up = torch.cat([torch.zeros(R, 1, dtype=torch.long, device=dev), par_pos], 1)  # [R, n + 1] (the root: itself)
    bits = (1 << torch.arange(n + 1, device=dev)).expand(R, n + 1)  # own bit (bit 63 wraps: two's complement)
    depth = (torch.arange(n + 1, device=dev) > 0).long().expand(R, n + 1)
    # invariant: bits[q] holds the nodes from q up to, not including, up[q]; depth[q] counts them
    for _ in range(max(1, max_depth).bit_length() + 1):
        bits = bits | bits.gather(1, up)
        depth = depth + depth.gather(1, up)
        up = up.gather(1, up)
    return depth, bits


@dataclass
class _TreeGraph:
    """One captured tree of level passes for R requests (padding requests write the scratch slot)."""

    R: int
    st: StaticRows  # level 1's rows [R * w]: each level rewrites their per-row fields
    roots: tuple[torch.Tensor, ...]  # inputs: the drafter's root state, [R, ...] each (logits first)
    graph: object = None  # torch.cuda.CUDAGraph (None: emulated, run eagerly over the same buffers)
    # output [6, R, n] int64 (tree order): token, parent's tree position, rank by score, the
    # cumulative log-prob as float64 bits, depth, ancestor bits (one tensor: the step reads the
    # tree back in one copy; the last two are what the target's rows need, built on the device)
    out: torch.Tensor | None = None


@dataclass
class _AcceptGraph:
    """BatchedTreeDrafter.run_accepts captured for R requests: a verify pass's accepts (and a
    feature drafter's features) in, the draft's pass over them and the next step's trees out."""

    ctx: StaticRows  # [R (depth + 1)] causal rows, packed by load_chunk_rows (tokens written inside)
    tree: _TreeGraph  # the bucket's tree: its level buffers (packed by load_level_rows) and roots
    acc: torch.Tensor  # [R, 3 + n] input: tree_verify.accept_paths' answer
    features: torch.Tensor | None  # [R (n + 1), F] input: the verify pass's target features (None: a draft model)
    roots: tuple[torch.Tensor, ...]  # the roots the pass ran (the tree's root buffers), logits first
    graph: object = None  # torch.cuda.CUDAGraph (None: emulated)
    out: torch.Tensor | None = None  # [6, R, n_graph] the trees


class BatchedTreeDrafter(BatchedDrafter):
    """EAGLE-2's level tree for every request at once, grown on the device.

    After the catch-up pass the levels need no host: each level's fed rows (the w best newest
    nodes by cumulative log-prob, ties to the earlier node), their tokens, positions, slots and
    ancestor masks are computed by tensor ops into the pass's buffers, and the children's top-w
    are scattered into node arrays. With CUDA graphs the whole tree (the roots' top-w, every
    level pass, the N best) is ONE captured graph per request bucket: a step packs level 1's
    rows, replays it and reads the tree back once. Eagerly, each level's kernels are launched
    from the host (on the H200's slow host about as long as the level's pass)."""

    def __init__(self, draft, num_blocks: int, block_size: int, width: int, depth: int,
                 max_seqs: int | None = None, max_seq_blocks: int | None = None,
                 use_graphs: bool | str | None = None, nodes: int | None = None):
        """nodes: the largest node budget a proposal asks (the captured trees keep that many)."""
        super().__init__(draft, num_blocks, block_size, max_seqs, max_seq_blocks, use_graphs)
        self.w, self.depth = width, depth
        self.check_fits(width, depth)
        self._init_trees(nodes)

    def _init_trees(self, nodes: int | None) -> None:
        self.n_all = self.w + (self.depth - 1) * self.w * self.w  # level 1, then each level's w x w children
        self.n_graph = min(nodes or self.n_all, self.n_all)
        self._trees: dict[int, _TreeGraph | None] = {}
        self._accepts: dict[tuple[int, int], _AcceptGraph | None] = {}  # (request bucket, verified nodes) -> run_accepts' capture
        # a captured tree: levels to grow, and its model's passes captured (graphs on, sizes known,
        # no sliding window) with the Triton kernel for attention (or emulated)
        m = self.model
        self.tree_graphs = m.use_graphs and self.depth > 1 and (m.emulate or m.kernel_applies())

    @staticmethod
    def fits(width: int, depth: int) -> bool:
        return (depth - 1) * width <= MAX_LEVEL_ROWS

    @classmethod
    def check_fits(cls, width: int, depth: int) -> None:
        if not cls.fits(width, depth):
            raise ValueError(f"a batched level tree feeds (depth - 1) x width = {(depth - 1) * width} rows per "
                             f"request, more than {MAX_LEVEL_ROWS}")

    def warmup(self, max_seqs: int) -> None:
        """The context passes' captures, then the trees of every request bucket up to `max_seqs`."""
        self._warm_context(max_seqs)
        if not self.tree_graphs:
            return
        for b in REQUEST_BUCKETS:
            if b > max_seqs:
                break
            self._tree_graph(b)
        self._warm_accepts(max_seqs)

    def _warm_context(self, max_seqs: int) -> None:
        self.model.warmup(max(max_seqs * self.w, CATCH_UP_CHUNK))  # (a new prompt's catch-up chunk too)

    @torch.no_grad()
    def propose(self, trees: list[tuple[str, list[int], int]]) -> dict[str, DraftTree]:
        """trees: (request id, every token so far (the root last), node budget N >= 0) ->
        request id -> the N best nodes of its level tree (module docstring), prefix-closed."""
        out, live = split_drafted(trees)
        if not live:
            return out
        tree, n_max = self._propose_on_device(live)
        host = tree[:4].cpu().numpy()  # [4, R, n] the step's one read-back
        toks_, pars, rank = host[:3].tolist()
        lps = host[3].view(np.float64).tolist()  # (float32 log-probs, exact in float64)
        for i, (rid, toks, n) in enumerate(live):
            if n >= n_max:  # every picked node, in tree order already
                out[rid] = DraftTree(tokens=[toks[-1]] + toks_[i], parents=[-1] + pars[i], logp=[0.0] + lps[i])
                continue
            keep = [j for j in range(n_max) if rank[i][j] < n]  # its n best (prefix-closed), in tree order
            index = {j + 1: k + 1 for k, j in enumerate(keep)}
            out[rid] = DraftTree(tokens=[toks[-1]] + [toks_[i][j] for j in keep],
                                 parents=[-1] + [index.get(pars[i][j], 0) for j in keep],
                                 logp=[0.0] + [lps[i][j] for j in keep])
        return out

    def device_nodes(self, requests: int, budget: int) -> int | None:
        """The nodes each tree of `propose_device` has for this many requests that each ask
        `budget` nodes (the captured tree's when it takes them, else the budget's), None when a
        tree cannot stay on the device (a budget past what the level tree grows)."""
        if budget > self.n_all or budget < 1:
            return None
        if self.tree_graphs and budget <= self.n_graph and requests <= self.model.max_seqs:
            return self.n_graph
        return budget

    @torch.no_grad()
    def propose_device(self, trees: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """As `propose` for requests that each ask the same budget, every one of them drafting
        (none drafted already), but left on the device: [6, R, n] int64 as `_TreeGraph.out`, n
        = `device_nodes` (the engine builds the target's rows and accepts on the device from it,
        and reads back only what was accepted: no read-back between drafting and verifying)."""
        return self._propose_on_device(trees)[0]

    def _propose_on_device(self, live: list[tuple[str, list[int], int]]) -> tuple[torch.Tensor, int]:
        """The trees of requests that draft now -> ([6, R, n_max] on the device, n_max)."""
        w, R = self.w, len(live)
        roots = self._roots(live)  # ([R, V], drafter state ...)
        n_max = min(max(n for _, _, n in live), self.n_all)
        # level 1's rows: request r's w rows after its lengths[r] committed columns (the root last)
        lengths, tables, versions = [], [], []
        if self.depth > 1:  # every level's rows now, so the block tables hold for the whole tree
            seqs, rows_ahead = self.pool.seqs, (self.depth - 1) * w
            for rid, toks, _ in live:
                self.pool.reserve(rid, rows_ahead)
                sb = seqs[rid]
                lengths.append(len(toks))
                tables.append(sb.blocks)
                versions.append(sb.version)
        g = None
        if self.tree_graphs and n_max <= self.n_graph and R <= self.model.max_seqs:
            g = self._tree_graph(next(b for b in REQUEST_BUCKETS if b >= R))
        if g is not None:
            # (the level pack: the general one's fields, only what changed written)
            rows = self.model.load_level_rows(g.st, lengths, tables, versions, w)
            for buf, t in zip(g.roots, roots):
                (buf if R == g.R else buf[:R]).copy_(t)  # (a full bucket: no view to make)
            if g.graph is not None:
                g.graph.replay()
            else:  # emulated: the same padded buffers, eagerly (the reference path reads `rows`' host figures)
                g.out = self._device_tree(rows, g.roots, g.R, self.n_graph)
            # (its n_graph best in tree order: a smaller budget takes its best by rank, below)
            n_max, tree = self.n_graph, g.out[:, :R]
        else:
            rows = self.model.rows(level_segments(lengths, tables, w)) if lengths else None
            tree = self._device_tree(rows, roots, R, n_max)
        self.pool.commit_many([(rid, [], []) for rid, _, _ in live])  # drop the levels' rows: the target decides what stays
        return tree, n_max

    def _tree_graph(self, R: int) -> _TreeGraph | None:
        """The captured tree for a bucket of R requests (None: the capture failed; eager then)."""
        if R in self._trees:
            return self._trees[R]
        w = self.w
        cap = Capacity(R * w, R, R, self.model.max_seq_blocks, 1)  # (w <= 16 rows: one attention tile a request)
        st = self.model.static_rows(cap)
        roots = tuple(torch.zeros(R, *shape, dtype=dtype, device=self.draft.device) for shape, dtype in self._root_specs())
        g = _TreeGraph(R, st, roots)
        if not self.model.emulate:
            def body():
                g.out = self._device_tree(st.rows, roots, R, self.n_graph)
            g.graph = self.model.capture(body)
            if g.graph is None:
                self.tree_graphs = False
                g = None
        self._trees[R] = g
        return g

    def _device_tree(self, rows: BatchRows | None, roots: tuple[torch.Tensor, ...], R: int, n_out: int
                     ) -> torch.Tensor:
        """The whole tree on the device, from the roots' state (logits [R, V] first) and level 1's
        rows (None without levels) -> the N best nodes in tree order (by node index), [4, R, n_out]
        int64: token, parent's tree position (0: the root), rank by score, cumulative log-prob
        (float64 bits)."""
        w = self.w
        lp, tok = topk_logprobs(roots[0], w)  # [R, w] each
        tok = self._to_target(tok)
        node_tok = torch.zeros(R, self.n_all, dtype=torch.long, device=tok.device)
        node_par = torch.full((R, self.n_all), -1, dtype=torch.long, device=tok.device)
        node_lp = torch.zeros(R, self.n_all, dtype=torch.float32, device=tok.device)
        node_tok[:, :w], node_lp[:, :w] = tok, lp
        if self.depth > 1:
            self._grow(rows, roots, R, node_tok, node_par, node_lp)
        # the N best by cumulative log-prob (ties to the earlier node: a parent precedes its
        # children and scores at least as high, so every prefix of this order is prefix-closed)
        order = torch.sort(-node_lp, dim=1, stable=True).indices[:, :n_out]  # [R, n_out] best first
        # in tree order (by node index: a parent before its children), parents as tree positions,
        # so the host slices lists instead of re-sorting and re-indexing every request's tree
        by_index = order.sort(dim=1)
        sel, rank = by_index.values, by_index.indices  # [R, n_out] node index; its rank by score
        pos = torch.zeros(R, self.n_all, dtype=torch.long, device=sel.device)
        pos.scatter_(1, sel, torch.arange(1, n_out + 1, device=sel.device).expand(R, n_out))  # node -> tree position
        par = node_par.gather(1, sel)  # [R, n_out] parent node (-1: the root)
        par_pos = torch.where(par >= 0, pos.gather(1, par.clamp_min(0)), 0)
        lp = node_lp.gather(1, sel).to(torch.float64).view(torch.int64)  # [R, n_out] (bits, exact)
        depth, bits = tree_depth_bits(par_pos, self.depth)  # [R, n_out + 1] each (the root first)
        return torch.stack([node_tok.gather(1, sel), par_pos, rank, lp, depth[:, 1:], bits[:, 1:]])

    def _grow(self, rows: BatchRows, roots: tuple[torch.Tensor, ...], R: int, node_tok: torch.Tensor,
              node_par: torch.Tensor, node_lp: torch.Tensor) -> None:
        """The depth - 1 level passes over level 1's packed rows (R requests, w rows each; a
        request with no columns is padding): node arrays [R, n_all] filled in place."""
        w, dev, bs, L = self.w, node_tok.device, self.pool.block_size, self.depth - 1
        M = R * w
        Lt = rows.seq_len[:R] - w  # [R] committed columns (the root is the last); < 0: padding
        real = Lt >= 0  # [R]
        ctx1 = list(rows.contexts)  # (host figures of the reference path; empty when captured)
        # every level's per-row fields at once (a level then only copies its row of each): the
        # column level d's row s is written to, its slot, its position, the requests' column counts
        base = torch.arange(L, device=dev)[:, None, None] * w  # [L, 1, 1] level rows before level d
        col = Lt.clamp_min(0)[None, :, None] + base + torch.arange(w, device=dev)  # [L, R, w]
        blk = rows.block_tables[:R].gather(1, (col // bs).permute(1, 0, 2).reshape(R, -1))  # [R, L * w]
        slots = torch.where(real[None, :, None], blk.view(R, L, w).permute(1, 0, 2) * bs + col % bs,
                            self.pool.scratch_slot).reshape(L, M)  # [L, M]
        positions = (Lt[None, :, None] + torch.arange(L, device=dev)[:, None, None]).clamp_min(0)
        positions = positions.expand(L, R, w).reshape(L, M)  # [L, M] level d sits at Lt - 1 + d
        seq_len = torch.where(real, Lt + w + base.view(L, 1), 0)  # [L, R]
        # (each level's glue: two Triton programs a request on a GPU, tandem.kernels.level_tree)
        fed_bits = torch.zeros(R, w, dtype=torch.long, device=dev)  # the previous level's fed rows' masks
        bits_next, fed, parent = (torch.empty(R, w, dtype=torch.long, device=dev) for _ in range(3))
        d2t = self._d2t()
        lo, hi = 0, w  # the newest level's nodes
        for d in range(1, self.depth):
            # fed [R, w]: the newest level's w best nodes; parent_row [R, w]: the previous level's
            # fed row each hangs from (None at level 1: the root); the level's rows written
            level_tree.level_feed(node_tok, node_lp, lo, hi, w, fed_bits, bits_next, (d - 1) * w, d == 1, fed,
                                  parent, rows.tokens, rows.positions, rows.slots, rows.row_bits, rows.seq_len,
                                  positions[d - 1], slots[d - 1], seq_len[d - 1])
            fed_bits, bits_next = bits_next, fed_bits
            parent_row = None if d == 1 else parent
            if ctx1:  # (a reference path's view is per pass)
                rows = replace(rows, contexts=[c + (d - 1) * w for c in ctx1])
            clp, ctok = topk_logprobs(self._level(rows, parent_row, roots), w)  # [M, w] each
            lo, hi = hi, hi + w * w  # this level's children: fed row s's at lo + s * w + j
            level_tree.level_children(node_tok, node_par, node_lp, fed, ctok, clp, lo, d2t)
        rows.seq_len[:R] = torch.where(Lt >= 0, Lt + w, 0)  # (level 1's again: a replay starts from it)

    # ---- the next step's drafting queued before the accepts are read (device-resident) ----------
    runs_accepts = True  # (a chain drafter does not: device verification takes `tree` steps only)

    def can_run_accepts(self, reqs: list[tuple[str, int]]) -> bool:
        """Whether run_accepts takes these requests, (request id, tokens so far) each: the draft
        has run every one of them (its last catch-up ran the root), so a verify pass's accepts
        are all it has to run."""
        seqs = self.pool.seqs
        return all(rid in seqs and seqs[rid].length == n and rid in self.root_logits for rid, n in reqs)

    @torch.no_grad()
    def run_accepts(self, rids: list[str], acc: torch.Tensor, features: torch.Tensor | None, trees: bool
                    ) -> torch.Tensor | None:
        """The draft's pass over a verify pass's accepts without reading them (the engine reads
        them while this runs): per request depth + 1 rows after its committed ones, the first
        `count` of them its accepted tokens and the bonus (tree_verify.accepted_rows; the rest
        run too, at columns no later pass sees, and are dropped by `commit_accepts`); a feature
        drafter's rows read the target's features of the tree position before each. acc
        [R, 3 + n] (device_verify.launch), features [R (n + 1), F] the pass's (None: a draft
        model). Each request's bonus row is its next root. With captured trees this and the next
        step's trees from those roots are one CUDA graph per request bucket (_AcceptGraph): the
        host packs two buffers and replays once. Returns those trees ([6, R, n_graph], as
        propose_device's) when `trees`, else None. The rows (and the trees') stay reserved until
        commit_accepts."""
        R, K, n = len(rids), self.depth + 1, acc.shape[1] - 3
        m, seqs = self.model, self.pool.seqs
        g = None
        if self.tree_graphs and K <= m.tile_rows and R <= m.max_seqs:
            g = self._accept_graph(next(b for b in REQUEST_BUCKETS if b >= R), n)
        extra = (self.depth - 1) * self.w if g is not None else 0  # (the graph grows the trees too)
        starts, tables, versions = [], [], []
        for rid in rids:
            sb = seqs[rid]
            starts.append(sb.length)
            self.pool.reserve(rid, K + extra)
            tables.append(sb.blocks)
            versions.append(sb.version)
        if g is None:  # one exact pass, its ops launched from here
            toks, pos, count = tree_verify.accepted_rows(acc, K)  # [R, K], [R, K], [R]
            rows = m.exact_rows([Segment.chunk([0] * K, L, t, logits=True) for L, t in zip(starts, tables)])
            rows.tokens[:R * K].copy_(toks.view(-1))
            r = torch.arange(R, device=acc.device)
            state = self._accept_pass(rows, features, (pos + (r * (n + 1))[:, None]).view(-1))  # [R K, ...] each
            root = r * K + count - 1  # [R] each request's bonus row
            self._keep_roots(rids, tuple(s[root] for s in state))
            return None
        ctx = m.load_chunk_rows(g.ctx, starts, tables, versions, K)
        level = m.load_level_rows(g.tree.st, [L + K for L in starts], tables, versions, self.w)
        g.acc[:R].copy_(acc)
        if g.features is not None:
            g.features[:R * (n + 1)].copy_(features[:R * (n + 1)])
        if g.graph is not None:
            g.graph.replay()
        else:  # emulated: the same buffers, eagerly (the reference attention reads the rows' host figures)
            g.out = self._accepts_body(g, ctx, level)
        self._keep_roots(rids, g.roots)  # (static buffers: only the next replay, of these requests, rewrites them)
        return g.out[:, :R] if trees else None

    def commit_accepts(self, items: list[tuple[str, list[int]]]) -> None:
        """run_accepts' requests with their accepts read: each keeps its first len(tokens) rows
        (in place: no move) and drops the rest of what it reserved."""
        self.pool.commit_many([(rid, list(range(len(toks))), toks) for rid, toks in items])

    def _warm_accepts(self, max_seqs: int) -> None:
        """run_accepts' captures for every request bucket up to `max_seqs` (one captured
        mid-serving cost a request's first token ~40 ms on the H200)."""
        if not (self.runs_accepts and self.tree_graphs and self.depth + 1 <= self.model.tile_rows):
            return
        for b in REQUEST_BUCKETS:
            if b > max_seqs:
                break
            self._accept_graph(b, self.n_graph)

    def _accept_graph(self, R: int, n: int) -> "_AcceptGraph | None":
        """run_accepts' capture for a bucket of R requests whose verified trees had n nodes
        (None: the capture failed; the exact pass then)."""
        key = (R, n)
        if key in self._accepts:
            return self._accepts[key]
        tree = self._tree_graph(R)  # (its level buffers and roots: the trees read what this writes)
        if tree is None:
            self._accepts[key] = None
            return None
        K, dev, m = self.depth + 1, self.draft.device, self.model
        width = self._accept_feature_width()
        g = _AcceptGraph(ctx=m.static_rows(Capacity(R * K, R, R, m.max_seq_blocks, 1)), tree=tree,
                         acc=torch.zeros(R, 3 + n, dtype=torch.long, device=dev),
                         features=None if width is None else torch.zeros(R * (n + 1), width, dtype=self.draft.dtype,
                                                                         device=dev),
                         roots=tree.roots)
        if not m.emulate:
            def body():
                g.out = self._accepts_body(g, g.ctx.rows, tree.st.rows)
            g.graph = m.capture(body)
            if g.graph is None:
                g = None
        self._accepts[key] = g
        return g

    def _accepts_body(self, g: "_AcceptGraph", ctx: BatchRows, level: BatchRows) -> torch.Tensor:
        """What _AcceptGraph captures: the accepts' rows written over the packed placeholders, the
        draft's pass over them, each request's bonus row as the root, level 1's columns moved to
        after the accepted rows (the host packed them at the longest the path can be), the trees."""
        R, K, w, n = g.acc.shape[0], self.depth + 1, self.w, g.acc.shape[1] - 3
        dev = g.acc.device
        toks, pos, count = tree_verify.accepted_rows(g.acc, K)  # [R, K], [R, K], [R]
        ctx.tokens[:R * K] = toks.view(-1)
        r = torch.arange(R, device=dev)
        state = self._accept_pass(ctx, g.features, (pos + (r * (n + 1))[:, None]).view(-1))  # [R K, ...] each
        root = r * K + (count - 1).clamp_min(0)  # [R] (padding requests: count 0)
        for buf, s in zip(g.roots, state):
            buf.copy_(s[root])
        # level 1 after each real request's accepted rows (padding requests: seq_len 0, kept)
        S = ctx.seq_len[:R]  # [R] committed + K
        real = S > 0
        L = torch.where(real, S - K + count, 0)[:, None].expand(R, w)  # [R, w] committed columns after the accepts
        col = L + torch.arange(w, device=dev)  # [R, w]
        bs = self.pool.block_size
        slot = level.block_tables[:R].gather(1, col // bs) * bs + col % bs
        keep = real[:, None].expand(R, w).reshape(-1)
        for field, value in ((level.positions, L), (level.row_prefix, L), (level.row_base, L), (level.slots, slot)):
            field[:R * w] = torch.where(keep, value.reshape(-1), field[:R * w])
        level.seq_len[:R] = torch.where(real, L[:, 0] + w, level.seq_len[:R])
        return self._device_tree(level, g.roots, R, self.n_graph)

    def _accept_feature_width(self) -> int | None:
        """Width of the target features a run_accepts row reads (None: none, a draft model)."""
        return None

    def _accept_pass(self, rows: BatchRows, features: torch.Tensor | None, feature_rows: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
        """The draft's pass over run_accepts' rows (feature_rows [M]: the row of `features` each
        reads) -> every row's root state [M, ...] (as `_roots` gives it: logits first)."""
        return (self.model.forward(rows),)  # [M, V] (every row's logits: the rows want them)

    def _keep_roots(self, rids: list[str], roots: tuple[torch.Tensor, ...]) -> None:
        """The requests' next roots' state ([R, ...] each, in rids' order), for `_roots`."""
        for i, rid in enumerate(rids):
            self.root_logits[rid] = roots[0][i]

    # ---- what differs between drafters --------------------------------------------------------
    def _roots(self, live: list[tuple[str, list[int], int]]) -> tuple[torch.Tensor, ...]:
        """Each request's root state: its distribution [R, V] (the catch-up pass over what it has not seen)."""
        return (self._catch_up([(rid, toks) for rid, toks, _ in live]),)

    def _root_specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape past R, dtype) of each tensor of `_roots`'s state."""
        return [((self.draft.config.vocab_size,), self.draft.dtype)]

    def _level(self, rows: BatchRows, parent_row: torch.Tensor | None, roots: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """A level's pass over its fed rows -> logits [R * w, V]; parent_row [R, w]: the previous
        level's row each fed node hangs from (None: the root's)."""
        return self.model.forward(rows)

    def _to_target(self, tok: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's."""
        d2t = self._d2t()
        return tok if d2t is None else tok + d2t[tok]

    def _d2t(self) -> torch.Tensor | None:
        """The draft-to-target table (target = draft + d2t[draft]); None: one vocabulary."""
        return None


class BatchedChainDrafter(BatchedTreeDrafter):
    """Chains of k draft tokens for every request. A greedy chain is the width-1 level tree (on
    a GPU one captured graph a step, as any tree); a sampled chain draws each token from the
    draft's processed distribution q with the request's generator, one batched pass per position."""

    runs_accepts = False  # (its steps are never verified on the device)

    def __init__(self, draft, num_blocks: int, block_size: int, k: int, max_seqs: int | None = None,
                 max_seq_blocks: int | None = None, use_graphs: bool | str | None = None):
        super().__init__(draft, num_blocks, block_size, 1, max(k, 1), max_seqs, max_seq_blocks, use_graphs, nodes=k)

    @torch.no_grad()
    def propose(self, chains: list[tuple[str, list[int], int]],
                sampled: dict[str, tuple[SamplingConfig, torch.Generator]] | None = None) -> dict[str, DraftTree]:
        """chains: (request id, every token so far (the root last), chain length k >= 0) ->
        request id -> the chain [root, d1 .. dk] with cumulative draft log-probs: greedy, or for
        the requests in `sampled` each token drawn from the draft's processed distribution q
        with the request's generator, q kept with the tree (row i: what node i was drawn from)."""
        sampled = sampled or {}
        greedy = [c for c in chains if c[0] not in sampled]
        out = super().propose(greedy) if greedy else {}
        drawn = [c for c in chains if c[0] in sampled]
        if drawn:
            out.update(self._sampled_chains(drawn, sampled))
        return out

    def _sampled_chains(self, chains: list[tuple[str, list[int], int]],
                        sampled: dict[str, tuple[SamplingConfig, torch.Generator]]) -> dict[str, DraftTree]:
        """The sampled chains: position j of every chain in one batched pass (j = 1 .. k)."""
        out, live = split_drafted(chains)
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
