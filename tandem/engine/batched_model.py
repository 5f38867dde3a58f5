"""One target forward over many requests' rows, reading and writing a paged KV pool.

A pass holds M rows from R requests, packed one request after another (varlen). Request r
feeds T_r rows (a prefill chunk, or a verify pass: root + draft tree) after its L_r committed
rows; its rows attend to its own committed rows and to its own new rows under its own mask
(causal for a chunk, the tree's ancestor mask for a tree), never to another request's:
the attention mask over the whole pass is block-diagonal over requests.

The layers are those of `tandem.models.transformer.Transformer` (embedding, norms,
projections, MLP, RoPE from tandem.kernels.fused), called here with a different attention:
`paged_attention_ref`, the torch reference (a Triton paged kernel would sit beside it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine import invariant
from tandem.kernels.fused import add_rmsnorm, rope_
from tandem.kv.paged import PagedKVPool
from tandem.models.transformer import Transformer


@dataclass(frozen=True)
class Segment:
    """One request's rows in a pass."""

    tokens: list[int]  # [T] fed tokens
    positions: list[int]  # [T]
    context_slots: list[int]  # [L + T] pool slots of its committed rows then of the new rows
    mask: torch.Tensor  # [T, T] bool over the new rows (causal, or a tree's ancestor mask)
    logits: bool  # whether the pass returns logits for these rows (verify: yes, prefill: no)
    # [T, L + T] bool over every column, replacing "all earlier columns, then `mask`" (batched
    # tree drafting: a level's rows see only their own ancestors among the earlier levels' rows)
    seen: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchRows:
    """A pass's rows, packed (M rows of R requests), with the padded per-request attention view.

    Padding: request r's row t < T_r is `q_index[r, t]`; its columns s < L_r + T_r are slots
    `kv_slots[r, s]`. Padded rows see column 0 only (never an empty softmax row) and are dropped.
    """

    tokens: torch.Tensor  # [M]
    positions: torch.Tensor  # [M]
    slots: torch.Tensor  # [M] slot each row's K/V is written to
    q_index: torch.Tensor  # [R, Tmax] row of M (padding: 0)
    q_valid: torch.Tensor  # [R, Tmax] bool
    kv_slots: torch.Tensor  # [R, Smax] slot of each column (padding: 0)
    mask: torch.Tensor  # [R, 1, Tmax, Smax] additive (0 / -inf), in the model's dtype
    logit_rows: torch.Tensor  # [n] rows of M whose logits the pass returns
    offsets: list[int]  # [R + 1] request r's rows are M[offsets[r]:offsets[r + 1]]
    window_mask: torch.Tensor | None = None  # [R, 1, Tmax, Smax] `mask` for sliding-window layers

    @staticmethod
    def build(segments: list[Segment], device: torch.device, dtype: torch.dtype,
              window: int | None = None) -> "BatchRows":
        """window: the target's sliding window, if some of its layers use one."""
        R = len(segments)
        T = [len(s.tokens) for s in segments]
        S = [len(s.context_slots) for s in segments]
        tmax, smax = max(T), max(S)
        offsets = [0]
        for t in T:
            offsets.append(offsets[-1] + t)
        Tt, St = torch.tensor(T), torch.tensor(S)
        q_valid = torch.arange(tmax)[None] < Tt[:, None]  # [R, tmax]
        q_index = torch.where(q_valid, torch.tensor(offsets[:-1])[:, None] + torch.arange(tmax)[None], 0)
        # (python lists, one tensor each: per-request tensors cost more than the rest of the build)
        kv_slots = torch.tensor([seg.context_slots + [0] * (smax - len(seg.context_slots)) for seg in segments])
        cols = torch.arange(smax)[None, None]  # [1, 1, smax]
        # the committed rows (every column before the request's new rows), then column 0 for padded rows
        allowed = q_valid[:, :, None] & (cols < (St - Tt)[:, None, None])
        allowed[:, :, 0] |= ~q_valid
        slots, logit_rows = [], []
        for r, seg in enumerate(segments):
            t, s = T[r], S[r]
            L = s - t
            if seg.seen is not None:
                allowed[r, :t, :s] = seg.seen
            else:
                allowed[r, :t, L:s] = seg.mask  # its own new rows, under its mask
            slots += seg.context_slots[L:]
            if seg.logits:
                logit_rows += range(offsets[r], offsets[r + 1])
        mask = torch.zeros(R, 1, tmax, smax, dtype=dtype).masked_fill_(~allowed[:, None], float("-inf"))
        window_mask = None
        if window is not None:  # a row sees the keys at positions > its own - window
            q_pos = torch.zeros(R, tmax, dtype=torch.long)
            k_pos = torch.zeros(R, smax, dtype=torch.long)
            for r, seg in enumerate(segments):
                L = S[r] - T[r]
                q_pos[r, :T[r]] = torch.tensor(seg.positions)
                k_pos[r, :L] = torch.arange(L)  # the committed rows, in position order
                k_pos[r, L:S[r]] = torch.tensor(seg.positions)
            seen = allowed & (k_pos[:, None, :] > q_pos[:, :, None] - window)
            seen[:, :, 0] |= ~seen.any(-1)  # (a row never sees nothing: padding rows keep column 0)
            window_mask = torch.zeros(R, 1, tmax, smax, dtype=dtype).masked_fill_(~seen[:, None], float("-inf"))
        flat = [tok for seg in segments for tok in seg.tokens]
        pos = [p for seg in segments for p in seg.positions]
        to = dict(device=device)
        return BatchRows(torch.tensor(flat, **to), torch.tensor(pos, **to), torch.tensor(slots, **to),
                         q_index.to(**to), q_valid.to(**to), kv_slots.to(**to), mask.to(**to),
                         torch.tensor(logit_rows, dtype=torch.long, **to), offsets,
                         None if window_mask is None else window_mask.to(**to))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: BatchRows,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: [M, H, D] (rotated); k_cache, v_cache: [num_slots, Hkv, D] (new rows already stored);
    mask: rows.mask (default) or rows.window_mask.

    Returns [M, H, D]: each row's attention over its own request's columns under its mask.
    """
    mask = rows.mask if mask is None else mask
    H, Hkv = q.shape[1], k_cache.shape[1]
    qp = q[rows.q_index].transpose(1, 2)  # [R, H, Tmax, D]
    kp = k_cache[rows.kv_slots].transpose(1, 2)  # [R, Hkv, Smax, D]
    vp = v_cache[rows.kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=Hkv != H)  # [R, H, Tmax, D]
    packed = torch.empty_like(q)
    packed[rows.q_index[rows.q_valid]] = out.transpose(1, 2)[rows.q_valid]  # [M, H, D]
    return packed


class BatchedModel:
    """`forward(rows) -> logits [len(rows.logit_rows), vocab]` of a Transformer over a PagedKVPool."""

    def __init__(self, model: Transformer, pool: PagedKVPool, deterministic: bool = False):
        if any(layer.self_attn.tp_group is not None for layer in model.model.layers):
            raise ValueError("the batched engine does not run a tensor-parallel shard yet")
        self.model, self.pool = model, pool
        # batch-invariant arithmetic (tandem.engine.invariant): a row's logits do not depend on
        # the other rows of the pass, nor on whether it is an AR step or a tree node
        self.deterministic = deterministic
        self.last_features: torch.Tensor | None = None  # [M, F] of the last pass (feature drafters)

    @torch.no_grad()
    def forward(self, rows: BatchRows) -> torch.Tensor:
        """With the target's features on (Transformer.enable_features, for feature drafters),
        `last_features` holds every row's [M, F] afterwards, as the single-request runner keeps them."""
        m = self.model
        x, delta = m.model.embed_tokens(rows.tokens)[None], None  # [1, M, hidden]
        want = m.feature_layers or ()
        feats: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.model.layers):
            if i in want:  # the residual stream entering layer i (the add is deferred)
                feats[i] = x if delta is None else x + delta
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            x, h = add_rmsnorm(x, delta, ln1.weight, ln1.eps)
            a = self._attention(layer.self_attn, i, h, rows)
            x, h = add_rmsnorm(x, a, ln2.weight, ln2.eps)
            delta = self._rowwise(layer.mlp, h)
        self.last_features = torch.cat([feats[i] for i in want], dim=-1)[0] if want else None  # [M, F]
        norm = m.model.norm
        h = add_rmsnorm(x, delta, norm.weight, norm.eps)[1][0]  # [M, hidden]
        return self._rowwise(m.lm_head, h[rows.logit_rows])  # [n, vocab]

    def _rowwise(self, fn, x: torch.Tensor) -> torch.Tensor:
        """fn over the rows of x (a row-wise layer), in fixed chunks in deterministic mode."""
        return invariant.rowwise(fn, x) if self.deterministic else fn(x)

    def _attention(self, attn, layer_idx: int, x: torch.Tensor, rows: BatchRows) -> torch.Tensor:
        # x: [1, M, hidden]
        M = x.shape[1]
        H, Hkv, D = attn.n_heads, attn.n_kv, attn.head_dim
        if attn.qkv_weight is not None:
            qkv = self._rowwise(lambda t: F.linear(t, attn.qkv_weight, attn.qkv_bias), x)
        else:
            qkv = self._rowwise(lambda t: torch.cat([attn.q_proj(t), attn.k_proj(t), attn.v_proj(t)], dim=-1), x)
        qkv = qkv.view(1, M, H + 2 * Hkv, D)
        if attn.q_norm is not None:
            qkv = torch.cat([attn.q_norm(qkv[:, :, :H]), attn.k_norm(qkv[:, :, H:H + Hkv]), qkv[:, :, H + Hkv:]], dim=2)
        rope_(qkv, rows.positions[None], self.model.inv_freq, H + Hkv)  # q and k heads, in place
        k_cache, v_cache = self.pool.layer(layer_idx)  # [num_slots, Hkv, D]
        k_cache[rows.slots] = qkv[0, :, H:H + Hkv]
        v_cache[rows.slots] = qkv[0, :, H + Hkv:]
        mask = rows.window_mask if attn.window is not None else rows.mask  # [R, 1, Tmax, Smax]
        if self.deterministic:
            valid = rows.q_index[rows.q_valid]  # [M] the pass row of each (request, row) entry
            col_slots = rows.kv_slots[:, None, :].expand_as(mask[:, 0])[rows.q_valid]  # [M, Smax]
            visible = (mask[:, 0] == 0)[rows.q_valid]  # [M, Smax]
            out = torch.empty(M, H, D, dtype=qkv.dtype, device=qkv.device)
            out[valid] = invariant.attention(qkv[0, valid, :H], k_cache, v_cache, col_slots, visible)
        else:
            out = paged_attention_ref(qkv[0, :, :H], k_cache, v_cache, rows, mask)  # [M, H, D]
        return self._rowwise(attn.o_proj, out.reshape(1, M, H * D))
