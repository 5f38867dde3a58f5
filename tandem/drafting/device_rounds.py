"""Best-first expansion rounds that run on the device, many per host sync.

The host-driven loop (EvolvingTree.expand) pays one device sync per round: the host reads
the w best children of every fed node before it can pick the next w candidates. With a small
draft that sync, the mask built in Python and the step's launch cost more than the draft's
math. Here the whole round is tensor code over fixed-size state, so R rounds are R launches of
one CUDA graph (eager ops on the CPU) and one read back at the end:

    idx   = top-w candidates by cumulative log-prob          [w]
    rows  = tree_len + arange(w); anc[rows] = anc[parent row] | onehot(rows)
    mask  = prefix columns | anc[rows] over the tree region  [w, width]
    logits = draft(tok[idx] at root_pos + depth, mask)       [w, vocab]
    the w best children of each fed node become candidates  (w*w new nodes)

Node order matches the host loop's (the children of the j-th fed node in top-k order, fed
nodes in selection order), so the host tree read back is the one `expand` would have built up
to ties in log-prob. Children with probability 0 are kept as nodes with log-prob -inf (the
host never selects them). The state lives in static buffers so the graph can be replayed; the
host tree (tandem.drafting.evolving.EvolvingTree) stays the source of truth between passes:
`load` uploads it, `run` expands, `fetch` writes the result back into it.
"""
from __future__ import annotations

import numpy as np
import torch

from tandem.kernels.resident import topk_logprobs
from tandem.runtime.runner import ModelRunner


# A candidate's score is its log-prob, but never below this: a child of probability 0 (log-prob
# -inf) must still outrank the unused node slots (score -inf), so the top-k of a round never
# picks a slot that holds no node.
SCORE_FLOOR = -1e30


