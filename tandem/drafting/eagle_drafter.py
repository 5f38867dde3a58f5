"""Drafting with an EAGLE-3 head (tandem.models.eagle3): a dynamic tree, one host sync per tree.

Per target pass:

1. **Context pass.** The tokens committed since the head's last pass (the root last), each with
   fc(target features of the position before it), run through the head in one step of its own
   runner (a CUDA graph per row bucket on the GPU) and join its KV prefix. The root's row gives
   the first level's distribution and the hidden state its children read.
2. **Levels** (EAGLE-2's dynamic tree). Level 1 is the root's top-w children. At each level the
   w best new nodes by cumulative log-prob are fed to the head (w rows, each reading its parent's
   output hidden and attending to the prefix and its ancestors' rows), and each gives its top-w
   children: w * w new nodes. The node layout is fixed by (w, depth), so all levels are tensor
   code over static buffers: one CUDA graph on the GPU (eager on the CPU), then one read back.
3. **Selection.** The N nodes of highest cumulative log-prob, ties to the earlier node, form the
   DraftTree. It is prefix-closed: a child's log-prob never exceeds its parent's, and a parent
   has the smaller index.

`chain` is the same with w = 1 and depth k: the head's greedy path. The tree rows are dropped
after each proposal; the context rows stay in the head's cache.
"""
from __future__ import annotations

import numpy as np
import torch

from tandem.config import SpecConfig
from tandem.kernels.head_level import LevelGlue
from tandem.kernels.resident import topk_logprobs
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree
from tandem.verify.verifier import VerifyResult

CHUNK = 128  # context rows per head step (the runner's largest bucket)


