"""A small model's decoder layer in five launches instead of nine: RMSNorm folded into the
projection that reads it, RoPE and the K/V store (or SiLU * up) into its epilogue.

At the bundled pair's size (hidden 384, 8 layers) a step is bound by kernel count, not bytes:
the whole target is 30 MB, about 8 us of H200 bandwidth, and a verify pass took ~250 us for
~85 kernels of 1-3 us each (bench/results/h200-2026-12-01-drafters-table/profile_eagle3.txt).
A layer was
    add+RMSNorm, q/k/v GEMM, RoPE+K/V store, attention, o GEMM, add+RMSNorm, gate/up GEMM,
    SiLU*mul, down GEMM
and here it is
    norm_qkv_rope_store, attention, linear (o_proj), norm_gate_up_silu, linear (down_proj).

Each fused kernel gives every program the whole rows of its input (K <= MAX_K columns): it
recomputes the rows' x + delta and their RMSNorm itself (a few hundred values a row: nothing
next to its slice of the weights), so no program waits for another. `norm_qkv_rope_store` has
one program per head (the head's two rotary halves are two accumulators, so RoPE runs on the
accumulators), `norm_gate_up_silu` one per block of gate columns with the matching up columns.
The arithmetic is the unfused path's, rounding for rounding (the sum x + delta, the normalised
rows, the weight product, the projection's output and the rotation each rounded to the model's
dtype where the torch ops round), except the order of the projection's fp32 accumulation, which
cuBLAS does not fix either. Large models (K > MAX_K) are bandwidth-bound: one row of theirs runs
tandem.kernels.gemv's streaming kernels, and passes of more rows keep cuBLAS.

The `*_ref` functions are the semantics and what runs off CUDA.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tandem.kernels.fused import (add_rmsnorm_ref, hopper, pdl, rmsnorm_ref, rope_, rope_store_kv_ref,
                                  silu_mul_ref, triton_enabled)

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

MAX_K = 1024  # widest input a fused kernel takes (hidden sizes of small models; wider: cuBLAS)
MAX_WEIGHT_BYTES = 4 << 20  # largest weight: beyond it the read, not the launch, is the cost (cuBLAS)
MAX_M = 128  # most rows (a verify pass of 127 nodes; prefill chunks are wider and keep cuBLAS)
BLOCK_M = 16  # rows per program: tl.dot's smallest tile, the same for every row count


# ---- references -----------------------------------------------------------------------------
def _norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float):
    if weight is None:  # (no norm: an EAGLE-3 layer's input is normalised, in halves, before)
        return (x, x) if delta is None else (x + delta,) * 2
    if delta is None:
        return x, rmsnorm_ref(x, weight, eps)
    return add_rmsnorm_ref(x, delta, weight, eps)


def norm_qkv_rope_store_ref(x, delta, ln_w, eps, w_qkv, b_qkv, positions, inv_freq, n_q, n_kv, k_cache, v_cache,
                            slots, s_out=None):
    """x, delta (or None): [M, K] rows of one sequence -> (x + delta [M, K], q [M, n_q, D] rotated);
    k (rotated) and v of the rows stored at cache rows `slots` [M] of k_cache, v_cache [1, n_kv, cap, D]
    (KVCache's layer buffers) or [slots, n_kv, D] (the paged pool's).
    ln_w None: the rows go to the projection as they are (no RMSNorm). s_out [M, K] (a view, e.g. a
    slice of the target-feature buffer): where x + delta is written and returned."""
    s, h = _norm_ref(x, delta, ln_w, eps)
    if s_out is not None:
        s = s_out.copy_(s)
    M = x.shape[0]
    D = w_qkv.shape[0] // (n_q + 2 * n_kv)
    qkv = F.linear(h, w_qkv, b_qkv).view(1, M, n_q + 2 * n_kv, D)
    if k_cache.dim() == 3:  # paged: [slots, n_kv, D]
        rope_(qkv, positions.view(1, M), inv_freq, n_q + n_kv)
        k_cache.index_copy_(0, slots, qkv[0, :, n_q:n_q + n_kv])
        v_cache.index_copy_(0, slots, qkv[0, :, n_q + n_kv:])
    else:
        rope_store_kv_ref(qkv, positions.view(1, M), inv_freq, n_q, n_kv, k_cache, v_cache, slots.view(1, M))
    return s, qkv[0, :, :n_q]


def norm_gate_up_silu_ref(x, delta, ln_w, eps, w_gate_up):
    """x, delta: [M, K]; w_gate_up [2 I, K] (gate rows, then up rows) -> (x + delta, SiLU(gate) * up [M, I])."""
    s, h = _norm_ref(x, delta, ln_w, eps)
    return s, silu_mul_ref(F.linear(h, w_gate_up))


# ---- dispatch -------------------------------------------------------------------------------
def applies(x: torch.Tensor, weight: torch.Tensor, k: int | None = None, max_k: int | None = MAX_K) -> bool:
    """Whether the fused kernels take rows x [M, K] against a weight [N, K] (else the unfused path);
    `k`: the projection's input width where it is not x's (an EAGLE-3 layer reads [embedding, x]);
    `max_k`: the widest input taken (None: any, for a kernel that loops over it)."""
    k = x.shape[-1] if k is None else k
    return (triton_enabled(x) and x.shape[0] <= MAX_M and (max_k is None or k <= max_k) and weight.shape[1] == k
            and weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.dtype == x.dtype
            and weight.is_contiguous() and x.stride(-1) == 1)


def linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear`'s kernel takes x [M, K] @ weight [N, K].T at any K (its loop takes any width: an
    EAGLE-3 head's fc reads 3 x the target's hidden size), unless TANDEM_FUSED_LINEAR=0."""
    return (x.dim() == 2 and applies(x, weight, max_k=None)
            and os.environ.get("TANDEM_FUSED_LINEAR", "1") != "0")


