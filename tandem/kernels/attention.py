"""Attention of a few new rows over the KV cache, as one Triton kernel per layer.

A decode step (1 row) or a tree verify (~33 rows) attends to a few hundred cache columns under
a boolean mask (the prefix, then the row's tree ancestors). torch's SDPA does that with a
cuDNN / memory-efficient kernel plus a workspace memset, and the caller then copies its
[B, H, T, D] output into [B, T, H * D] for o_proj: three launches and ~8 us per layer at the
bundled target's size, where the whole layer is ~30 us. Here one program per (batch, KV head,
block of rows) holds the rows of all the query heads that share the KV head (GQA), streams the
columns in blocks with an online softmax (flash attention's recurrence), and writes
[B, T, H, D] directly.

`cached_attention_ref` (SDPA) is the semantics, and what runs on the CPU or when the kernel does
not apply (a float mask, many rows); the GPU lane checks the kernel against it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.kernels.fused import pdl, triton_enabled

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

MAX_ROWS = 128  # more new rows (a prefill chunk) go to SDPA, which tiles them better


def cached_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [B, T, H, D] (any strides); k, v: [B, Hkv, W, D]; mask: [B | 1, 1, T | 1, W] bool
    (True = attend) -> [B, T, H, D]."""
    H, Hkv = q.shape[2], k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=Hkv != H)
    return out.transpose(1, 2)


