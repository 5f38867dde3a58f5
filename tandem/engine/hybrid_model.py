"""The batched engine's pass for a hybrid target (Qwen3.5): one pass over every request's rows.

What the engine asks of its target model (BatchedModel's interface: `rows`, `forward`,
`last_features`, `warmup`), for a model whose Gated DeltaNet (GDN) layers keep a recurrent
state per request (tandem.kv.hybrid_pool.HybridKVPool) rather than K/V:

    x = embed(tokens)                                   [1, M, hidden]: every request's rows
    per layer:
      attention: q/k/v, norms, RoPE and the output gate over all M rows at once; the new K/V
                 stored at the rows' slots; paged attention under each row's mask
      GDN:       per request, or per group of requests whose trees have one shape: their rows
                 from their committed states (a prefill chunk: the chunked WY form; a tree: every
                 root path, the target's tree kernel) -> the call's pass record
      MLP over all M rows
    logits of the logit rows

The projections, attention and MLPs are batched across requests; a GDN call batches only the
requests whose trees share a shape (one-row decodes, full chains), as each walks its own tree
from its own state. The pass leaves each request's record in the pool, and the pool's commit
replays the accepted path into its slot.

Not here (the engine turns them off for hybrid targets): CUDA graphs (a request's GDN call
depends on its tree's shape), the device-token feed of async scheduling, device verification.
"""
from __future__ import annotations

import torch

from tandem.engine.batched_model import BatchRows, PackColumns, paged_attention_ref
from tandem.kernels import paged_attention as pk
from tandem.kv.hybrid_pool import HybridKVPool
from tandem.models.qwen3_5 import _Pass, _rotate


class HybridRows:
    """A pass's packed rows (BatchRows: tokens, positions, slots, masks) and, per request, what
    its GDN layers need: its sequence id and its empty pass record."""

    def __init__(self, batch: BatchRows, seq_ids: list[str], records: list):
        self.batch, self.seq_ids, self.records = batch, seq_ids, records