# Launch shapes (bench/gpu_fused_layer.py times the alternatives on the GPU). BK: columns of the
# input per step of the projection's loop (a whole row in one step was slower for q/k/v on the
# H200, 5.8 against 5.5 us at one row, and ran out of shared memory in fp32). BN: gate columns a
# program of norm_gate_up_silu.
QKV_BK, QKV_WARPS = 128, 4
QKV_CB = 64  # columns of each rotary half a program (at most the half: one program a head)
GATE_UP_BK, GATE_UP_WARPS = 128, 4
LINEAR_BK, LINEAR_BN, LINEAR_WARPS = 256, 16, 2  # best summed over o_proj and down_proj at 1-33 rows (H100)
# ... until the weights' preload: then 16-bit models on Hopper take a 512-column step at 4 warps (one H100,
# bundled target: o_proj 2.18 / 2.44 us at 1 / 33 rows, down_proj 3.06 / 3.55, against 2.24 / 2.72 and
# 3.56 / 4.44 at 256 and 2 warps; bench/results/h100-2026-12-07-session13/call2/fused_pre.jsonl). fp32 and
# older GPUs keep the 256-column step (twice the tile bytes, or less shared memory: not measured at 512)
LINEAR_BK_WIDE, LINEAR_WARPS_WIDE = 512, 4


def _linear_shape(x: torch.Tensor) -> tuple[int, int]:
    """(BK, warps) of `launch_linear`'s default launch for rows x."""
    if x.dtype != torch.float32 and hopper(x):
        return LINEAR_BK_WIDE, LINEAR_WARPS_WIDE
    return LINEAR_BK, LINEAR_WARPS


def preload(pre: bool | None = None) -> bool:
    """Whether the kernels load their first weight step before the PDL wait (see `_norm_qkv_kernel`);
    TANDEM_PRELOAD=0 turns it off (the A/B switch), `pre` overrides both. One H100, bundled pair, bf16,
    MBPP: `ar` 4,536 against 4,266 tok/s, block `tree` 12,641 against 11,909, every token and accept
    length the same (bench/results/h100-2026-12-07-session13/call2/)."""
    return pre if pre is not None else os.environ.get("TANDEM_PRELOAD", "1") != "0"


def _bk(K: int, bk: int) -> int:
    return min(bk, triton.next_power_of_2(K))


