"""Paged tree attention for the batched engine: one Triton kernel per layer over every request's rows.

A batched pass packs M rows of R requests (tandem.engine.batched_model.BatchRows). Request r's
columns are its S_r rows in the paged pool, found through its block table; its new rows are
the last T_r of them. Which columns a row sees is two numbers and a bitmask per row:

    every column < prefix[row],  and column base[row] + j  for each bit j set in bits[row]

(a prefill chunk's row t: prefix = S - T + t + 1, no bits; a tree node: prefix = the committed
rows, bits = its ancestors and itself among the tree's rows; a batched draft level: its own
ancestors among the earlier levels' rows). One program per (tile, KV head): a tile is up to
`tile_rows` rows of one request; the program holds them for every query head sharing the KV
head (GQA), streams the request's columns through its block table with an online softmax and
writes [M, H, D]. No per-request padding, no gather of the whole context, no host sync: the
tile list is data, so a CUDA graph replays the same launch for any mix of requests.

`tandem.engine.batched_model.paged_attention_ref` (SDPA over a padded per-request view) is the
semantics and the CPU path; the GPU lane checks this kernel against it.
"""
from __future__ import annotations

import math

import torch

from tandem.kernels.fused import pdl, triton_enabled

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl

    from tandem.kernels.attention import online_softmax_step, scores
except ImportError:  # pragma: no cover - CPU builds
    triton = None

BITS = 64  # tree columns one int64 mask word covers (the kernel reads one word per row)


def tile_rows(num_heads: int, num_kv_heads: int) -> int:
    """Rows of one request per program: the query heads sharing a KV head times the rows make a
    64-row tile (tl.dot wants at least 16)."""
    gp = 1 << (num_heads // num_kv_heads - 1).bit_length()
    return max(1, 64 // gp)


def applies(q: torch.Tensor, k_cache: torch.Tensor, bits_words: int) -> bool:
    return (triton_enabled(q) and bits_words == 1 and q.stride(-1) == 1 and k_cache.is_contiguous()
            and q.shape[-1] in (32, 64, 128, 256) and q.shape[1] % k_cache.shape[1] == 0)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows) -> torch.Tensor:
    """q: [M, H, D] (rotated; any row and head strides); k_cache, v_cache: [num_slots, Hkv, D]
    with this pass's rows already stored; rows: a BatchRows (tiles, per-row visibility, block
    tables). -> [M, H, D]."""
    M, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    GP = triton.next_power_of_2(G)
    out = torch.empty(M, H, D, device=q.device, dtype=q.dtype)
    bt = rows.block_tables
    grid = (rows.tiles.shape[0], Hkv)
    _paged_attn_kernel[grid](q, k_cache, v_cache, out, rows.tiles, rows.seq_len, bt, rows.row_prefix, rows.row_base,
                             rows.row_bits, 1.0 / math.sqrt(D), q.stride(0), q.stride(1), k_cache.stride(0),
                             k_cache.stride(1), bt.stride(0), out.stride(0), out.stride(1), HKV=Hkv, G=G, GP=GP,
                             BT=rows.tile_rows, BLOCK_N=64, BS=rows.block_size, D=D,
                             IEEE=q.dtype == torch.float32, num_warps=4, **pdl(q))
    return out


if triton is not None:
    from tandem.kernels.fused import _pdl_enter

    @triton.jit
    def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tiles_ptr, seq_len_ptr, bt_ptr, prefix_ptr, base_ptr, bits_ptr,
                           scale, sq_m, sq_h, sk_s, sk_h, sbt_r, so_m, so_h, HKV: tl.constexpr, G: tl.constexpr,
                           GP: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                           D: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        tile = tl.program_id(0)
        hk = tl.program_id(1)
        r = tl.load(tiles_ptr + tile * 3)
        row0 = tl.load(tiles_ptr + tile * 3 + 1)
        nrows = tl.load(tiles_ptr + tile * 3 + 2)
        S = tl.where(nrows > 0, tl.load(seq_len_ptr + r), 0)  # an empty (padding) tile scans nothing
        i = tl.arange(0, GP * BT)  # tile row i: query head hk * G + i // BT, packed row row0 + i % BT
        g = i // BT
        t = i % BT
        ok = (g < G) & (t < nrows)
        row = row0 + t
        h = hk * G + g
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row[:, None] * sq_m + h[:, None] * sq_h + d[None, :], mask=ok[:, None], other=0.0)
        prefix = tl.load(prefix_ptr + row, mask=ok, other=0)
        base = tl.load(base_ptr + row, mask=ok, other=0)
        bits = tl.load(bits_ptr + row, mask=ok, other=0)
        m_i = tl.full([GP * BT], float("-inf"), tl.float32)
        l_i = tl.zeros([GP * BT], tl.float32)
        acc = tl.zeros([GP * BT, D], tl.float32)
        for n0 in range(0, S, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < S
            blk = tl.load(bt_ptr + r * sbt_r + n // BS, mask=n_ok, other=0)
            slot = blk * BS + n % BS  # [BLOCK_N] pool rows of these columns
            k = tl.load(k_ptr + slot[:, None] * sk_s + hk * sk_h + d[None, :], mask=n_ok[:, None], other=0.0)
            s = scores(q, k, scale, IEEE)
            j = n[None, :] - base[:, None]  # [rows, BLOCK_N] bit index of each column
            jc = tl.minimum(tl.maximum(j, 0), 63)
            bit = ((bits[:, None] >> jc) & 1) != 0
            allow = (n[None, :] < prefix[:, None]) | (bit & (j >= 0) & (j < 64))
            allow = allow & n_ok[None, :] & ok[:, None]
            v = tl.load(v_ptr + slot[:, None] * sk_s + hk * sk_h + d[None, :], mask=n_ok[:, None], other=0.0)
            m_i, l_i, acc = online_softmax_step(tl.where(allow, s, float("-inf")), v, m_i, l_i, acc, IEEE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + row[:, None] * so_m + h[:, None] * so_h + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=ok[:, None])