class HeadLevels:
    """The tree levels of one (w, depth) shape on the head's runner, over static buffers.

    Node layout: nodes [0, w) are the root's children (level 1); level d >= 2 holds w * w nodes
    from base(d) = w + (d - 2) * w * w, child j of the s-th fed node of level d - 1 at
    base(d) + s * w + j. The s-th fed node of level d writes tree row (d - 1) * w + s.
    """

    def __init__(self, runner: ModelRunner, width: int, depth: int, model=None):
        # model: what the levels call (an Eagle3Head, or a small draft seen as one: DraftAsHead)
        self.runner, self.model = runner, runner.model if model is None else model
        self.w, self.depth = width, depth
        self.passes = depth - 1  # head passes (the last level is never fed)
        self.nodes = width + self.passes * width * width
        self.rows = max(1, self.passes * width)  # tree-region rows
        dev, H = runner.device, self.model.level_hidden_size
        self.root_logits = torch.zeros(self.model.draft_vocab_size, device=dev, dtype=self.model.dtype)
        self.root_hidden = torch.zeros(H, device=dev, dtype=self.model.dtype)
        self.prefix = torch.zeros(1, dtype=torch.long, device=dev)  # the head's prefix length
        self.tok = torch.zeros(self.nodes, dtype=torch.long, device=dev)  # target ids
        self.par = torch.zeros(self.nodes, dtype=torch.long, device=dev)  # parent node, -1 the root
        self.lp = torch.zeros(self.nodes, dtype=torch.float32, device=dev)  # cumulative log-prob
        self.anc = torch.zeros(self.rows, self.rows, dtype=torch.bool, device=dev)  # [R, R] row ancestry
        self.fed = torch.zeros(width, dtype=torch.long, device=dev)  # the nodes fed at the next level
        self.ids = torch.zeros(width, dtype=torch.long, device=dev)  # their target ids
        self.src = torch.zeros(width, dtype=torch.long, device=dev)  # their parents' slots (hidden rows)
        # [3, nodes] tok, par, lp: the one read back. NOTE: a static buffer that every captured
        # width writes (a tensor allocated inside a capture would be that graph's alone)
        self.out = torch.zeros(3, self.nodes, dtype=torch.float64, device=dev)
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)  # the fused top-k's (left zero by it)
        # each level row's position and cache slot past the prefix: level d's rows sit at position
        # prefix - 1 + d (the root is prefix - 1) and at slots prefix + (d - 1) w + s
        self.level_pos = torch.arange(self.passes, device=dev)[:, None].expand(self.passes, width).contiguous()
        self.level_slot = torch.arange(self.passes * width, device=dev).view(self.passes, width)
        # this draft's level rows: prefix + level_pos and prefix + level_slot (the resident loop's context
        # pass writes them in its view kernel: tandem.kernels.resident.context_view's `levels`)
        self.pos_rows = torch.zeros(self.passes, width, dtype=torch.long, device=dev)
        self.slot_rows = torch.zeros(self.passes, width, dtype=torch.long, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._use_graphs = runner.use_graphs and not runner.emulate

    @torch.no_grad()
    def run(self, root_logits: torch.Tensor, root_hidden: torch.Tensor, prefix: int) -> np.ndarray:
        """root_logits: [draft_vocab], root_hidden: [H] of the root's row (the last prefix row).
        Returns [3, nodes] on the host (the one sync)."""
        if prefix + self.passes * self.w > self.runner.capacity:
            raise RuntimeError(f"the head's cache ({self.runner.capacity} rows) cannot hold {prefix} + "
                               f"{self.passes * self.w} rows")
        self.root_logits.copy_(root_logits)
        self.root_hidden.copy_(root_hidden)
        self.prefix.fill_(prefix)
        width = self.runner.width_for(prefix + self.rows)
        if not self._use_graphs:
            self._host_levels(width)
        else:
            if width not in self._graphs:
                self._capture(width)
            self._graphs[width].replay()
        return self.out.cpu().numpy()

    def glue(self, d: int, width: int) -> LevelGlue:
        """Level d's glue over these buffers (d = 0: the root's children)."""
        return LevelGlue(self.model.d2t, self.tok, self.par, self.lp, self.fed, self.ids, self.src, self.anc,
                         self.prefix, d, width, d + 1 < self.depth)

    def _levels(self, width: int, root: tuple[torch.Tensor, ...] | None = None, rows_ready: bool = False) -> None:
        """All levels at this attention width. Per level: the head's pass over the w fed nodes and
        their top-w children (Eagle3Head.layer_topk: with the fused layer, the gather of each fed
        node's parent hidden row and the top-w ride in the pass's kernels), then the glue
        (tandem.kernels.resident.level_step: the new nodes, the next fed nodes, their ancestry and
        the next mask; one program on CUDA).

        root: (log-probs [1, w], draft ids [1, w], hidden [1, H], the mask of level 1 or None) of
        the root's children, when the caller's context pass computed them (the resident loop; the
        mask when that pass ran `glue(0, width)` too); else they come from root_logits and
        root_hidden. rows_ready: pos_rows and slot_rows already hold this draft's level rows."""
        w, model, cache = self.w, self.model, self.runner.cache
        prefix = self.prefix  # [1]
        # positions and cache slots of every level's rows (level d: position prefix - 1 + d).
        # NOTE: a row of its own per node, not an expanded view: the fused kernels read positions
        # by row offset, so a stride-0 view gave rows 1.. of a level the next levels' positions.
        pos, slots = self.pos_rows, self.slot_rows  # [passes, w] each
        if not rows_ready:
            torch.add(prefix, self.level_pos, out=pos)
            torch.add(prefix, self.level_slot, out=slots)
        if root is None:
            lp1, d1 = topk_logprobs(self.root_logits[None], w)  # [1, w] each
            hidden, mask = self.root_hidden[None], None  # [1, H]
        else:
            lp1, d1, hidden, mask = root
        if mask is None:
            mask = self.glue(0, width).run(d1, lp1)
        for d in range(1, self.depth):
            # each fed node reads its parent's output row: hidden[src] (level 1: the root's, src = 0);
            # the level's glue runs in the top-k kernel's merging program
            _, _, hidden, mask = model.layer_topk(self.ids, hidden, pos[d - 1], cache, slots[d - 1], mask, w,
                                                  src=self.src, counter=self.counter,
                                                  glue=self.glue(d, width))  # [w, H], [w, width]

    def _host_levels(self, width: int) -> None:
        """_levels, then the nodes into the one buffer the host reads."""
        self._levels(width)
        self.out[0].copy_(self.tok)
        self.out[1].copy_(self.par)
        self.out[2].copy_(self.lp)

    def _capture(self, width: int) -> None:
        """Capture all levels at this attention width. The warm-up really runs: it writes K/V rows
        past the prefix (free: they are the tree rows) and the state, which every run rewrites."""
        s = self.runner.capture_stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._host_levels(width)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.runner.graph_pool(), stream=s):
            self._host_levels(width)
        self._graphs[width] = graph


