"""Batch-invariant paged attention for deterministic mode: one Triton program per (row, KV head).

The batched engine's fast kernel (tandem.kernels.paged_attention) streams a request's columns
in pool order, 16 rows at a time. That order is not the same for a tree node and for the AR
step that feeds the same tokens at the same positions: the node's ancestors sit at the end of
the pool's columns, behind its siblings, where the AR step has them as its last committed
columns. Its online softmax therefore folds the same scores in other groupings, and the bits
differ.

Here each row walks its *visible sequence*, the columns it sees in position order:

    visible index j < prefix[row]  ->  column j (a committed column, through the block table)
    visible index j >= prefix[row] ->  column base[row] + b, b the (j - prefix)-th set bit of
                                       the row's mask words (its tree ancestors, then itself)

in tiles of BLOCK_N visible columns from j = 0, with an online softmax, the dot products as
fp32 elementwise products summed over D (no tl.dot across rows). BLOCK_N and the warps are a
function of the model's head shape only. A row's output is then a function of its query and
of its visible sequence alone: bitwise the same for a tree node and for the AR step with the
same visible sequence, and whatever rows share the pass. The price against the fast kernel: a
request's rows each read its K/V (through L2) rather than one tile of rows sharing them.

`tandem.engine.invariant.attention` (torch, gathers each row's visible columns) is the
reference and the CPU path; tests/test_invariant_kernels.py (Triton interpreter) and the GPU
lane check this kernel against it.
"""
from __future__ import annotations

import math

import torch

from tandem.kernels.fused import triton_enabled

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None


def tiling(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for a model's heads: the [GP, BLOCK_N, D] product of a tile (GP, the
    query heads of a KV head rounded up to a power of two) kept near 8K fp32 values, so it stays
    in registers. Fixed per model: every row of every pass reduces in the same tiles."""
    gp = 1 << (num_heads // num_kv_heads - 1).bit_length()
    block_n = max(16, min(64, 8192 // (gp * head_dim)))
    return block_n, 4 if gp * head_dim * block_n <= 8192 else 8


def applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this layer (else the torch reference)."""
    return (triton_enabled(q) and q.stride(-1) == 1 and k_cache.is_contiguous() and q.shape[-1] in (32, 64, 128, 256)
            and q.shape[1] % k_cache.shape[1] == 0)


def paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows) -> torch.Tensor:
    """attention() over a BatchRows (tandem.engine.batched_model) -> [M, H, D]."""
    return attention(q, k_cache, v_cache, rows.row_seq, rows.seq_len, rows.block_tables, rows.row_prefix,
                     rows.row_base, rows.row_bits, rows.block_size)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_seq: torch.Tensor,
              seq_len: torch.Tensor, block_tables: torch.Tensor, row_prefix: torch.Tensor, row_base: torch.Tensor,
              row_bits: torch.Tensor, block_size: int) -> torch.Tensor:
    """q: [M, H, D] (rotated; any row and head strides, unit stride along D); k_cache, v_cache:
    [num_slots, Hkv, D] with the pass's rows stored; row_seq [M] (each row's request);
    seq_len [R] (its columns); block_tables [R, B]; row_prefix, row_base [M]; row_bits [M, W]
    int64 (column base + 64 w + b is seen where bit b of word w is set). -> [M, H, D]; a row
    that sees nothing (a graph bucket's padding row) gets zeros.

    Runs the Triton kernel unconditionally (CPU tensors work under TRITON_INTERPRET=1)."""
    M, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    block_n, warps = tiling(H, Hkv, D)
    bits = row_bits.contiguous()
    out = torch.empty(M, H, D, device=q.device, dtype=q.dtype)
    if M == 0:
        return out
    _invariant_attn_kernel[(M, Hkv)](q, k_cache, v_cache, out, row_seq, seq_len, block_tables, row_prefix, row_base,
                                     bits, 1.0 / math.sqrt(D), bits.shape[1], q.stride(0), q.stride(1),
                                     k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0),
                                     out.stride(1), G=G, GP=triton.next_power_of_2(G), BLOCK_N=block_n,
                                     BS=block_size, D=D, num_warps=warps)
    return out


if triton is not None:

    @triton.jit
    def _tree_columns(bits_ptr, row, W, base, prefix, S, t):
        """[BLOCK_N] the column of each tree index t (t-th visible column past the prefix): base
        + the position of the t-th set bit over the row's W mask words (bits of columns below
        the prefix or past S do not count: those are seen, or not, already)."""
        b = tl.arange(0, 64)
        col = tl.zeros(t.shape, tl.int64)
        before = tl.zeros([], tl.int32)  # set bits in the earlier words
        for w in range(0, W):
            word = tl.load(bits_ptr + row * W + w)
            c = base + w * 64 + b  # [64] the columns of this word's bits
            on = (((word >> b) & 1) != 0) & (c >= prefix) & (c < S)
            rank = tl.cumsum(on.to(tl.int32), 0) - 1 + before  # [64] tree index of each set bit
            hit = on[None, :] & (rank[None, :] == t[:, None])  # [BLOCK_N, 64] one hit per t at most
            col += tl.sum(tl.where(hit, c[None, :], 0), 1)
            before += tl.sum(on.to(tl.int32), 0)
        return col

    # NOTE: the block table's row stride (its width, per pass when eager) and the mask width
    # must not pick a compiled variant: every pass runs the same code, reduces in the same order
    @triton.jit(do_not_specialize=["W", "sbt_r"])
    def _invariant_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seq_ptr, seq_len_ptr, bt_ptr, prefix_ptr, base_ptr,
                               bits_ptr, scale, W, sq_m, sq_h, sk_s, sk_h, sbt_r, so_m, so_h, G: tl.constexpr,
                               GP: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0)
        hk = tl.program_id(1)
        r = tl.load(seq_ptr + row)
        S = tl.load(seq_len_ptr + r)
        prefix = tl.minimum(tl.load(prefix_ptr + row), S)
        base = tl.load(base_ptr + row)
        # visible columns: the prefix, then the tree columns (set bits at or past the prefix)
        b = tl.arange(0, 64)
        n_tree = tl.zeros([], tl.int32)
        for w in range(0, W):
            word = tl.load(bits_ptr + row * W + w)
            c = base + w * 64 + b
            n_tree += tl.sum(((((word >> b) & 1) != 0) & (c >= prefix) & (c < S)).to(tl.int32), 0)
        count = prefix + n_tree
        g = tl.arange(0, GP)  # query heads hk * G + g (GQA: they share the KV head)
        g_ok = g < G
        h = hk * G + g
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * sq_m + h[:, None] * sq_h + d[None, :], mask=g_ok[:, None], other=0.0)
        q = q.to(tl.float32)  # [GP, D]
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for j0 in range(0, count, BLOCK_N):  # tiles of the visible sequence, from its start
            j = j0 + n  # [BLOCK_N] visible indices
            ok = j < count
            col = j.to(tl.int64)
            if j0 + BLOCK_N > prefix:  # the tile reaches the tree columns
                col = tl.where(j < prefix, col, _tree_columns(bits_ptr, row, W, base, prefix, S, j - prefix))
            blk = tl.load(bt_ptr + r * sbt_r + col // BS, mask=ok, other=0)
            slot = blk * BS + col % BS  # [BLOCK_N] pool rows of the tile's columns
            k = tl.load(k_ptr + slot[:, None] * sk_s + hk * sk_h + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2) * scale  # [GP, BLOCK_N]
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a visible column
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * sk_s + hk * sk_h + d[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)  # [GP, D]
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + row * so_m + h[:, None] * so_h + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=g_ok[:, None])
