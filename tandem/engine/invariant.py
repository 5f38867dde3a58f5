"""Batch-invariant arithmetic for the engine's deterministic mode (`--deterministic`).

A row's result must not depend on which other rows share the pass: not on how many (batch 1 or
64), not on their contents, not on whether the row is an AR step or a node of a verified tree.
Fast kernels break this in two places, because their reduction order depends on the shape:

- **Matrix products.** A GEMM picks its algorithm (tiles, split-K, GEMV for one row) from M, the
  number of rows, so row i's dot products are summed in an order that changes with M.
- **Attention.** A row sees its request's committed columns and, in a tree, its ancestors. The
  fast kernels reduce over the pool's column order in tiles of rows, and a tree node's ancestors
  sit at other column indices than the same tokens do in an AR step.

The cure is a fixed reduction order per row, with no split that changes with M. BatchedModel
(tandem.engine.batched_model) takes it from one of two implementations:

- **On CUDA, Triton kernels** (captured in the same CUDA graph buckets as the default mode):
  `tandem.kernels.invariant_gemm` for every row-wise product (q/k/v, o_proj, MLP, LM head), a
  GEMM whose tiling depends on the weight alone, K walked in one order, no split-K; and
  `tandem.kernels.invariant_attention`, a program per (row, KV head) that walks the row's
  visible sequence (its committed columns, then its ancestors and itself) in tiles of a fixed
  number of visible columns with an online softmax.
- **Here, in torch: the reference, and the path on the CPU** (or where a kernel does not apply:
  a quantized head, a sliding window). `rowwise` runs a row-wise layer over fixed chunks of
  `CHUNK` rows, the last one zero-padded: every product has the same shape, so every row is
  reduced in the same order, whatever else is in its chunk. `attention` gathers each row's
  visible K/V in position order (for a node that is exactly the prefix an AR step would see),
  pads them to a length that depends only on the row's own count (`padded_len`), and reduces
  in fp32 with elementwise products and sums over fixed dimensions.

The two give a row different bits (other reduction orders), each invariant on its own. Norms,
RoPE, SiLU and embeddings are per row already (tandem.kernels.fused: a program per row or per
row and head). The CPU path pays in more, smaller launches; the CUDA path's cost against the
default mode has not been measured.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

CHUNK = 16  # rows per matrix product in deterministic mode


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn (row-wise: row i of the output depends on row i of the input only) over x [..., M, h]
    with a leading dim of 1 or none, in chunks of exactly CHUNK rows -> [..., M, out]."""
    lead = x.dim() == 3
    rows = x[0] if lead else x  # [M, h]
    M = rows.shape[0]
    if M == 0:
        return fn(x)
    pad = -M % CHUNK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([fn(rows[i:i + CHUNK][None])[0] for i in range(0, M + pad, CHUNK)])[:M]
    return out[None] if lead else out


def padded_len(count: torch.Tensor) -> torch.Tensor:
    """A row's padded column count: a function of its own visible count only (a power of two >= 64)."""
    return torch.clamp(count, min=64).sub(1).log2().floor().add(1).exp2().long()


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, col_slots: torch.Tensor,
              visible: torch.Tensor) -> torch.Tensor:
    """q: [M, H, D]; k_cache, v_cache: [num_slots, Hkv, D]; col_slots: [M, S] the pool slot of each
    of a row's S candidate columns, in position order; visible: [M, S] bool. -> [M, H, D].

    Each row attends to its visible columns, packed to the front in order and reduced over a
    padded length that depends on its own count only."""
    M, H, D = q.shape
    G = H // k_cache.shape[1]
    order = torch.argsort((~visible).to(torch.int8), dim=1, stable=True)  # visible columns first, in order
    slots = col_slots.gather(1, order)  # [M, S]
    count = visible.sum(1)  # [M]
    plen = padded_len(count)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(D)
    for L in plen.unique().tolist():
        rows = (plen == L).nonzero()[:, 0]  # [n]
        n, S = rows.numel(), slots.shape[1]
        sl = torch.zeros(n, L, dtype=torch.long, device=q.device)
        sl[:, :min(S, L)] = slots[rows, :min(S, L)]
        valid = torch.arange(L, device=q.device)[None] < count[rows, None]  # [n, L]
        k = k_cache[sl].float().repeat_interleave(G, dim=2).permute(0, 2, 1, 3)  # [n, H, L, D]
        v = v_cache[sl].float().repeat_interleave(G, dim=2).permute(0, 2, 1, 3)
        s = (q[rows].float()[:, :, None, :] * k).sum(-1) * scale  # [n, H, L]
        p = torch.softmax(s.masked_fill(~valid[:, None], float("-inf")), dim=-1)
        out[rows] = (p[..., None] * v).sum(2).to(q.dtype)  # [n, H, D]
    return out