class DraftAsHead:
    """A small draft model (a Transformer with the target's vocabulary) seen through the head's
    level interface, so HeadLevels and the resident loop grow its EAGLE-2 tree the same way: a
    level is the whole draft over the w fed nodes. It feeds no hidden state forward (width 0)."""

    level_hidden_size = 0

    def __init__(self, model):
        self.model = model
        self.draft_vocab_size = model.config.vocab_size
        self.dtype = model.dtype
        self.d2t = torch.zeros(self.draft_vocab_size, dtype=torch.long, device=model.device)  # one vocabulary

    def layer_topk(self, ids, hidden, positions, cache, slots, mask, k: int, rows: int | None = None, src=None,
                   counter=None, glue: LevelGlue | None = None):
        """Eagle3Head.layer_topk's contract (hidden and src unused): ids, positions, slots [T], mask
        [T, W] -> the k best children of the last `rows` rows, an empty hidden [rows, 0], and the
        glue's next mask (or None)."""
        T = ids.shape[0]
        rows = T if rows is None else rows
        logits = self.model(ids[None], positions[None], cache, slots[None], mask[None, None])  # [1, T, V]
        lp, tok = topk_logprobs(logits[0, T - rows:], k)
        return lp, tok, logits.new_zeros(rows, 0), None if glue is None else glue.run(tok, lp)



def select_tree(host: np.ndarray, root: int, n: int) -> DraftTree:
    """The n nodes of highest cumulative log-prob (ties: the earlier node), as a DraftTree in node
    order. host: [3, nodes] tok, parent (-1: the root), lp; parents precede their children."""
    tok, par, lp = host[0].astype(np.int64), host[1].astype(np.int64), host[2]
    finite = np.flatnonzero(np.isfinite(lp))
    order = finite[np.lexsort((finite, -lp[finite]))][:n]
    keep = np.sort(order)
    remap = {int(old): new + 1 for new, old in enumerate(keep)}
    remap[-1] = 0
    return DraftTree(tokens=[root] + tok[keep].tolist(), parents=[-1] + [remap[int(par[i])] for i in keep],
                     logp=[0.0] + lp[keep].tolist())


class EagleDrafter:
    needs_features = True

    def __init__(self, runner: ModelRunner, spec: SpecConfig, chain: bool = False):
        self.runner, self.model = runner, runner.model
        self.feature_layers = self.model.target_feature_layers
        if chain:
            width, depth, self.nodes = 1, spec.k, spec.k
        else:
            width, depth, self.nodes = spec.width, spec.resolved_depth(), spec.nodes
        key = ("eagle_levels", width, depth)
        if key not in runner.attached:  # the captured graphs live as long as the runner
            runner.attached[key] = HeadLevels(runner, width, depth)
        self.levels = runner.attached[key]
        self.pending: list[int] = []
        self.pending_hidden: torch.Tensor | None = None  # [len(pending), H]
        self.steps = 0  # head passes (the context pass and each fed level)

    @staticmethod
    def rows_needed(spec: SpecConfig) -> int:
        """Head cache rows beyond the committed tokens: the tree rows of the widest shape."""
        return max(spec.k, spec.width * spec.resolved_depth()) + 1

    def start(self, prompt: list[int], features: torch.Tensor | None = None) -> None:
        """prompt: every prompt token; features: [len(prompt) - 1, F] the target's features of all
        but the last (the root, whose features come with the first target pass)."""
        H = self.model.config.hidden_size
        hidden = torch.zeros(len(prompt), H, device=self.model.device, dtype=self.model.dtype)  # row 0: nothing before
        if features is not None and len(prompt) > 1:
            hidden[1:] = self.model.project(features[-(len(prompt) - 1):])
        self.runner.cache.truncate(0)
        self.pending, self.pending_hidden = list(prompt), hidden

    def propose(self) -> DraftTree:
        cache = self.runner.cache
        logits, T = None, 0
        for i in range(0, len(self.pending), CHUNK):
            ids = self.pending[i:i + CHUNK]
            T, prefix = len(ids), cache.prefix_len
            self.model.set_hidden(self.pending_hidden[i:i + T])
            logits = self.runner.step(ids, list(range(prefix, prefix + T)), torch.ones(T, T, dtype=torch.bool).tril())
            cache.commit(list(range(T)))
            self.steps += 1
        # the root is the last row of the last chunk
        host = self.levels.run(logits[T - 1], self.model.hidden_out[0, T - 1], cache.prefix_len)
        self.steps += self.levels.passes
        root = self.pending[-1]
        self.pending = []
        return select_tree(host, root, self.nodes)

    def observe(self, result: VerifyResult, tree: DraftTree, features: torch.Tensor | None = None) -> None:
        """features: [accepted + 1, F] the target's features of the root and the accepted nodes."""
        if features is None:
            raise RuntimeError("an EAGLE-3 head needs the target's features; enable them on the target")
        self.pending = list(result.tokens)
        self.pending_hidden = self.model.project(features)