class HybridBatchedModel:
    def __init__(self, model, pool: HybridKVPool, features: bool = True):
        model.check_gdn_kernel()
        self.model, self.pool = model, pool
        self.features = features  # keep the target's features (a feature drafter reads them)
        self._features: torch.Tensor | None = None
        self.tile_rows = pk.tile_rows(model.config.num_attention_heads, model.config.num_key_value_heads)

    def warmup(self, max_rows: int) -> None:
        """(No graphs to capture.)"""

    def rows(self, cols: PackColumns) -> HybridRows:
        """cols: the engine's columns with `seq_ids` (one per request) and `parents` (every tree's,
        tree-local, in row order); a causal request (prefix -1) is a prefill chunk."""
        if cols.seq_ids is None or cols.parents is None:
            raise ValueError("a hybrid target's pass needs each request's sequence id and its trees' parents")
        batch = BatchRows.build(cols, self.model.device, self.model.dtype, self.pool.block_size,
                                tile_rows=self.tile_rows, scratch=self.pool.scratch_slot)
        records, at = [], 0
        for T, prefix in zip(cols.new_rows, cols.prefix):
            if prefix < 0:  # a prefill chunk: a chain committed whole
                records.append(self.model.pass_record(list(range(-1, T - 1)), prefill=True))
            else:
                records.append(self.model.pass_record(list(cols.parents[at:at + T])))
                at += T
        return HybridRows(batch, list(cols.seq_ids), records)

    @torch.no_grad()
    def forward(self, rows: HybridRows, feed=None, logits: bool = True) -> torch.Tensor | None:
        """Logits [logit rows, vocab] of the pass; each request's record is left in the pool."""
        if feed is not None:
            raise ValueError("a hybrid target's pass takes its tokens from the host (no device-token feed)")
        m, b, pool = self.model, rows.batch, self.pool
        M = b.num_rows
        x = m.model.embed_tokens(b.tokens[:M])[None]  # [1, M, hidden]
        cos, sin = m._rope(b.positions[:M][None], m.dtype)  # [1, M, rotary_dim]
        # The GDN calls: requests whose trees have the same shape (the one-row decodes of `ar` steps
        # and of the draft gate's plain rows; `chain` steps' full chains) together, one batched
        # call a layer over their gathered states; every other request (a tree of its own shape,
        # a prefill chunk) alone, over views of its slot. Each call fills its record.
        shapes: dict[tuple[int, ...], list[int]] = {}
        for r, rec in enumerate(rows.records):
            if rec.kernel != "chunked":
                shapes.setdefault(tuple(rec.parents), []).append(r)
        passes: list[tuple[torch.Tensor | slice, _Pass]] = []
        kept: dict[str, tuple[object, int]] = {}
        grouped: set[int] = set()
        for members in shapes.values():
            if len(members) < 2:
                continue
            sids = [rows.seq_ids[r] for r in members]
            state = pool.states(sids)
            p = _Pass(None, None, None, state, rows.records[members[0]])
            n = b.offsets[members[0] + 1] - b.offsets[members[0]]
            at = torch.tensor([b.offsets[r] for r in members], device=m.device)[:, None] + \
                torch.arange(n, device=m.device)  # [s, n] their rows in the pass
            passes.append((at, p))
            kept.update((sid, (p.record, j)) for j, sid in enumerate(sids))
            grouped.update(members)
        for r in range(len(rows.seq_ids)):
            if r in grouped:
                continue
            sid = rows.seq_ids[r]
            p = _Pass(None, None, None, pool.state(sid), rows.records[r])
            passes.append((slice(b.offsets[r], b.offsets[r + 1]), p))
            kept[sid] = (p.record, 0)
        want = (m.feature_layers or ()) if self.features else ()
        feats: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.model.layers):
            if i in want:  # the residual stream entering layer i
                feats[i] = x
            h = layer.input_layernorm(x)
            if layer.kind == "linear_attention":
                out = torch.empty_like(h)
                for at, p in passes:
                    if isinstance(at, slice):  # a request alone: [1, T, hidden]
                        out[:, at] = layer.linear_attn(h[:, at], p)
                    else:  # requests of one tree shape as a batch: [s, n, hidden]
                        out[0, at] = layer.linear_attn(h[0, at], p)
            else:
                out = self._attention(layer.self_attn, h, cos, sin, b)
            x = x + out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self._features = torch.cat([feats[i] for i in want], dim=-1)[0] if want else None  # [M, F]
        # what each request's commit replays (records of requests outside this pass are stale)
        pool.records = kept
        if not logits:
            return None
        h = m.model.norm(x[0, b.logit_rows])  # [n, hidden]
        return m.lm_head(h)  # [n, vocab]

    @property
    def last_features(self) -> torch.Tensor | None:
        """[M, F]: every row's features of the last pass (None: not kept)."""
        return self._features

    def _attention(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: BatchRows) -> torch.Tensor:
        """GatedAttention over the paged pool: x [1, M, hidden] -> [1, M, hidden]."""
        M = x.shape[1]
        H, Hkv, D = attn.n_heads, attn.n_kv, attn.head_dim
        q, gate = attn.q_proj(x).view(1, M, H, 2 * D).chunk(2, dim=-1)  # [1, M, H, D] each
        gate = gate.reshape(1, M, H * D)
        q = attn.q_norm(q)
        k = attn.k_norm(attn.k_proj(x).view(1, M, Hkv, D))  # [1, M, Hkv, D]
        v = attn.v_proj(x).view(1, M, Hkv, D)
        c, s = cos[:, :, None], sin[:, :, None]  # [1, M, 1, r]: one angle per row, every head
        q, k = _rotate(q, c, s)[0], _rotate(k, c, s)[0]  # [M, H | Hkv, D]
        k_cache, v_cache = self.pool.layer(attn.cache_layer)  # [num_slots, Hkv, D]
        k_cache.index_copy_(0, b.slots[:M], k)
        v_cache.index_copy_(0, b.slots[:M], v[0])
        q = q.contiguous()
        if pk.applies(q, k_cache, b.words):
            out = pk.paged_attention(q, k_cache, v_cache, b)  # [M, H, D]
        else:
            out = paged_attention_ref(q, k_cache, v_cache, b)
        return attn.o_proj(out.reshape(1, M, H * D) * torch.sigmoid(gate))

