"""The device-resident loop: draft, verify, accept and commit stay on the device.

The host-driven loop (generate.py) waits for the device twice per target pass: for the drafter's
lattice (to build the tree) and for the target's argmax (to accept). On a GPU fed by a slow host
that waiting, and the Python between, costs as much as the passes themselves. Here a step is
two CUDA graphs that read and write only device state:

    draft graph:   block drafter: its pass over the pending context rows (the tokens the last
                   step committed, each with the target features of the position before it)
                   and B - 1 mask rows -> the lattice -> the best-first tree over it
                   (tandem.drafting.device_tree) -> its ancestor mask;
                   EAGLE-3 head: its context pass -> its EAGLE-2 levels -> the N best nodes;
                   small draft model: the same, each level a whole draft pass over the fed
                   nodes (eagle_drafter.DraftAsHead)
    verify graph:  the target's pass over the tree -> the accept (greedy: a node is accepted
                   when it and all its ancestors match the target's argmax of their parent;
                   sampled: the rejection walk over the tree, tandem.kernels.resident) -> the
                   path's K/V gathered to the prefix end -> the committed tokens and the path's
                   features become the next pending context, and the step's record

`ar` is the verify graph over a one-node tree. The host queues steps ahead and reads each step's
record (committed tokens, accept count, tree depth) from a pinned ring once the step's event has
fired, so it is at most `LAG` steps behind the device and does not stall it; streaming and stop
strings work on those records. Near a request's end the host holds the next step while the steps
in flight are expected to finish it (HOLD_MARGIN x their count x the request's tokens a step so
far), so few steps are computed past the end (`ar`: none), at the price of a rare stall (the device
idle while the host reads and queues) when the guess was short; TANDEM_RESIDENT_HOLD=0 turns the
hold off (A/B), another number sets the margin.

Graphs are captured per attention width bucket (the runners' `width_for`), lazily; state
tensors live as long as the runners (kept in the target runner's `attached`), so graphs are
reused across requests. On the CPU (tests) the same bodies run eagerly.
"""
from __future__ import annotations

import os
from collections import deque
from functools import partial

import torch

from tandem.config import SamplingConfig, SpecConfig
from tandem.kernels.head_level import head_select, head_topk
from tandem.kernels.resident import (accept_fused, chain_fused, commit_rows, context_view, lattice_cond, sample_walk,
                                     tree_view)
from tandem.drafting.device_tree import best_first_tree_device, chain_tokens
from tandem.drafting.lattice_drafter import CONTEXT_CHUNK
from tandem.runtime.emit import Emitter
from tandem.runtime.runner import ModelRunner
from tandem.runtime.timing import PassClock
from tandem.verify.sampling import probs_from_logits

LAG = 2  # steps queued ahead of the one the host reads
# The hold: the steps in flight are taken to commit HOLD_MARGIN x the request's mean tokens a step. With the
# bundled pair + EAGLE-3 head on 20 MBPP prompts (bench/cpu_passes_past_end.py --holds 1,1.25,1.5,2; CPU counts,
# 2026-12-06), `tree` computed 0.45 / 0.15 / 0 / 0 passes past the end a request and stalled 0.05 / 0.15 /
# 0.25 / 0.65 times: a stall (the host's read and two graph launches) costs a small part of a wasted step.
HOLD_MARGIN = 1.5
FORCED_MAX = 4096  # acceptance replay: recorded counts per request (cycled past this)