def _gate_up_bn(inter: int) -> int:
    """Gate columns a program: 32 where that still spreads the weight's read over 16+ programs. (64 was
    slower at the bundled target's 1024: 6.24 / 6.73 us at 1 / 33 rows against 5.0 / 5.6 at 32, one
    H100, call2/fused_pre.jsonl; wider intermediates were not measured.)"""
    return 32 if inter >= 32 * 16 else 16


def norm_qkv_rope_store(x, delta, ln_w, eps, w_qkv, b_qkv, positions, inv_freq, n_q, n_kv, k_cache, v_cache, slots,
                        s_out=None):
    """norm_qkv_rope_store_ref as one kernel on CUDA (where `applies`)."""
    if not applies(x, w_qkv):
        return norm_qkv_rope_store_ref(x, delta, ln_w, eps, w_qkv, b_qkv, positions, inv_freq, n_q, n_kv, k_cache,
                                       v_cache, slots, s_out)
    return launch_norm_qkv(x, delta, ln_w, eps, w_qkv, b_qkv, positions, inv_freq, n_q, n_kv, k_cache, v_cache,
                           slots, s_out)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x [M, K], w [N, K]) (a fused layer's o_proj and down_proj) as one Triton kernel on CUDA,
    where `applies`: 0.5-1 us faster than cuBLAS a call at the bundled pair's shapes, 1-33 rows
    (bench/gpu_small_kernels.py, one H100). TANDEM_FUSED_LINEAR=0: cuBLAS (the A/B switch)."""
    if not applies(x, w) or os.environ.get("TANDEM_FUSED_LINEAR", "1") == "0":
        return F.linear(x, w)
    return launch_linear(x, w)


def launch_linear(x, w, bk: int | None = None, bn: int | None = None, num_warps: int | None = None,
                  pre: bool | None = None):
    """The kernel of `linear`, unconditionally; bk, bn, num_warps: the launch shape; pre: `preload`'s."""
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BN = bn or LINEAR_BN
    BK, warps = _linear_shape(x)
    _linear_kernel[(triton.cdiv(N, BN), triton.cdiv(M, BLOCK_M))](
        x, w, out, M, N, K, x.stride(0), BM=BLOCK_M, BK=_bk(K, bk or BK), BN=BN, IEEE=x.dtype == torch.float32,
        PRE=preload(pre), num_warps=num_warps or warps, **pdl(x))
    return out


def norm_gate_up_silu(x, delta, ln_w, eps, w_gate_up, bn: int | None = None, num_warps: int | None = None):
    """norm_gate_up_silu_ref as one kernel on CUDA (where `applies`); bn, num_warps: a caller's own
    launch shape (default: the target's)."""
    if not applies(x, w_gate_up):
        return norm_gate_up_silu_ref(x, delta, ln_w, eps, w_gate_up)
    return launch_norm_gate_up(x, delta, ln_w, eps, w_gate_up, bn=bn, num_warps=num_warps)


def launch_norm_qkv(x, delta, ln_w, eps, w_qkv, b_qkv, positions, inv_freq, n_q, n_kv, k_cache, v_cache, slots,
                    s_out=None, bk: int | None = None, num_warps: int | None = None, cb: int | None = None,
                    pre: bool | None = None):
    """The kernel of norm_qkv_rope_store, unconditionally (the interpreter checks call it on the CPU);
    bk, num_warps, cb: the launch shape (default QKV_BK, QKV_WARPS, QKV_CB); pre: `preload`'s."""
    M, K = x.shape
    heads = n_q + 2 * n_kv
    D = w_qkv.shape[0] // heads
    # K/V cells: [1, n_kv, capacity, D] (KVCache's) or [slots, n_kv, D] (the paged pool's)
    paged = k_cache.dim() == 3
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and (paged or k_cache.shape[0] == 1)
    cache_h, cache_s = (k_cache.stride(1), k_cache.stride(0)) if paged else (k_cache.stride(1), k_cache.stride(2))
    assert s_out is None or (s_out.shape == x.shape and s_out.stride(-1) == 1)
    store_s = delta is not None or s_out is not None
    s = s_out if s_out is not None else torch.empty(M, K, dtype=x.dtype, device=x.device) if store_s else x
    q = torch.empty(M, n_q, D, dtype=x.dtype, device=x.device)
    d = delta if delta is not None else x
    CB = min(cb or QKV_CB, D // 2)
    _norm_qkv_kernel[(heads * (D // 2 // CB), triton.cdiv(M, BLOCK_M))](
        x, d, ln_w if ln_w is not None else x, w_qkv, b_qkv if b_qkv is not None else w_qkv, positions, slots, inv_freq,
        s, q, k_cache, v_cache, M, K, eps, x.stride(0), d.stride(0), s.stride(0), cache_h, cache_s, N_Q=n_q,
        N_KV=n_kv, HALF=D // 2, HAS_DELTA=delta is not None, STORE_S=store_s, NORM=ln_w is not None,
        HAS_BIAS=b_qkv is not None, BM=BLOCK_M, BK=_bk(K, bk or QKV_BK), CB=CB, IEEE=x.dtype == torch.float32,
        PRE=preload(pre), num_warps=num_warps or QKV_WARPS, **pdl(x))
    return s, q


def launch_norm_gate_up(x, delta, ln_w, eps, w_gate_up, bk: int | None = None, bn: int | None = None,
                        num_warps: int | None = None, pre: bool | None = None):
    """The kernel of norm_gate_up_silu, unconditionally; bk, bn, num_warps: the launch shape; pre: `preload`'s."""
    M, K = x.shape
    inter = w_gate_up.shape[0] // 2
    s = torch.empty(M, K, dtype=x.dtype, device=x.device) if delta is not None else x
    out = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    d = delta if delta is not None else x
    BN = bn or _gate_up_bn(inter)
    _norm_gate_up_kernel[(triton.cdiv(inter, BN), triton.cdiv(M, BLOCK_M))](
        x, d, ln_w, w_gate_up, s, out, M, K, inter, eps, x.stride(0), d.stride(0), s.stride(0),
        HAS_DELTA=delta is not None, BM=BLOCK_M, BK=_bk(K, bk or GATE_UP_BK), BN=BN, IEEE=x.dtype == torch.float32,
        PRE=preload(pre), num_warps=num_warps or GATE_UP_WARPS, **pdl(x))
    return s, out


# ---- Triton ---------------------------------------------------------------------------------
if triton is not None:
    from tandem.kernels.fused import _pdl_enter

    @triton.jit
    def _rows_sum(x_ptr, d_ptr, rows, rm, kk, km, sx, sd, HAS_DELTA: tl.constexpr):
        # [BM, BK] of x + delta, rounded to the dtype as `x + delta` rounds
        m2 = rm[:, None] & km[None, :]
        xv = tl.load(x_ptr + rows[:, None] * sx + kk[None, :], mask=m2, other=0.0)
        if HAS_DELTA:
            dv = tl.load(d_ptr + rows[:, None] * sd + kk[None, :], mask=m2, other=0.0)
            xv = (xv.to(tl.float32) + dv.to(tl.float32)).to(xv.dtype)
        return xv

    @triton.jit
    def _rstd(x_ptr, d_ptr, rows, rm, K, eps, sx, sd, HAS_DELTA: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        # [BM] 1 / rms of the rows of x + delta, in fp32 (rmsnorm_ref's)
        acc = tl.zeros([BM], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            v = _rows_sum(x_ptr, d_ptr, rows, rm, kk, kk < K, sx, sd, HAS_DELTA).to(tl.float32)
            acc += tl.sum(v * v, axis=1)
        return tl.rsqrt(acc / K + eps)

    @triton.jit
    def _normed(v, rstd, lw_ptr, kk, km):
        # rmsnorm_ref's rounding: normalise in fp32, round, times the weight, round
        y = (v.to(tl.float32) * rstd[:, None]).to(v.dtype)
        w = tl.load(lw_ptr + kk, mask=km, other=0.0)
        return (w.to(tl.float32)[None, :] * y.to(tl.float32)).to(v.dtype)

    @triton.jit
    def _mm(a, b, IEEE: tl.constexpr):
        if IEEE:  # fp32 models: no TF32 (greedy equality is checked in fp32)
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _w_tile(w_ptr, n, nm, k0, K, BK: tl.constexpr):
        # [BK, n] of a weight [N, K]: columns k0 .. k0 + BK of weight rows n (nm: the rows in range)
        kk = k0 + tl.arange(0, BK)
        return tl.load(w_ptr + n[None, :] * K + kk[:, None], mask=(kk < K)[:, None] & nm[None, :], other=0.0)

    @triton.jit
    def _norm_qkv_kernel(x_ptr, d_ptr, lw_ptr, w_ptr, b_ptr, pos_ptr, slot_ptr, inv_ptr, s_ptr, q_ptr, k_ptr, v_ptr,
                         M, K, eps, sx, sd, ss, cache_h, cache_s, N_Q: tl.constexpr, N_KV: tl.constexpr,
                         HALF: tl.constexpr, HAS_DELTA: tl.constexpr, STORE_S: tl.constexpr, NORM: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, CB: tl.constexpr,
                         IEEE: tl.constexpr, PRE: tl.constexpr = False, PDL: tl.constexpr = False):
        # grid (heads x HALF / CB, row blocks): program (head, cb) computes columns [cb CB, cb CB + CB)
        # of the head's two rotary halves for BM rows (each column's RoPE partner is in the same program)
        pid = tl.program_id(0)
        head = pid // (HALF // CB)
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        rm = rows < M
        i = (pid % (HALF // CB)) * CB + tl.arange(0, CB)  # columns of the first half; i + HALF their partners
        n1 = head * 2 * HALF + i  # weight rows
        # PRE: the loop's first weight step loads before the PDL wait. No kernel writes the weights, so
        # their read overlaps the kernel before this one (its tail, the wait's release) instead of
        # following it; what the wait guards (the rows, the caches) is read after it
        if not PRE:
            _pdl_enter(PDL)
        w1 = _w_tile(w_ptr, n1, i < HALF, 0, K, BK)  # [BK, CB]
        w2 = _w_tile(w_ptr, n1 + HALF, i < HALF, 0, K, BK)
        if PRE:
            _pdl_enter(PDL)
        if NORM:
            rstd = _rstd(x_ptr, d_ptr, rows, rm, K, eps, sx, sd, HAS_DELTA, BM, BK)
        else:
            rstd = tl.zeros([BM], tl.float32)
        acc1 = tl.zeros([BM, CB], tl.float32)
        acc2 = tl.zeros([BM, CB], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < K
            v = _rows_sum(x_ptr, d_ptr, rows, rm, kk, km, sx, sd, HAS_DELTA)
            if STORE_S:  # the residual x + delta, written once (by the first program of each row block)
                tl.store(s_ptr + rows[:, None] * ss + kk[None, :], v, mask=rm[:, None] & km[None, :] & (pid == 0))
            if NORM:
                h = _normed(v, rstd, lw_ptr, kk, km)
            else:
                h = v
            if k0 > 0:  # (the first step's were loaded above)
                w1 = _w_tile(w_ptr, n1, i < HALF, k0, K, BK)
                w2 = _w_tile(w_ptr, n1 + HALF, i < HALF, k0, K, BK)
            acc1 = acc1 + _mm(h, w1, IEEE)
            acc2 = acc2 + _mm(h, w2, IEEE)
        if HAS_BIAS:
            acc1 = acc1 + tl.load(b_ptr + n1).to(tl.float32)[None, :]
            acc2 = acc2 + tl.load(b_ptr + n1 + HALF).to(tl.float32)[None, :]
        _qkv_store(acc1, acc2, head, i, rows, rm, pos_ptr, inv_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cache_h, cache_s,
                   x_ptr.dtype.element_ty, N_Q, N_KV, HALF)

    @triton.jit
    def _qkv_store(acc1, acc2, head, i, rows, rm, pos_ptr, inv_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cache_h, cache_s,
                   dt: tl.constexpr, N_Q: tl.constexpr, N_KV: tl.constexpr, HALF: tl.constexpr):
        # columns i and i + HALF of a head's projection [BM, CB] each (fp32 sums) -> rounded, rotated
        # (q and k heads) and stored: q rows, or the K/V cache rows at the rows' slots
        a = acc1.to(dt)  # the projection's output, rounded as F.linear's
        b = acc2.to(dt)
        if head < N_Q + N_KV:  # q and k heads: RoPE (rope_ref's arithmetic: cos / sin rounded to the dtype)
            pos = tl.load(pos_ptr + rows, mask=rm, other=0).to(tl.float32)
            f = pos[:, None] * tl.load(inv_ptr + i)[None, :]
            c = tl.cos(f).to(dt).to(tl.float32)
            sn = tl.sin(f).to(dt).to(tl.float32)
            a32 = a.to(tl.float32)
            b32 = b.to(tl.float32)
            a = (a32 * c - b32 * sn).to(dt)
            b = (b32 * c + a32 * sn).to(dt)
        m2 = rm[:, None]
        if head < N_Q:
            dst = q_ptr + rows[:, None] * (N_Q * 2 * HALF) + head * 2 * HALF + i[None, :]
            tl.store(dst, a, mask=m2)
            tl.store(dst + HALF, b, mask=m2)
        else:
            cell = tl.load(slot_ptr + rows, mask=rm, other=0)[:, None] * cache_s + i[None, :]  # [BM, CB]
            if head < N_Q + N_KV:
                dst = k_ptr + (head - N_Q) * cache_h + cell
            else:
                dst = v_ptr + (head - N_Q - N_KV) * cache_h + cell
            tl.store(dst, a, mask=m2)
            tl.store(dst + HALF, b, mask=m2)

    @triton.jit
    def _norm_gate_up_kernel(x_ptr, d_ptr, lw_ptr, w_ptr, s_ptr, out_ptr, M, K, I, eps, sx, sd, ss,
                             HAS_DELTA: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                             IEEE: tl.constexpr, PRE: tl.constexpr = False, PDL: tl.constexpr = False):
        # grid (column blocks, row blocks): gate columns [pn BN, pn BN + BN) and the same up columns
        pn = tl.program_id(0)
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        rm = rows < M
        cols = pn * BN + tl.arange(0, BN)
        cm = cols < I
        if not PRE:  # (PRE: as in _norm_qkv_kernel)
            _pdl_enter(PDL)
        wg = _w_tile(w_ptr, cols, cm, 0, K, BK)  # [BK, BN]
        wu = _w_tile(w_ptr, I + cols, cm, 0, K, BK)
        if PRE:
            _pdl_enter(PDL)
        rstd = _rstd(x_ptr, d_ptr, rows, rm, K, eps, sx, sd, HAS_DELTA, BM, BK)
        accg = tl.zeros([BM, BN], tl.float32)
        accu = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < K
            v = _rows_sum(x_ptr, d_ptr, rows, rm, kk, km, sx, sd, HAS_DELTA)
            if HAS_DELTA:
                tl.store(s_ptr + rows[:, None] * ss + kk[None, :], v, mask=rm[:, None] & km[None, :] & (pn == 0))
            h = _normed(v, rstd, lw_ptr, kk, km)
            if k0 > 0:  # (the first step's were loaded above)
                wg = _w_tile(w_ptr, cols, cm, k0, K, BK)
                wu = _w_tile(w_ptr, I + cols, cm, k0, K, BK)
            accg = accg + _mm(h, wg, IEEE)
            accu = accu + _mm(h, wu, IEEE)
        dt = x_ptr.dtype.element_ty
        g = accg.to(dt).to(tl.float32)  # gate and up rounded as F.linear's output, then silu_mul_ref
        u = accu.to(dt).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
        tl.store(out_ptr + rows[:, None] * I + cols[None, :], y.to(dt), mask=rm[:, None] & cm[None, :])

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sx, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                       IEEE: tl.constexpr, PRE: tl.constexpr = False, PDL: tl.constexpr = False):
        # grid (column blocks, row blocks): out[rows, cols] = x[rows] @ w[cols].T, rounded once
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        rm = rows < M
        cm = cols < N
        if not PRE:  # (PRE: as in _norm_qkv_kernel)
            _pdl_enter(PDL)
        b = _w_tile(w_ptr, cols, cm, 0, K, BK)  # [BK, BN]
        if PRE:
            _pdl_enter(PDL)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < K
            a = tl.load(x_ptr + rows[:, None] * sx + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            if k0 > 0:  # (the first step's were loaded above)
                b = _w_tile(w_ptr, cols, cm, k0, K, BK)
            acc = acc + _mm(a, b, IEEE)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(x_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])