def applies(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel takes this call (else cached_attention_ref)."""
    return (mask is not None and mask.dtype == torch.bool and triton_enabled(q) and q.shape[1] <= MAX_ROWS
            and q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[-1] in (32, 64, 128, 256)
            and q.shape[2] % k.shape[1] == 0)


BLOCK_N, NUM_WARPS = 64, 4  # columns a step, warps a program (bench/gpu_fused_layer.py times others)
# Split the columns (flash-decoding) when a program would stream at least SPLIT_MIN_BLOCKS column
# blocks: a program's blocks run one after another, so at the Llama-3-8B shape (8 KV heads, one row:
# 8 programs) a 800-column step took 22 us a layer where its 2 MB of K/V take ~1. Each split streams
# SPLIT_BLOCKS blocks; a second launch merges the splits' (max, sum, output) in a fixed order.
SPLIT_MIN_BLOCKS, SPLIT_BLOCKS, MAX_PROGRAMS = 5, 2, 256


def splits_for(programs: int, blocks: int) -> int:
    """How many column splits a call of `programs` programs over `blocks` column blocks runs (1: none)."""
    if blocks < SPLIT_MIN_BLOCKS:
        return 1
    return max(1, min(triton.cdiv(blocks, SPLIT_BLOCKS), MAX_PROGRAMS // programs))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     block_n: int | None = None, num_warps: int | None = None, splits: int | None = None
                     ) -> torch.Tensor:
    """cached_attention_ref, on CUDA by one Triton kernel where it applies (block_n, num_warps: its
    launch shape, default BLOCK_N, NUM_WARPS; splits: column splits, default `splits_for`), two
    when the columns are split."""
    if not applies(q, k, mask):
        return cached_attention_ref(q, k, v, mask)
    return launch_cached_attention(q, k, v, mask, block_n, num_warps, splits)


def launch_cached_attention(q, k, v, mask, block_n=None, num_warps=None, splits=None) -> torch.Tensor:
    """The kernel(s) of cached_attention, unconditionally (the interpreter checks call it on the CPU)."""
    B, T, H, D = q.shape
    Hkv, W = k.shape[1], k.shape[2]
    G = H // Hkv
    GP = triton.next_power_of_2(G)
    # rows per program: at least 16 query rows in all (tl.dot's smallest tile), at most 64
    BLOCK_T = max(16 // GP, 1, min(triton.next_power_of_2(T), max(1, 64 // GP)))
    BN = block_n or BLOCK_N
    out = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    m = mask.expand(B, 1, T, W)  # a view: broadcast dims get stride 0
    tiles = triton.cdiv(T, BLOCK_T)
    blocks = triton.cdiv(W, BN)
    S = splits if splits is not None else splits_for(B * Hkv * tiles, blocks)
    chunk = triton.cdiv(blocks, max(1, S)) * BN  # columns a split
    S = triton.cdiv(W, chunk)
    R = GP * BLOCK_T  # rows of a program's tile
    acc = torch.empty(S, B * Hkv, tiles, R, D, device=q.device, dtype=torch.float32) if S > 1 else out
    ml = torch.empty(2, S, B * Hkv, tiles, R, device=q.device, dtype=torch.float32) if S > 1 else out
    args = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), m.stride(0), m.stride(2), m.stride(3), out.stride(0), out.stride(1), out.stride(2))
    _cached_attn_kernel[(B * Hkv, tiles, S)](q, k, v, m, out, acc, ml, T, W, 1.0 / math.sqrt(D), chunk, *args,
                                             HKV=Hkv, G=G, GP=GP, BLOCK_T=BLOCK_T, BLOCK_N=BN, D=D,
                                             IEEE=q.dtype == torch.float32, SPLIT=S > 1,
                                             num_warps=num_warps or NUM_WARPS, **pdl(q))
    if S > 1:
        _attn_merge_kernel[(B * Hkv, tiles)](acc, ml, out, T, S, B * Hkv * tiles, out.stride(0), out.stride(1),
                                             out.stride(2), HKV=Hkv, G=G, GP=GP, BLOCK_T=BLOCK_T, D=D, **pdl(acc))
    return out


if triton is not None:
    from tandem.kernels.fused import _pdl_enter

    # q [rows, D] . k [cols, D]^T * scale, fp32 (no TF32 for fp32 models: greedy equality is
    # checked in fp32)
    @triton.jit
    def scores(q, k, scale, IEEE: tl.constexpr):
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        return s * scale

    # flash attention's recurrence: fold a block of masked scores s [rows, cols] (-inf: unseen)
    # and its values v [cols, D] into the running max m_i, sum l_i and output acc
    @triton.jit
    def online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no column yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _cached_attn_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, acc_ptr, ml_ptr, T, W, scale, chunk, sq_b, sq_t, sq_h,
                            sk_b, sk_h, sk_w, sv_b, sv_h, sv_w, sm_b, sm_t, sm_w, so_b, so_t, so_h, HKV: tl.constexpr,
                            G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                            D: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
        # grid (batch x KV heads, row tiles, column splits): columns [split chunk, split chunk + chunk)
        _pdl_enter(PDL)
        bh = tl.program_id(0)
        b = bh // HKV
        hk = bh % HKV
        r = tl.arange(0, GP * BLOCK_T)  # tile row r: query head hk * G + r // BLOCK_T, new row t
        g = r // BLOCK_T
        t = tl.program_id(1) * BLOCK_T + r % BLOCK_T
        row_ok = (g < G) & (t < T)
        h = hk * G + g
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        m_i = tl.full([GP * BLOCK_T], float("-inf"), tl.float32)
        l_i = tl.zeros([GP * BLOCK_T], tl.float32)
        acc = tl.zeros([GP * BLOCK_T, D], tl.float32)
        if SPLIT:
            lo = tl.program_id(2) * chunk
            hi = tl.minimum(lo + chunk, W)
        else:
            lo = 0
            hi = W
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            k = tl.load(k_ptr + b * sk_b + hk * sk_h + n[:, None] * sk_w + d[None, :], mask=n_ok[:, None], other=0.0)
            s = scores(q, k, scale, IEEE)
            allow = tl.load(m_ptr + b * sm_b + t[:, None] * sm_t + n[None, :] * sm_w,
                            mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
            v = tl.load(v_ptr + b * sv_b + hk * sv_h + n[:, None] * sv_w + d[None, :], mask=n_ok[:, None], other=0.0)
            m_i, l_i, acc = online_softmax_step(tl.where(allow, s, float("-inf")), v, m_i, l_i, acc, IEEE)
        if SPLIT:  # the split's running max, sum and unnormalised output, for _attn_merge_kernel
            R = GP * BLOCK_T
            tile = (tl.program_id(2) * tl.num_programs(0) + bh) * tl.num_programs(1) + tl.program_id(1)
            tl.store(acc_ptr + (tile * R + r)[:, None] * D + d[None, :], acc)
            tl.store(ml_ptr + tile * R + r, m_i)
            tl.store(ml_ptr + (tl.num_programs(2) * tl.num_programs(0) * tl.num_programs(1) + tile) * R + r, l_i)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_ptr + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _attn_merge_kernel(acc_ptr, ml_ptr, o_ptr, T, S, tiles_all, so_b, so_t, so_h, HKV: tl.constexpr,
                           G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                           PDL: tl.constexpr = False):
        # the splits of one (batch x KV head, row tile), folded in split order (deterministic)
        _pdl_enter(PDL)
        bh = tl.program_id(0)
        b = bh // HKV
        hk = bh % HKV
        R = GP * BLOCK_T
        r = tl.arange(0, GP * BLOCK_T)
        g = r // BLOCK_T
        t = tl.program_id(1) * BLOCK_T + r % BLOCK_T
        row_ok = (g < G) & (t < T)
        h = hk * G + g
        d = tl.arange(0, D)
        base = bh * tl.num_programs(1) + tl.program_id(1)  # the tile's index within a split
        mx = tl.full([GP * BLOCK_T], float("-inf"), tl.float32)
        for sp in range(0, S):
            mx = tl.maximum(mx, tl.load(ml_ptr + (sp * tiles_all + base) * R + r))
        safe = tl.where(mx == float("-inf"), 0.0, mx)
        den = tl.zeros([GP * BLOCK_T], tl.float32)
        num = tl.zeros([GP * BLOCK_T, D], tl.float32)
        for sp in range(0, S):
            tile = sp * tiles_all + base
            wgt = tl.exp(tl.load(ml_ptr + tile * R + r) - safe)  # [R] (0 for a split that saw nothing)
            den += wgt * tl.load(ml_ptr + (S * tiles_all + tile) * R + r)
            num += wgt[:, None] * tl.load(acc_ptr + (tile * R + r)[:, None] * D + d[None, :])
        out = num / tl.where(den == 0.0, 1.0, den)[:, None]
        tl.store(o_ptr + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
