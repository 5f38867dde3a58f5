"""A hybrid draft model (Qwen3.5) behind the runner interface the evolving tree drives.

`EvolvingTree` (tandem.drafting.evolving) feeds a draft's tree round by round and re-roots it
after each verification, keeping the surviving subtree's K/V (`KVCache.commit(path, keep)`). A
hybrid draft's GDN layers have no K/V: their per-sequence state is one recurrent state, and a
tree would need one per node. So the cache here keeps, beside the attention layers' K/V rows:

- the committed `RecurrentState` (after the verified prefix, the root included), and
- per tree-region row, only that row's GDN inputs (`RowInputs`: conv input, k, v, g, beta of
  every GDN layer): what a re-root can reuse without recomputation.

A step runs the new rows' layers once; their GDN layers solve each new row's root path from the
committed state over the stored inputs (`Qwen3_5ForCausalLM.draft_step`, the WY form: a draft's
rounding never reaches the output), so no row is projected twice. A re-root's commit replays the accepted rows' inputs into the committed state and moves
the kept rows' inputs with their K/V; everything else is dropped. The states of tree nodes are
never stored: they are recomputed along the paths, as the hybrid target's verification does.
"""
from __future__ import annotations

import torch

from tandem.kernels.gdn import gdn_replay
from tandem.kv.cache import KVCache
from tandem.models.qwen3_5 import RowInputs


class HybridDraftCache(KVCache):
    """The attention layers' K/V rows, the committed recurrent state, the tree rows' GDN inputs."""

    def __init__(self, model, capacity: int):
        c = model.config
        super().__init__(len(c.attention_layers), c.num_key_value_heads, c.head_dim, capacity, model.dtype,
                         model.device)
        self.model = model
        self.state = model.new_state()
        self.rows: list[RowInputs] | None = None  # per GDN layer, the tree region's rows in row order
        self.parents: list[int] = []  # [tree_len] each tree row's parent row, -1 = the prefix's last row

    def history(self, m: int) -> list[RowInputs] | None:
        """The first m tree rows' inputs (a profile may have dropped rows by lowering tree_len)."""
        if m == 0 or self.rows is None:
            return None
        return [RowInputs(*(t[:, :m] for t in vars(r).values())) for r in self.rows]

    def append(self, record, parents: list[int]) -> None:
        """A step's new rows (their GDN inputs from the step's record) join the m rows before them
        (parents: [m + T] over all of them)."""
        K1 = self.model.config.linear_conv_kernel_dim - 1
        m = len(parents) - record.layers[0].k.shape[1] if record.layers else 0
        new = [RowInputs(r.ext[:, K1 + m:], r.k, r.v, r.g, r.beta) for r in record.layers]
        old = self.history(m)
        self.rows = new if old is None else [
            RowInputs(*(torch.cat([a, b], 1) for a, b in zip(vars(o).values(), vars(n).values())))
            for o, n in zip(old, new)]
        self.parents = list(parents)

    def commit(self, path: list[int], keep: list[int] | None = None) -> None:
        """The accepted rows `path` (tree-relative, root first) join the prefix: their GDN inputs
        are replayed into the committed state, and the rows `keep` stay in the tree region with
        their inputs; then the K/V rows move as in `KVCache.commit`."""
        keep = list(keep or [])
        K1 = self.model.config.linear_conv_kernel_dim - 1
        if path:
            assert self.rows is not None and all(self.parents[b] == a for a, b in zip(path, path[1:]))
            idx = torch.tensor(path, device=self.kv.device)
            for li, r in enumerate(self.rows):
                self.state.delta[li] = gdn_replay(self.state.delta[li], r.k, r.v, r.g, r.beta, path)
                # the conv state: the K - 1 newest conv inputs along [committed | the path]
                ext = torch.cat([self.state.conv[li].transpose(1, 2), r.conv_in[:, idx]], 1)  # [1, K-1+len, C]
                self.state.conv[li] = ext[:, -K1:].transpose(1, 2).contiguous()
        if self.rows is not None and keep:
            kidx = torch.tensor(keep, device=self.kv.device)
            self.rows = [RowInputs(*(t[:, kidx] for t in vars(r).values())) for r in self.rows]
            pos = {old: new for new, old in enumerate(keep)}
            last = path[-1] if path else -2
            # a kept row hangs from the last accepted row (now the prefix's last row) or a kept row
            self.parents = [-1 if self.parents[k] in (last, -1) else pos[self.parents[k]] for k in keep]
        else:
            self.rows, self.parents = None, []
        super().commit(path, keep)

    def drop_tree(self) -> None:
        self.rows, self.parents = None, []
        super().drop_tree()

    def truncate(self, n: int) -> None:
        if n not in (0, self.prefix_len):
            raise ValueError(f"a hybrid draft's cache truncates to 0 or its prefix ({self.prefix_len}), not {n}: "
                             "its recurrent state holds no earlier point")
        if n == 0:
            self.state = self.model.new_state()
        self.rows, self.parents = None, []
        super().truncate(n)


class HybridDraftRunner:
    """`ModelRunner`'s interface (step, prefill, cache, capacity) over a Qwen3.5 draft model, eager."""

    use_graphs = False

    def __init__(self, model, capacity: int):
        self.model, self.capacity = model, capacity
        self.cache = HybridDraftCache(model, capacity)
        self.device = model.device
        self.attached: dict = {}
        self.last_features = None
        self.last_argmax = None

    @torch.no_grad()
    def step(self, tokens: list[int], positions: list[int], tree_mask: torch.Tensor) -> torch.Tensor:
        """Feed len(tokens) rows as new tree-region rows; return their logits [T, vocab].
        tree_mask: [T, tree_len_after] bool over the tree region including the new rows (last T)."""
        T, base = len(tokens), self.cache.tree_len
        assert tree_mask.shape == (T, base + T), (tree_mask.shape, T, base)
        parents = list(self.cache.parents[:base])
        for j in range(T):  # a new row's parent: its deepest ancestor row (rows are in topological order)
            anc = torch.nonzero(tree_mask[j, :base + j]).flatten().tolist()
            parents.append(anc[-1] if anc else -1)
        logits, record = self.model.draft_step(tokens, positions, parents, self.cache.state, self.cache,
                                               self.cache.history(base))
        self.cache.append(record, parents)
        return logits

    @torch.no_grad()
    def prefill(self, tokens: list[int], chunk: int = 512) -> torch.Tensor | None:
        """Append tokens to the verified prefix (one chain pass, committed whole); the last row's
        logits [vocab]."""
        assert self.cache.tree_len == 0, "prefill with a live tree region"
        if not tokens:
            return None
        parents = list(range(-1, len(tokens) - 1))
        logits, record = self.model.tree_forward(tokens, parents, self.cache.state, self.cache, prefill=True)
        self.model.commit_state(self.cache.state, record, list(range(len(tokens))))
        KVCache.commit(self.cache, list(range(len(tokens))))
        return logits[-1]
