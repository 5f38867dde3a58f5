"""A large model's one-row decoder layer as GEMVs that stream its weights, with the layer's small
kernels folded into them.

At the Llama-3-8B shape a batch-1 step reads 16 GB of weights, so a layer's cost is its bytes,
and what cuBLAS leaves on the table is the problem (one H100, 2026-12-06 profile, per token):
o_proj streamed at ~55% of the bandwidth (cuBLAS picked a tile without split-K for 4096 x 4096 at
one row), and ~370 us went to small kernels between the GEMMs (add + RMSNorm 149, cuBLAS's split-K
reduce 120, RoPE + K/V store 52, SiLU * up 51) that gpt-fast's compiled graph folds into its GEMVs.
Here a layer is
    norm_qkv_rope_store, attention, gemv (o_proj), norm_gate_up_silu, gemv (down)
the launches of `fused_layer` (the small models' fused layer), for one row and any width; and the
last residual add, the final norm and the LM head are one `norm_gemv`.

Each program owns a few output columns and streams their weight rows over the whole input; the
input row (a few KB, from L2) is re-read by every program. The RMSNorm needs the row's rms, which
is a scalar, so it is applied after the dot product: sum_k (x_k rstd w_k) W_nk = rstd sum_k x_k w_k
W_nk, and every program sums the squares of its own x chunks as it goes (no pre-pass, no wait for
another program). So the arithmetic is not the unfused path's rounding for rounding (that rounds
the normalised row to the dtype before the product): outputs agree to the dtype's rounding, and
the greedy tokens of a bf16 model may differ at near-ties, as they already do between cuBLAS's
one-row and many-row kernels. Verify passes (many rows) keep cuBLAS.

Measured (one H100, bench/results/h100-2026-12-06-gemv): Tandem's `ar` at the Llama-3-8B shape went
from 6.439 to 5.836 ms/token with these kernels (gpt-fast's compiled loop: 5.995 in the same call).

The `*_ref` functions are the semantics and what runs off CUDA.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels import fused_layer
from tandem.kernels.fused import add_rmsnorm_ref, pdl, triton_enabled
from tandem.kernels.fused_layer import norm_gate_up_silu_ref, norm_qkv_rope_store_ref

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

# Launch shapes, (BN output columns a program, BK input columns a loop step, warps), by kind: the best of
# bench/gpu_gemv.py's sweep at the Llama-3-8B shape (one H100, 2026-12-06; each kind's summed time over its
# shapes): o_proj 12.98 us, down_proj 40.64, gate/up 82.79, q/k/v 20.24. The sweep also writes a table that
# `set_launch` loads (bench/gpu_core.py --gemv-launch).
LAUNCH: dict[str, tuple[int, int, int]] = {
    "plain": (2, 2048, 8),  # o_proj, down_proj, the LM head (norm_gemv)
    "gate_up": (8, 512, 4),  # gate/up with the norm in front and SiLU * up behind: 2 x BN weight rows
    "qkv": (4, 512, 4),  # BN here: columns of each rotary half (2 x BN weight rows a program)
}


def set_launch(table: dict[str, list[int] | tuple[int, int, int]]) -> None:
    """Replace launch shapes (a bench's tuned table: {kind: (BN, BK, warps)})."""
    for kind, shape in table.items():
        if kind not in LAUNCH:
            raise ValueError(f"unknown GEMV kind {kind!r}; expected one of {sorted(LAUNCH)}")
        LAUNCH[kind] = tuple(int(v) for v in shape)


@dataclass(frozen=True)
class W12Gemv:
    """A W12 matrix (tandem.quant.w12: 12 bits a weight, lossless) as these kernels read it, on the device:
    every kernel here takes one in place of a bf16 weight and decodes its records in registers, so a
    one-row pass reads 12/16 of the bytes (plus the escapes: ~7e-5 of the weights in real checkpoints).
    `tandem.quant.w12.gemv_operand` builds one."""

    data: torch.Tensor  # [tn * tk * 12288] uint8: the records (128 x 64 tiles), row tile major
    b7: torch.Tensor  # [N] int32: each channel's window bottom B_n, shifted into a bf16 exponent field (<< 7)
    esc_off: torch.Tensor  # [N + 1] int32: channel n's escapes are entries esc_off[n] .. esc_off[n + 1]
    esc_col: torch.Tensor  # [max(E, 1)] int32: each escape's column
    esc_bits: torch.Tensor  # [max(E, 1)] int16: its raw bf16 bits
    shape: tuple[int, int]  # (N, K) of the matrix

    dtype = torch.bfloat16  # (what it decodes to)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.b7, self.esc_off, self.esc_col, self.esc_bits))


def _w12_args(w) -> tuple:
    """(weight, b7, escape offsets, columns, bits, W12) for a launch: a W12Gemv's tensors, or the bf16
    weight with itself in the unused slots."""
    if isinstance(w, W12Gemv):
        return w.data, w.b7, w.esc_off, w.esc_col, w.esc_bits, True
    return w, w, w, w, w, False


def enabled() -> bool:
    """The A/B switch: TANDEM_GEMV=0 keeps cuBLAS and the separate small kernels."""
    return os.environ.get("TANDEM_GEMV", "1") != "0"


def applies(x: torch.Tensor, weight: torch.Tensor, k: int | None = None) -> bool:
    """Whether one row x [1, K] against a weight [N, K] takes these kernels: CUDA, a weight past the
    fused layer's (small models: there the launch, not the read, is the cost), K a multiple of 64.
    `k`: the input width where it is not x's (a layer's down_proj, asked about with the layer's input)."""
    K = x.shape[-1] if k is None else k
    row = (triton_enabled(x) and x.dim() == 2 and x.shape[0] == 1 and weight.shape[1] == K and K % 64 == 0
           and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.stride(-1) == 1)
    if isinstance(weight, W12Gemv):  # (any row dtype: the weights decode to exact bf16 values in fp32)
        return row
    return (row and enabled() and weight.numel() * weight.element_size() > fused_layer.MAX_WEIGHT_BYTES
            and weight.dtype == x.dtype and weight.is_contiguous())


# ---- launches ---------------------------------------------------------------------------------
def _bk(K: int, bk: int) -> int:
    while K % bk:  # K % 64 == 0 (applies): the loop has no masked tail
        bk //= 2
    return bk


def gemv(x: torch.Tensor, w: torch.Tensor, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ w [N, K].T -> [1, N] (F.linear where the kernel does not apply); w a tensor or a W12Gemv."""
    if not applies(x, w):
        return F.linear(x, w)
    N, K = w.shape
    BN, BK, warps = launch or LAUNCH["plain"]
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    w, b7, eo, ec, eb, w12 = _w12_args(w)
    _gemv_kernel[(triton.cdiv(N, BN),)](x, x, x, w, x, out, b7, eo, ec, eb, N, K, 0.0, HAS_DELTA=False, NORM=False,
                                        SILU=False, STORE=False, BN=BN, BK=_bk(K, BK), PRE=fused_layer.preload(),
                                        W12=w12, num_warps=warps, **pdl(x))
    return out


def norm_gemv_ref(x, delta, ln_w, eps, w):
    """F.linear(rmsnorm(x + delta), w): a model's final norm and LM head. x, delta [M, K]."""
    return F.linear(add_rmsnorm_ref(x, delta, ln_w, eps)[1], w)


def norm_gemv(x, delta, ln_w, eps, w, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """norm_gemv_ref in one launch for one row: x, delta [1, K] -> [1, N] (the sum x + delta is not kept)."""
    if not applies(x, w):
        return norm_gemv_ref(x, delta, ln_w, eps, w)
    N, K = w.shape
    BN, BK, warps = launch or LAUNCH["plain"]
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    w, b7, eo, ec, eb, w12 = _w12_args(w)
    _gemv_kernel[(triton.cdiv(N, BN),)](x, delta, ln_w, w, x, out, b7, eo, ec, eb, N, K, eps, HAS_DELTA=True,
                                        NORM=True, SILU=False, STORE=False, BN=BN, BK=_bk(K, BK),
                                        PRE=fused_layer.preload(), W12=w12, num_warps=warps, **pdl(x))
    return out


def norm_gate_up_silu(x, delta, ln_w, eps, w_gate_up, launch: tuple[int, int, int] | None = None):
    """(x + delta, silu(gate) * up of rmsnorm(x + delta)) in one launch: x, delta [1, K]."""
    if not applies(x, w_gate_up):
        return norm_gate_up_silu_ref(x, delta, ln_w, eps, w_gate_up)
    K = x.shape[1]
    inter = w_gate_up.shape[0] // 2
    BN, BK, warps = launch or LAUNCH["gate_up"]
    s = torch.empty_like(x) if delta is not None else x
    out = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    w, b7, eo, ec, eb, w12 = _w12_args(w_gate_up)
    _gemv_kernel[(triton.cdiv(inter, BN),)](x, delta if delta is not None else x, ln_w, w, s, out, b7, eo, ec, eb,
                                            inter, K, eps, HAS_DELTA=delta is not None, NORM=True, SILU=True,
                                            STORE=delta is not None, BN=BN, BK=_bk(K, BK), PRE=fused_layer.preload(),
                                            W12=w12, num_warps=warps, **pdl(x))
    return s, out


def norm_qkv_rope_store(x, delta, ln_w, eps, w_qkv, b_qkv, positions, inv_freq, n_q, n_kv, k_cache, v_cache, slots,
                        s_out=None, launch: tuple[int, int, int] | None = None):
    """fused_layer.norm_qkv_rope_store for one row of a large model: (x + delta, the rotated q [1, n_q, D]),
    the rotated k and v stored at the row's slot. x, delta [1, K]; positions, slots [1]."""
    if not applies(x, w_qkv):
        return norm_qkv_rope_store_ref(x, delta, ln_w, eps, w_qkv, b_qkv, positions, inv_freq, n_q, n_kv, k_cache,
                                       v_cache, slots, s_out)
    assert ln_w is not None, "the one-row q/k/v kernel always normalises its input"
    K = x.shape[1]
    heads = n_q + 2 * n_kv
    D = w_qkv.shape[0] // heads
    paged = k_cache.dim() == 3  # [1, n_kv, capacity, D] (KVCache's) or [slots, n_kv, D] (a paged pool's)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and (paged or k_cache.shape[0] == 1)
    cache_h, cache_s = (k_cache.stride(1), k_cache.stride(0)) if paged else (k_cache.stride(1), k_cache.stride(2))
    CB, BK, warps = launch or LAUNCH["qkv"]
    CB = min(CB, D // 2)
    store_s = delta is not None or s_out is not None
    s = s_out if s_out is not None else torch.empty_like(x) if store_s else x
    q = torch.empty(1, n_q, D, dtype=x.dtype, device=x.device)
    w, b7, eo, ec, eb, w12 = _w12_args(w_qkv)
    _qkv_gemv_kernel[(heads * (D // 2 // CB),)](
        x, delta if delta is not None else x, ln_w, w, b_qkv if b_qkv is not None else x, positions, slots,
        inv_freq, s, q, k_cache, v_cache, b7, eo, ec, eb, K, eps, cache_h, cache_s, N_Q=n_q, N_KV=n_kv, HALF=D // 2,
        HAS_DELTA=delta is not None, STORE_S=store_s, HAS_BIAS=b_qkv is not None, CB=CB, BK=_bk(K, BK),
        PRE=fused_layer.preload(), W12=w12, num_warps=warps, **pdl(x))
    return s, q


# ---- Triton ---------------------------------------------------------------------------------
if triton is not None:
    from tandem.kernels.fused import _pdl_enter
    from tandem.kernels.fused_layer import _qkv_store

    @triton.jit
    def _row_chunk(x_ptr, d_ptr, lw_ptr, s_ptr, kk, first, HAS_DELTA: tl.constexpr, NORM: tl.constexpr,
                   STORE: tl.constexpr):
        # input columns kk of the row: x + delta rounded to the dtype as `x + delta` rounds (STORE: written
        # as the residual by the `first` program), times the norm's weight, in fp32; and the fp32 values
        v = tl.load(x_ptr + kk, eviction_policy="evict_last")
        if HAS_DELTA:
            v = (v.to(tl.float32) + tl.load(d_ptr + kk, eviction_policy="evict_last").to(tl.float32)).to(v.dtype)
        if STORE:
            tl.store(s_ptr + kk, v, mask=first & (kk >= 0))
        v32 = v.to(tl.float32)
        if NORM:
            return v32 * tl.load(lw_ptr + kk, eviction_policy="evict_last").to(tl.float32), v32
        return v32, v32

    @triton.jit
    def _w_chunk(w_ptr, r, rl, b7, m, kk, W12: tl.constexpr):
        # [BN, BK] of the weight, read once: columns kk of the rows whose offsets are r (rows where m); or of a
        # W12 matrix's channels, decoded to fp32 in registers: view bytes at r + column offsets, low nibbles
        # at rl + ..., B_n << 7 in b7. kk covers whole 64-column tiles (K % 64 == 0). A slot's bf16 bits are
        # sign << 15 | (offset << 7 | mantissa) + (B_n << 7), no select: the reserved code (an escape) reads
        # z_n = 2^(B_n - 127), which _w12_escapes takes away again
        if W12:
            kt = (kk // 64) * 12288  # the record of each column (records of one row tile are consecutive)
            c = kk % 64
            v = tl.load(w_ptr + r[:, None] + (kt + c)[None, :], mask=m[:, None], other=0,
                        eviction_policy="evict_first").to(tl.int32)
            lo = tl.load(w_ptr + rl[:, None] + (kt + c % 32)[None, :], mask=m[:, None], other=0,
                         eviction_policy="evict_first").to(tl.int32)
            low = (lo >> ((c // 32) * 4)[None, :]) & 0xF  # columns 0..31 in the low nibble, 32..63 in the high
            bits = ((v & 0x80) << 24) | (((((v & 0x7F) << 4) | low) + b7[:, None]) << 16)
            w = bits.to(tl.float32, bitcast=True)
        else:
            w = tl.load(w_ptr + r[:, None] + kk[None, :], mask=m[:, None], other=0.0, eviction_policy="evict_first")
        return w

    @triton.jit
    def _w12_rows(n, K):
        # (view, low-nibble) byte offsets of W12 channels n: their row tile's first record, then 64 view bytes a
        # channel; the low nibbles 32 bytes a channel after the record's 8 KB view
        r = (n // 128).to(tl.int64) * (K // 64) * 12288 + (n % 128) * 64
        return r, r - (n % 128) * 32 + 8192

    @triton.jit
    def _w12_escapes(x_ptr, d_ptr, lw_ptr, s_ptr, eo_ptr, ec_ptr, eb_ptr, n, m, b7, HAS_DELTA: tl.constexpr,
                     NORM: tl.constexpr):
        # [BN]: over each channel's escape list, (its value - z_n) times the row's (normed) input at its column:
        # what the record walk missed at the escaped slots, where it read z_n
        start = tl.load(eo_ptr + n, mask=m, other=0)
        end = tl.load(eo_ptr + n + 1, mask=m, other=0)
        z = (b7 << 16).to(tl.float32, bitcast=True)
        acc = tl.zeros_like(z)
        j = tl.arange(0, 64)  # (64 entries a step: real checkpoints escape ~7e-5 of their weights, a channel's
        # list is then at most a step; a channel of denormals costs a step per 64 of them)
        for e in range(0, tl.max(end - start, axis=0), 64):
            idx = start[:, None] + e + j[None, :]  # [BN, 64]
            ok = idx < end[:, None]
            col = tl.load(ec_ptr + idx, mask=ok, other=0)
            val = ((tl.load(eb_ptr + idx, mask=ok, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            h, _ = _row_chunk(x_ptr, d_ptr, lw_ptr, s_ptr, col, False, HAS_DELTA, NORM, False)
            acc += tl.sum(tl.where(ok, (val - z[:, None]) * h, 0.0), axis=1)
        return acc

    @triton.jit
    def _dots(x_ptr, d_ptr, lw_ptr, s_ptr, w_ptr, n1, n2, m, K, first, b_ptr, eo_ptr, ec_ptr, eb_ptr,
              HAS_DELTA: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr, TWO: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr, W12: tl.constexpr):
        # the row's dot products [BN] with the weight rows n1 (and n2 where TWO; rows where m), and the sum of
        # squares of its x + delta. The accumulators [BN, BK] are reduced once after the loop, so the loop is
        # loads and FMAs (and, for W12, the decode). The PDL wait (_pdl_enter) is here: with PRE the first weight
        # chunk loads before it (fused_layer's _norm_qkv_kernel says why)
        if W12:
            r1, rl1 = _w12_rows(n1, K)
            r2, rl2 = _w12_rows(n2, K)
            b1 = tl.load(b_ptr + n1, mask=m, other=0)
            b2 = tl.load(b_ptr + n2, mask=m, other=0)
        else:
            r1 = n1.to(tl.int64) * K
            r2 = n2.to(tl.int64) * K
            rl1, rl2, b1, b2 = r1, r2, n1, n2  # (unused)
        if not PRE:
            _pdl_enter(PDL)
        kk = tl.arange(0, BK)
        w1 = _w_chunk(w_ptr, r1, rl1, b1, m, kk, W12)
        if TWO:
            w2 = _w_chunk(w_ptr, r2, rl2, b2, m, kk, W12)
        else:
            w2 = w1
        if PRE:
            _pdl_enter(PDL)
        acc1 = tl.zeros([BN, BK], tl.float32)
        acc2 = tl.zeros([BN, BK], tl.float32)
        sq = tl.zeros([BK], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            h, v = _row_chunk(x_ptr, d_ptr, lw_ptr, s_ptr, kk, first, HAS_DELTA, NORM, STORE)
            sq += v * v
            if k0 > 0:  # (the first chunk's were loaded above)
                w1 = _w_chunk(w_ptr, r1, rl1, b1, m, kk, W12)
            acc1 += w1.to(tl.float32) * h[None, :]
            if TWO:
                if k0 > 0:
                    w2 = _w_chunk(w_ptr, r2, rl2, b2, m, kk, W12)
                acc2 += w2.to(tl.float32) * h[None, :]
        y1 = tl.sum(acc1, axis=1)
        y2 = tl.sum(acc2, axis=1)
        if W12:
            y1 += _w12_escapes(x_ptr, d_ptr, lw_ptr, s_ptr, eo_ptr, ec_ptr, eb_ptr, n1, m, b1, HAS_DELTA, NORM)
            if TWO:
                y2 += _w12_escapes(x_ptr, d_ptr, lw_ptr, s_ptr, eo_ptr, ec_ptr, eb_ptr, n2, m, b2, HAS_DELTA, NORM)
        return y1, y2, tl.sum(sq, axis=0)

    @triton.jit
    def _gemv_kernel(x_ptr, d_ptr, lw_ptr, w_ptr, s_ptr, out_ptr, b_ptr, eo_ptr, ec_ptr, eb_ptr, N, K, eps,
                     HAS_DELTA: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr, STORE: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr = False, PDL: tl.constexpr = False,
                     W12: tl.constexpr = False):
        # grid (cdiv(N, BN),): output columns [pid BN, pid BN + BN) of one row. SILU: they are gate columns,
        # and the up columns are weight rows N + col (a gate/up weight [2 N, K]). W12: the weight is a W12Gemv's
        # records (b_ptr, eo/ec/eb_ptr: its B_n << 7 and escape lists)
        pid = tl.program_id(0)
        cols = pid * BN + tl.arange(0, BN)
        cm = cols < N
        y, u, sq = _dots(x_ptr, d_ptr, lw_ptr, s_ptr, w_ptr, cols, cols + N, cm, K, pid == 0, b_ptr, eo_ptr, ec_ptr,
                         eb_ptr, HAS_DELTA, NORM, STORE, SILU, BN, BK, PRE, PDL, W12)
        if NORM:  # the norm's 1 / rms is a scalar of the row: applied after the sum
            rstd = tl.rsqrt(sq / K + eps)
            y = y * rstd
            u = u * rstd
        dt = out_ptr.dtype.element_ty
        if SILU:
            g = y.to(dt).to(tl.float32)  # gate and up rounded as a projection's output, then silu_mul_ref
            y = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u.to(dt).to(tl.float32)
        tl.store(out_ptr + cols, y.to(dt), mask=cm)

    @triton.jit
    def _qkv_gemv_kernel(x_ptr, d_ptr, lw_ptr, w_ptr, b_ptr, pos_ptr, slot_ptr, inv_ptr, s_ptr, q_ptr, k_ptr, v_ptr,
                         w12b_ptr, eo_ptr, ec_ptr, eb_ptr, K, eps, cache_h, cache_s, N_Q: tl.constexpr,
                         N_KV: tl.constexpr, HALF: tl.constexpr, HAS_DELTA: tl.constexpr, STORE_S: tl.constexpr,
                         HAS_BIAS: tl.constexpr, CB: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr = False,
                         PDL: tl.constexpr = False, W12: tl.constexpr = False):
        # grid (heads x HALF / CB,): program (head, cb) computes columns [cb CB, cb CB + CB) of the head's
        # two rotary halves (each column's RoPE partner in the same program), then rotates and stores them
        pid = tl.program_id(0)
        head = pid // (HALF // CB)
        i = (pid % (HALF // CB)) * CB + tl.arange(0, CB)  # columns of the first half; i + HALF their partners
        n1 = head * 2 * HALF + i
        y1, y2, sq = _dots(x_ptr, d_ptr, lw_ptr, s_ptr, w_ptr, n1, n1 + HALF, i < HALF, K, pid == 0, w12b_ptr, eo_ptr,
                           ec_ptr, eb_ptr, HAS_DELTA, True, STORE_S, True, CB, BK, PRE, PDL, W12)
        rstd = tl.rsqrt(sq / K + eps)
        a1 = (y1 * rstd)[None, :]  # [1, CB]: _qkv_store's [rows, CB] with one row
        a2 = (y2 * rstd)[None, :]
        if HAS_BIAS:
            a1 = a1 + tl.load(b_ptr + n1).to(tl.float32)[None, :]
            a2 = a2 + tl.load(b_ptr + n1 + HALF).to(tl.float32)[None, :]
        one = tl.arange(0, 1)
        _qkv_store(a1, a2, head, i, one, one < 1, pos_ptr, inv_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cache_h, cache_s,
                   x_ptr.dtype.element_ty, N_Q, N_KV, HALF)