class DeviceRounds:
    def __init__(self, runner: ModelRunner, width: int, max_nodes: int, max_rows: int):
        self.runner, self.w = runner, width
        self.nc, self.f = max_nodes, max_rows  # node slots, tree-region rows
        dev = runner.device
        # One long and one float block, so `load` is three copies. Rows of `ints`: token, parent
        # node (-1 root), depth below the root, tree row if fed (-1 not), and the counters
        # prefix_len, tree_len, nodes in the first three columns of the last row.
        self.ints = torch.zeros(5, max_nodes, dtype=torch.long, device=dev)  # [5, NC]
        self.tok, self.par, self.dep, self.row = self.ints[:4]
        self.counters = self.ints[4, :3]
        self.flts = torch.zeros(2, max_nodes, dtype=torch.float32, device=dev)  # [2, NC]
        self.lp, self.score = self.flts  # cumulative log-prob; lp for candidates, -inf otherwise
        # anc[r]: tree rows of the node fed at row r and of its ancestors; row F is the root's (none)
        self.anc = torch.zeros(max_rows + 1, max_rows, dtype=torch.bool, device=dev)  # [F + 1, F]
        self._incr = torch.tensor([width, width * width], device=dev)  # tree_len, nodes per round
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._use_graphs = runner.use_graphs and not runner.emulate
        self._synced = -1  # the host tree version the device state equals (-1: none)

    # ---- host <-> device --------------------------------------------------------------------
    def load(self, tree, root_logits: torch.Tensor | None = None) -> None:
        """Upload the host tree (an EvolvingTree with a fed root and no pending tokens).

        root_logits: [vocab] the root's logits when its children are not added yet (the tree is
        the root alone): they are added here, on the device, as the host would add them."""
        if root_logits is None and tree.version == self._synced:
            return  # the device state is the host tree already (fetched, nothing changed since)
        n, cache, F = len(tree.tokens), tree.cache, self.f
        anc = np.zeros((F + 1, F), dtype=bool)
        ints = np.zeros((5, self.nc), dtype=np.int64)
        ints[3] = -1
        ints[:4, :n] = [tree.tokens, tree.parents, tree.depth, tree.row]
        ints[4, :3] = cache.prefix_len, cache.tree_len, n
        flts = np.full((2, self.nc), -np.inf, dtype=np.float32)
        flts[0, :n] = tree.logp
        for i in range(1, n):  # topological order: a fed node's row is its parent's row plus itself
            r = tree.row[i]
            if r >= 0:
                p = tree.row[tree.parents[i]]
                anc[r] = anc[p if p >= 0 else F]
                anc[r, r] = True
            else:
                flts[1, i] = max(tree.logp[i], SCORE_FLOOR)  # a candidate
        self.ints.copy_(torch.from_numpy(ints))
        self.flts.copy_(torch.from_numpy(flts))
        self.anc.copy_(torch.from_numpy(anc))
        if root_logits is not None:
            assert n == 1, "deferred root children with a grown tree"
            w = self.w
            clp, ctok = topk_logprobs(root_logits, w)  # [w] each
            self.tok[1:1 + w] = ctok
            self.par[1:1 + w] = 0
            self.dep[1:1 + w] = 1
            self.lp[1:1 + w] = clp
            self.score[1:1 + w] = clp.clamp(min=SCORE_FLOOR)
            self.counters[2] = 1 + w

    def fetch(self, tree, rounds: int, extra: int = 0) -> None:
        """Write `rounds` device rounds (and `extra` nodes added by `load`) back into the host
        tree and its cache's tree_len."""
        n1 = len(tree.tokens) + extra + rounds * self.w * self.w
        tree.tokens, tree.parents, tree.depth, tree.row = self.ints[:4, :n1].tolist()  # the sync
        tree.logp = self.lp[:n1].tolist()
        tree.cache.tree_len += rounds * self.w
        tree.steps += rounds
        self._synced = tree.touch()

    # ---- the round -----------------------------------------------------------------------------
    def rounds_possible(self, tree, extra: int = 0) -> int:
        """How many rounds fit in the node slots (`extra` of them taken by `load`), the row cap
        and the cache."""
        w, cache = self.w, tree.cache
        by_nodes = (self.nc - len(tree.tokens) - extra) // (w * w)
        by_rows = (self.f - cache.tree_len) // w
        by_cache = (self.runner.capacity - cache.length) // w
        return max(0, min(by_nodes, by_rows, by_cache))

    @torch.no_grad()
    def run(self, tree, rounds: int) -> None:
        """Run `rounds` rounds on the current stream (no host sync); `fetch` reads them back.
        The caller loaded `tree` and checked `rounds_possible` and that >= w candidates exist."""
        if rounds <= 0:
            return
        width = self.runner.width_for(tree.cache.length + rounds * self.w)
        if not self._use_graphs:
            for _ in range(rounds):
                self._round(width)
            return
        if width not in self._graphs:
            self._capture(width)
        graph = self._graphs[width]
        for _ in range(rounds):
            graph.replay()

    def _round(self, width: int) -> None:
        w, dev = self.w, self.ints.device
        prefix, tree_len, nodes = self.counters[0:1], self.counters[1:2], self.counters[2:3]  # [1] each
        _, idx = self.score.topk(w)  # [w] the w most probable candidates
        rows = tree_len + torch.arange(w, device=dev)  # [w]
        prow = self.row[self.par[idx]]  # [w] parent's row, -1 for the root's children
        a = self.anc[torch.where(prow < 0, self.f, prow)]  # [w, F]
        a.scatter_(1, rows[:, None], True)
        self.anc.index_copy_(0, rows, a)
        self.row.index_copy_(0, idx, rows)
        self.score.index_fill_(0, idx, float("-inf"))
        cols = torch.arange(width, device=dev)  # [width] cache columns
        tcol = cols - prefix  # [width] tree-region column, < 0 in the prefix
        in_tree = (tcol >= 0) & (tcol < self.f)
        mask = (a.gather(1, tcol.clamp(0, self.f - 1).expand(w, width)) & in_tree) | (cols < prefix)  # [w, width]
        depth = self.dep[idx]  # [w]
        logits = self.runner.model(self.tok[idx][None], (prefix - 1 + depth)[None], self.runner.cache,
                                   (prefix + rows)[None], mask[None, None])[0]  # [w, vocab]
        clp, ctok = topk_logprobs(logits, w)  # [w, w] each
        new = nodes + torch.arange(w * w, device=dev)  # [w*w]
        child_lp = (self.lp[idx][:, None] + clp).reshape(-1)  # [w*w]
        self.tok.index_copy_(0, new, ctok.reshape(-1))
        self.par.index_copy_(0, new, idx[:, None].expand(w, w).reshape(-1))
        self.dep.index_copy_(0, new, (depth + 1)[:, None].expand(w, w).reshape(-1))
        self.lp.index_copy_(0, new, child_lp)
        self.score.index_copy_(0, new, child_lp.clamp(min=SCORE_FLOOR))
        self.counters[1:3] += self._incr

    def _capture(self, width: int) -> None:
        """Capture one round at this attention width. The warm-up round really runs, on the
        loaded state: it writes the K/V rows just past the cache's length (free rows, as `run`'s
        caller checked) and node slots past the tree; the state is restored afterwards."""
        saved = [t.clone() for t in (self.ints, self.flts, self.anc)]
        s = self.runner.capture_stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._round(width)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.runner.graph_pool(), stream=s):
            self._round(width)
        self._graphs[width] = graph
        for t, v in zip((self.ints, self.flts, self.anc), saved):
            t.copy_(v)