class ResidentLoop:
    """Device state and step graphs for one target runner and, for chain / tree, one drafter
    runner (a block drafter's LatticeHead, an EAGLE-3 head or a small draft model) and tree shape."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None = None, spec: SpecConfig | None = None,
                 chain: bool = False):
        self.t, self.d, self.chain = target, draft, chain
        dev = target.device
        lng = dict(dtype=torch.long, device=dev)
        if draft is None:
            self.kind = "ar"
        elif hasattr(draft.model, "drafter"):
            self.kind = "block"
        else:  # an EAGLE-3 head, or a small draft model grown level by level like one
            self.kind = "eagle3" if hasattr(draft.model, "econfig") else "draft"
        if self.kind == "block":
            self.drafter = draft.model.drafter  # the BlockDrafter behind its LatticeHead
            cfg = self.drafter.bconfig
            self.B, self.K = cfg.block_size, cfg.num_candidates
            self.pmax = self.B + 1  # context rows per draft pass: at most the accepted path + bonus
            # (a tree cannot hold more nodes than the lattice has)
            nodes = min(spec.k, self.B) if chain else min(spec.nodes, sum(self.K ** d for d in range(1, self.B + 1)))
            self.T = self.pmax + self.B - 1  # rows of a draft pass: context, then B - 1 mask rows
            self.topk_counter = torch.zeros(1, dtype=torch.int32, device=dev)  # head_topk's (left zero)
            feature_size = cfg.feature_size
        elif self.kind in ("eagle3", "draft"):
            from tandem.drafting.eagle_drafter import DraftAsHead, HeadLevels

            # the Eagle3Head, or the draft model behind the same level interface
            self.drafter = draft.model if self.kind == "eagle3" else DraftAsHead(draft.model)
            width, depth = (1, spec.k) if chain else (spec.width, spec.resolved_depth())
            self.levels = HeadLevels(draft, width, depth, self.drafter)  # level buffers, run inside the draft graph
            self.B = depth  # the deepest node
            self.pmax = depth + 1
            nodes = self.levels.nodes if chain else min(spec.nodes, self.levels.nodes)
            self.T = self.pmax  # a draft pass: the context rows, then the levels (tree rows of their own)
            # (a draft model reads no target features: one unused column keeps the buffers uniform)
            feature_size = 3 * self.drafter.econfig.target_hidden_size if self.kind == "eagle3" else 1
        else:
            self.B, self.pmax, self.T, nodes = 0, 1, 0, 0
        # drafter cache rows one draft pass writes past its prefix (context, mask rows, tree rows)
        self.draft_rows = self.T + (self.levels.rows if self.kind in ("eagle3", "draft") else 0)
        if draft is not None:
            self.ctx_feat = torch.zeros(self.pmax, feature_size, device=dev, dtype=target.model.dtype)  # [pmax, F]
        self.M = nodes + 1  # tree nodes, root included
        # ---- state (device) -------------------------------------------------------------
        self.prefix = torch.zeros(1, **lng)  # the target's verified rows
        self.dprefix = torch.zeros(1, **lng)  # the drafter's
        self.P = torch.ones(1, **lng)  # pending context rows (the root last)
        self.ctx_tok = torch.zeros(self.pmax, **lng)  # [pmax] pending context tokens, right-aligned
        self.tree_tok = torch.zeros(self.M, **lng)  # [M] root first, topological order
        self.tree_par = torch.full((self.M,), -1, **lng)
        self.tree_depth = torch.zeros(self.M, **lng)
        self.anc = torch.eye(self.M, dtype=torch.bool, device=dev)  # [M, M]
        self.rec = torch.zeros(3 + self.pmax, **lng)  # the step's record: P, accepted, depth, tokens
        if draft is None:  # ar: every record is (1, 0, 0, token)
            self.rec[0] = 1
        elif chain and self.kind == "block":  # a chain's shape never changes: only its tokens are drafted
            self.tree_par.copy_(torch.arange(-1, self.M - 1))
            self.tree_depth.copy_(torch.arange(self.M))
            self.anc.copy_(torch.ones(self.M, self.M, dtype=torch.bool).tril())
        # the accept's outputs: K/V rows to move (source, destination) and each context entry's node
        self.kv_src = torch.zeros(self.pmax, **lng)
        self.kv_dst = torch.zeros(self.pmax, **lng)
        self.node = torch.zeros(self.pmax, **lng)
        # sampling (None: greedy): the walk's output per node, its Philox seed (CUDA) or generator (CPU)
        self.sampling: SamplingConfig | None = None
        self.am = torch.zeros(self.M, **lng)
        self.seed = torch.zeros(1, **lng)
        self.generator: torch.Generator | None = None
        # acceptance replay (simulated acceptance, bench --replay): each pass accepts the recorded
        # count along one path of the tree (as deep as it goes), whatever the target says
        self.replay = False
        self.stalls = 0  # run(): steps queued after the device ran dry, in the last request
        self.forced = torch.zeros(FORCED_MAX, **lng)  # the recorded counts, cycled
        self.fstep = torch.zeros(1, **lng)
        # ---- constants -------------------------------------------------------------------
        self.ar_M = torch.arange(self.M, **lng)
        self._cols: dict[int, torch.Tensor] = {}
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.use_graphs = target.use_graphs and not target.emulate and dev.type == "cuda"

    def _state(self) -> list[torch.Tensor]:
        s = [self.prefix, self.dprefix, self.P, self.ctx_tok, self.tree_tok, self.tree_par, self.tree_depth,
             self.anc, self.rec]
        s += [self.kv_src, self.kv_dst, self.node, self.am, self.seed, self.fstep]
        return s + ([self.ctx_feat] if self.d is not None else [])

    def cols(self, width: int) -> torch.Tensor:
        if width not in self._cols:
            self._cols[width] = torch.arange(width, device=self.t.device)
        return self._cols[width]

    # ---- the step's two bodies --------------------------------------------------------------
    def _draft_body(self, width: int) -> None:
        if self.kind in ("eagle3", "draft"):
            self._draft_levels(width)
        else:
            self._draft_block(width)

    def _context_view(self, width: int, levels: tuple[torch.Tensor, ...] | None = None):
        """Positions [T], slots [T] and the mask [T, W] of a draft pass whose real rows (the P context
        rows, right-aligned, then any mask rows) are causal after the drafter's prefix
        (tandem.kernels.resident.context_view: one program on CUDA; with `levels`, it also advances
        the drafter's prefix and writes the levels' rows)."""
        dev, T = self.t.device, self.T
        out = (torch.empty(T, dtype=torch.long, device=dev), torch.empty(T, dtype=torch.long, device=dev),
               torch.empty(T, width, dtype=torch.bool, device=dev))
        context_view(self.P, self.dprefix, self.pmax, T, width, self.d.scratch, out, levels)
        return out

    def _draft_levels(self, width: int) -> None:
        head, lv = self.drafter, self.levels
        # the context pass's rows; the same program advances the drafter's prefix past them (lv.prefix:
        # the levels' prefix) and writes every level row's position and slot
        pos, slots, see = self._context_view(width, (lv.prefix, lv.level_pos, lv.level_slot, lv.pos_rows,
                                                     lv.slot_rows))
        # a head's row i reads fc(target features of position i - 1) (EagleDrafter's context pass)
        hidden = head.project(self.ctx_feat) if self.kind == "eagle3" else None  # [pmax, H]
        # the context pass; the root (its last row) gives the first level's children and hidden, and
        # (its top-k kernel's merging program) the first level's glue
        root = head.layer_topk(self.ctx_tok, hidden, pos, self.d.cache, slots, see, lv.w, rows=1,
                               counter=lv.counter, glue=lv.glue(0, width))  # [1, w], [1, w], [1, H], [w, width]
        lv._levels(width, root, rows_ready=True)  # EAGLE-2's dynamic levels over the head's tree rows
        # the N nodes of highest cumulative log-prob, ties to the earlier node (eagle_drafter.select_tree)
        head_select(lv.lp, lv.tok, lv.par, self.ctx_tok[self.pmax - 1:], lv.w, self.B, self.M - 1,
                    (self.tree_tok, self.tree_par, self.tree_depth, self.anc))

    def _draft_block(self, width: int) -> None:
        # Rows are right-aligned: [padding | the P context rows, the root last | B - 1 mask rows],
        # so the root's row is always row pmax - 1 and the mask rows follow it, as in the host
        # loop's pass (the Markov head conditions row i on row i - 1's candidates). In the
        # cache the P + B - 1 real rows go to dprefix.. (the mask rows are overwritten next
        # step); padding rows write the scratch row and see column 0 only.
        P = self.P
        pos, slots, see = self._context_view(width)
        drafter, last = self.drafter, self.pmax - 1
        x = drafter.input_rows(self.ctx_tok, self.ctx_feat, self.T)  # [T, H] context rows, then mask rows
        x, delta = drafter.residual(x[None], pos[None], self.d.cache, slots[None], see[None, None])  # [1, T, H]
        # only the root's row and the mask rows need the final norm, the LM head and the lattice (B of
        # T rows): the norm, the head and each row's top K in one launch on CUDA (head_topk), then the
        # parent-conditioned log-probs
        _, lp, tok, _ = head_topk(x[0, last:], delta[0, last:], drafter.norm.weight, drafter.norm.eps,
                                  drafter.shared["lm_head"].weight, self.K, self.topk_counter)  # [B, K] each
        root = self.ctx_tok[self.pmax - 1:]  # [1]
        cond = lattice_cond(tok, lp, root, drafter.markov_u, drafter.markov_v)  # [B, K, K]
        if self.chain:  # the shape is constant (set in __init__): only the tokens change
            if not chain_fused(tok, root, cond, self.M - 1, self.tree_tok):  # (one launch on CUDA)
                self.tree_tok.copy_(chain_tokens(tok, cond, root, self.M - 1))
        else:
            best_first_tree_device(tok, cond, root, self.M - 1, (self.tree_tok, self.tree_par, self.tree_depth, self.anc))
        self.dprefix.add_(P)

    def _verify_body(self, width: int) -> None:
        pre, M = self.prefix, self.M
        model = self.t.model
        cols = self.cols(width)
        if self.d is None:  # ar: the tree is the root alone
            logits = model(self.ctx_tok[None], pre[None], self.t.cache, pre[None], (cols <= pre)[None, None, None])
            bonus = self._next(logits[0])[:1]  # [1]
            self.ctx_tok.copy_(bonus)
            self.rec[3:].copy_(bonus)
            self.prefix.add_(1)
            return
        dev = self.t.device
        pos, slots, see = (torch.empty(M, dtype=torch.long, device=dev), torch.empty(M, dtype=torch.long, device=dev),
                           torch.empty(M, width, dtype=torch.bool, device=dev))
        tree_view(pre, self.tree_depth, self.anc, width, (pos, slots, see))  # the prefix and each node's ancestors
        logits = model(self.tree_tok[None], pos[None], self.t.cache, slots[None], see[None, None])  # [1, M, V]
        am = self._next(logits[0])  # [M] the next token after each node (greedy: the argmax)
        if self.replay:
            am = self._forced_path(am, logits[0])
        # accept (a node whose ancestors all match their parent's choice), the next context, the record
        accept_fused(am, self.tree_tok, self.tree_par, self.tree_depth, self.anc, self.prefix, self.pmax,
                     {"kv_src": self.kv_src, "kv_dst": self.kv_dst, "node": self.node, "ctx": self.ctx_tok,
                      "P": self.P, "rec": self.rec})
        # the path's K/V rows to the prefix end (kv [2, layers, 1, kv_heads, rows, D]) and, for a feature
        # drafter, each context token's target features: those of the node before it (ctx_feat has the
        # target's dtype: the features land without a cast); one launch on CUDA
        feats = None if self.kind == "draft" else model.last_features[0]
        commit_rows(self.t.cache.kv, self.kv_src, self.kv_dst, feats, self.node, self.ctx_feat)

    def _forced_path(self, am: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Acceptance replay (greedy): am [M] rewritten so that the accept takes the recorded
        count of nodes along the path to the first node at that depth (or at the tree's deepest):
        each path node's parent 'chooses' it, and the last node's bonus is the target's best
        token that is none of its children (so the path stops there). logits: [M, V]."""
        M = self.M
        f = self.forced.index_select(0, self.fstep % FORCED_MAX)  # [1]
        depth = self.tree_depth
        want = torch.minimum(f, depth.max())  # [1]
        leaf = torch.where(depth == want, self.ar_M, M).min()  # [] the first node at that depth
        onpath = self.anc.index_select(0, leaf[None])[0] & (self.ar_M > 0)  # [M] the path below the root
        # the leaf's bonus: its argmax, or its second choice when a child holds the argmax
        top2 = logits.index_select(0, leaf[None])[0].topk(2).indices  # [2]
        clash = ((self.tree_par == leaf) & (self.tree_tok == top2[0])).any()
        bonus = torch.where(clash, top2[1], top2[0])
        ext = torch.cat([am, am.new_zeros(1)])  # [M + 1] (slot M takes the writes of the other nodes)
        ext.scatter_(0, torch.where(onpath, self.tree_par, M), self.tree_tok)
        ext.index_copy_(0, leaf[None], bonus[None])
        self.fstep.add_(1)
        return ext[:M]

    def _next(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [M, V] -> [M] the token after each node: the argmax (greedy), or the tokens the
        sampled walk chose (recursive rejection sampling over the tree's point-mass drafts: lossless)
        along its path, -1 elsewhere, so the greedy accept yields the walk's path and bonus."""
        if self.sampling is None:
            return logits.argmax(-1)
        sample_walk(probs_from_logits(logits, self.sampling), self.tree_tok, self.tree_par, self.seed,
                    self.generator, self.am)
        return self.am

    # ---- graphs ----------------------------------------------------------------------------
    def _run(self, part: str, width: int) -> None:
        runner = self.d if part == "draft" else self.t
        body = partial(self._draft_body if part == "draft" else self._verify_body, width)
        if not self.use_graphs:
            with torch.no_grad():
                body()
            return
        # (temperature and top-p are baked into a captured graph)
        key = (part, width, None if self.sampling is None else (self.sampling.temperature, self.sampling.top_p),
               self.replay)
        if key not in self._graphs:
            self._graphs[key] = self._capture(runner, body)
        self._graphs[key].replay()

    @torch.no_grad()
    def _capture(self, runner: ModelRunner, body) -> torch.cuda.CUDAGraph:
        saved = [t.clone() for t in self._state()]  # the warm-up runs the body for real: undo it
        s = runner.capture_stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # Triton compilation, cuBLAS handles
                body()
        torch.cuda.current_stream().wait_stream(s)
        for t, v in zip(self._state(), saved):
            t.copy_(v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=runner.graph_pool(), stream=s):
            body()
        return graph

    # ---- a request ---------------------------------------------------------------------------
    @torch.no_grad()
    def feed_prompt(self, prompt: list[int], features: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
        """Feed the drafter the prompt's context rows (host steps, in chunks) until at most one
        step's worth is left; returns those rows' tokens and target features [n, F] for `start`.
        features: [len(prompt) - 1, F] the target's of all but the last token (row i of the
        drafter reads the features of position i - 1; row 0 reads zeros)."""
        runner = self.d
        feats = torch.zeros(len(prompt), self.ctx_feat.shape[1], device=self.ctx_feat.device, dtype=self.ctx_feat.dtype)
        if features is not None and len(prompt) > 1 and self.kind != "draft":  # (a draft model reads none)
            feats[1:] = features[-(len(prompt) - 1):]
        runner.cache.truncate(0)
        done = 0
        while len(prompt) - done > self.pmax:
            c = min(CONTEXT_CHUNK, len(prompt) - done - self.pmax)
            part, start = feats[done:done + c], runner.cache.prefix_len
            if self.kind == "block":
                self.drafter.feature_in[0, :c].copy_(part)
            elif self.kind == "eagle3":
                self.drafter.set_hidden(self.drafter.project(part))
            runner.step(prompt[done:done + c], list(range(start, start + c)), torch.ones(c, c, dtype=torch.bool).tril())
            runner.cache.commit(list(range(c)))
            done += c
        return prompt[done:], feats[done:]

    def start(self, prefix: int, dprefix: int, ctx: list[int], feats: torch.Tensor | None,
              sampling: SamplingConfig | None = None, forced_accepts: list[int] | None = None) -> None:
        """The state after the prompt: the target's and drafter's prefixes, the pending context
        (<= pmax tokens, the root last) and its features [len(ctx), F]; `sampling` (None or
        greedy: argmax) seeds the walk from `sampling.seed`; `forced_accepts` replays recorded
        accept counts (cycled, as the host loop's replay does)."""
        self.replay = forced_accepts is not None and self.d is not None
        if self.replay:
            counts = list(forced_accepts) or [0]
            self.forced.copy_(torch.tensor([counts[i % len(counts)] for i in range(FORCED_MAX)]))
            self.fstep.zero_()
        if not 1 <= len(ctx) <= self.pmax:
            raise ValueError(f"{len(ctx)} pending rows; the loop takes 1 to {self.pmax}")
        self.sampling = None if sampling is None or sampling.greedy else sampling
        if self.sampling is not None:
            self.seed.fill_(sampling.seed % (1 << 62))
            self.generator = torch.Generator().manual_seed(sampling.seed)  # the CPU path: the host loop's draws
        self.prefix.fill_(prefix)
        self.dprefix.fill_(dprefix)
        self.P.fill_(len(ctx))
        pad = self.pmax - len(ctx)  # right-aligned (see _draft_body)
        self.ctx_tok.copy_(torch.tensor([0] * pad + ctx))
        if self.d is not None:
            self.ctx_feat.zero_()
            if feats is not None:
                self.ctx_feat[pad:].copy_(feats)

    def run(self, emitter: Emitter, prefix: int, dprefix: int, pending: int) -> tuple[int, float, float]:
        """Queue steps until the emitter is done; returns (steps, draft seconds, verify seconds),
        the seconds measured on the device (CUDA events) or on the host (CPU)."""
        clock = PassClock(self.t.device)  # before the draft, between the graphs, after the record's copy
        ring = torch.zeros(LAG + 2, self.rec.shape[0], dtype=torch.long, pin_memory=clock.cuda)
        inflight: deque = deque()  # (ring slot, the event after its record's copy; None on the CPU)
        t_base, d_base, last_p = prefix, dprefix, pending
        steps = slot = 0
        queueing, finished = True, False
        read = committed = 0  # steps read back and the tokens they committed (this request)
        self.stalls = 0  # steps queued after the device ran dry (the last request's count: a diagnostic)
        margin = hold_margin()  # the hold below; 0: off
        while queueing or inflight:
            # near the request's end, hold the next step while the ones in flight are expected to
            # finish it: a step queued past the end still runs (the request waits for it, and the
            # next one behind it) and is thrown away; at 7 tokens a step that was two of a
            # request's ~19 steps. Holding costs a read-back's gap (a stall) when the guess was
            # short, a wasted step costs a whole step, so the guess leans to holding (HOLD_MARGIN).
            # Each step commits at least one token (`ar`: exactly one, so it never wastes a step).
            hold = margin > 0 and bool(inflight) and margin * len(inflight) * max(1.0, committed / max(read, 1)) >= \
                emitter.max_new - len(emitter.out)
            if queueing and not hold:
                ahead = len(inflight) + 1
                need_v = t_base + ahead * self.pmax + max(self.M, self.pmax)
                need_d = d_base + last_p + ahead * self.pmax + self.draft_rows
                if need_v > self.t.capacity or (self.d is not None and need_d > self.d.capacity):
                    queueing = False  # the caches are full (the request's end is already queued)
                else:
                    if steps and not inflight:
                        self.stalls += 1  # the device had nothing queued: it idles while the host queues this one
                    clock.mark()
                    if self.d is not None:
                        self._run("draft", self.d.width_for(need_d))
                    clock.mark()
                    self._run("verify", self.t.width_for(need_v))
                    ring[slot].copy_(self.rec, non_blocking=clock.cuda)
                    clock.mark()
                    inflight.append((slot, clock.marks[-1] if clock.cuda else None))
                    slot = (slot + 1) % ring.shape[0]
                    steps += 1
            # read the oldest record when it must be (LAG steps queued, or nothing left to queue)
            # or already can be (its event fired: streaming and TTFT do not wait for the lag)
            if inflight and (len(inflight) > LAG or not queueing or hold or (clock.cuda and inflight[0][1].query())):
                s, done = inflight.popleft()
                if done is not None:
                    done.synchronize()
                if finished:
                    continue  # past the end: drained, not emitted
                rec = ring[s].tolist()
                p, accepted, depth = rec[0], rec[1], rec[2]
                read, committed = read + 1, committed + p
                t_base += p
                d_base += last_p
                last_p = p
                if emitter.emit_pass(rec[len(rec) - p:], accepted, range(1, depth + 1)):
                    queueing, finished = False, True
        draft_s, verify_s = clock.totals()  # every step is done: the last one was synchronized
        return steps, draft_s, verify_s


def hold_margin() -> float:
    """HOLD_MARGIN, or TANDEM_RESIDENT_HOLD (a number; 0 turns the hold off: LAG steps past the end, as before)."""
    raw = os.environ.get("TANDEM_RESIDENT_HOLD")
    if raw is None:
        return HOLD_MARGIN
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise ValueError(f"TANDEM_RESIDENT_HOLD={raw!r} is not a number; use 0 (off) or a margin such as 1.5") from None


def resident_loop(target: ModelRunner, draft: ModelRunner | None, spec: SpecConfig, chain: bool) -> ResidentLoop:
    """The loop kept for these runners and this tree shape (its graphs outlive requests)."""
    key = ("resident", chain, spec if draft is not None else None)
    held = target.attached.get(key)
    if held is None or held[0] is not draft:
        held = target.attached[key] = (draft, ResidentLoop(target, draft, spec, chain))
    return held[1]
