"""y = x @ W^T with W in W12 records, for the 1-64 rows of decoding and tree verification.

The Triton kernel reads each 12 KB record once, decodes it to bf16 in registers and feeds the
tensor cores, so a pass reads 12/16 of bf16's weight bytes. It is deterministic: each program owns
a block of 128 output channels and a fixed, contiguous range of column tiles, walks it in order,
and writes an fp32 partial; a second kernel sums the partials in split order and adds each
channel's escapes (x[:, column] * value) in list order. The split depends only on the shape and
the GPU's SM count, so a deployment always reduces in the same order.

Beside it: `w12_linear_ref` (decode, then one matmul: the semantics) and `w12_linear_emulated`
(the kernel's own walk over tiles, halves and escapes, in torch; what the CPU tests run).

NOTE: not yet in the decode path; the loader decodes W12 to bf16 at load time. Running this
kernel inside the CUDA-graph runner is later work (issue 15).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.quant.w12 import TILE_K, TILE_N, VIEW_BYTES, W12Escapes, W12Records, check_w12, decode_w12, dense_escapes

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

MAX_BLOCK_M = 64


def w12_linear_ref(x: torch.Tensor, records: W12Records, escapes: W12Escapes) -> torch.Tensor:
    """Reference: decode the matrix to bf16, then x @ W^T. x: [..., K] -> [..., N]."""
    w = decode_w12(records, escapes).to(x.device)  # [N, K] bf16
    return F.linear(x.to(w.dtype), w)


@dataclass(frozen=True)
class W12Packed:
    """A W12 matrix laid out for the kernel, on its device."""

    data: torch.Tensor  # [tn, tk, 12288] uint8
    base: torch.Tensor  # [tn * 128] int32: window bases, zero-padded to whole tiles
    esc_cols: torch.Tensor  # [N, E_max] int32: escape columns per channel (padding: 0)
    esc_vals: torch.Tensor  # [N, E_max] bf16: escape values (padding: 0)
    shape: tuple[int, int]


def pack_w12(records: W12Records, escapes: W12Escapes, device: str | torch.device) -> W12Packed:
    check_w12(records, escapes)
    n, _ = records.shape
    tn = records.data.shape[0]
    base = torch.zeros(tn * TILE_N, dtype=torch.int32)
    base[:n] = records.base.cpu().to(torch.int32)
    cols, vals = dense_escapes(escapes, n)
    return W12Packed(records.data.to(device).contiguous(), base.to(device), cols.to(device).contiguous(),
                     vals.to(device).contiguous(), records.shape)


def split_for(n_tiles: int, k_tiles: int, sms: int) -> tuple[int, int]:
    """(number of K splits, column tiles per split): about two programs per SM at one row block.
    NOTE: it ignores the row count, so a row's reduction order does not depend on the batch."""
    want = max(1, -(-2 * sms // max(n_tiles, 1)))
    per = max(1, -(-k_tiles // min(want, k_tiles)))
    return -(-k_tiles // per), per


def _decode_tile_torch(view: torch.Tensor, low: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """[128, 32] 8-bit view bytes + [128, 32] low nibbles + [128] bases -> [128, 32] bf16 (as the kernel)."""
    v, lo = view.to(torch.int32), low.to(torch.int32)
    sign, off, mant = v >> 7, (v >> 3) & 0xF, ((v & 0x7) << 4) | lo
    bits = (sign << 15) | ((base[:, None] + off) << 7) | mant
    bits = torch.where((off | mant) == 0, sign << 15, bits)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


def w12_linear_emulated(x: torch.Tensor, records: W12Records, escapes: W12Escapes, sms: int = 4) -> torch.Tensor:
    """The kernel's algorithm in torch (CPU): same tiles, halves, split-K and escape epilogue."""
    p = pack_w12(records, escapes, "cpu")
    n, k = p.shape
    tn, tk, _ = p.data.shape
    lead, x2 = x.shape[:-1], x.reshape(-1, k)
    m = x2.shape[0]
    xp = F.pad(x2.float(), (0, tk * TILE_K - k))  # [M, tk*64]
    splits, per = split_for(tn, tk, sms)
    part = torch.zeros(splits, m, tn * TILE_N)  # [split, M, Np] fp32
    h = TILE_K // 2
    for pn in range(tn):
        base = p.base[pn * TILE_N:(pn + 1) * TILE_N]
        for s in range(splits):
            acc = torch.zeros(m, TILE_N)
            for kt in range(s * per, min((s + 1) * per, tk)):
                rec = p.data[pn, kt]
                view, low = rec[:VIEW_BYTES].view(TILE_N, TILE_K), rec[VIEW_BYTES:].view(TILE_N, h)
                w_a = _decode_tile_torch(view[:, :h], low & 0xF, base).float()  # columns 0..31
                w_b = _decode_tile_torch(view[:, h:], low >> 4, base).float()  # columns 32..63
                acc += xp[:, kt * TILE_K:kt * TILE_K + h] @ w_a.T
                acc += xp[:, kt * TILE_K + h:(kt + 1) * TILE_K] @ w_b.T
            part[s, :, pn * TILE_N:(pn + 1) * TILE_N] = acc
    y = part[0]
    for s in range(1, splits):
        y = y + part[s]
    y = y[:, :n]
    for e in range(p.esc_cols.shape[1]):
        y = y + xp[:, p.esc_cols[:, e].long()] * p.esc_vals[:, e].float()  # [M, N]
    return y.to(torch.bfloat16).reshape(*lead, n)


if triton is not None:

    @triton.jit
    def _decode_tile(view, low, base):
        # view, low: [128, 32] uint8; base: [128] int32 -> [128, 32] bf16
        v = view.to(tl.int32)
        lo = low.to(tl.int32)
        sign = v >> 7
        off = (v >> 3) & 0xF
        mant = ((v & 0x7) << 4) | lo
        bits = (sign << 15) | ((base[:, None] + off) << 7) | mant
        bits = tl.where((off | mant) == 0, sign << 15, bits)  # the reserved code: escapes and padding
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _w12_splitk_kernel(x_ptr, rec_ptr, base_ptr, part_ptr, M, K, n_ktiles, per_split, stride_xm, Np,
                           BLOCK_M: tl.constexpr):
        pid_n = tl.program_id(0)  # block of 128 output channels
        pid_s = tl.program_id(1)  # K split
        pid_m = tl.program_id(2)  # block of rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        offs_n = tl.arange(0, 128)
        offs_h = tl.arange(0, 32)
        m_ok = offs_m[:, None] < M  # [BM, 1]
        base = tl.load(base_ptr + pid_n * 128 + offs_n)  # [128] int32
        acc = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        kt_lo = pid_s * per_split
        kt_hi = tl.minimum(kt_lo + per_split, n_ktiles)
        for kt in range(kt_lo, kt_hi):  # fixed order: the split's tiles, left to right
            rec = rec_ptr + (pid_n * n_ktiles + kt).to(tl.int64) * 12288
            view_a = tl.load(rec + offs_n[:, None] * 64 + offs_h[None, :])  # [128, 32] columns 0..31
            view_b = tl.load(rec + offs_n[:, None] * 64 + 32 + offs_h[None, :])  # columns 32..63
            low = tl.load(rec + 8192 + offs_n[:, None] * 32 + offs_h[None, :])  # [128, 32] two nibbles each
            w_a = _decode_tile(view_a, low & 0xF, base)
            w_b = _decode_tile(view_b, low >> 4, base)
            col = kt * 64 + offs_h  # [32]
            x_a = tl.load(x_ptr + offs_m[:, None] * stride_xm + col[None, :], mask=m_ok & (col[None, :] < K),
                          other=0.0)  # [BM, 32]
            x_b = tl.load(x_ptr + offs_m[:, None] * stride_xm + (col + 32)[None, :],
                          mask=m_ok & ((col + 32)[None, :] < K), other=0.0)
            acc = tl.dot(x_a, tl.trans(w_a), acc=acc)
            acc = tl.dot(x_b, tl.trans(w_b), acc=acc)
        out = part_ptr + (pid_s * M + offs_m[:, None]).to(tl.int64) * Np + pid_n * 128 + offs_n[None, :]
        tl.store(out, acc, mask=m_ok)

    @triton.jit
    def _w12_reduce_kernel(part_ptr, x_ptr, esc_col_ptr, esc_val_ptr, y_ptr, M, N, Np, stride_xm, stride_ym,
                           n_split, e_max, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        mask = (offs_m[:, None] < M) & n_ok[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, n_split):  # partials in split order
            acc += tl.load(part_ptr + (s * M + offs_m[:, None]).to(tl.int64) * Np + offs_n[None, :], mask=mask,
                           other=0.0)
        for e in range(0, e_max):  # escapes in list order
            col = tl.load(esc_col_ptr + offs_n * e_max + e, mask=n_ok, other=0)  # [BN]
            val = tl.load(esc_val_ptr + offs_n * e_max + e, mask=n_ok, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + col[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += xv * val[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


def w12_linear(x: torch.Tensor, packed: W12Packed) -> torch.Tensor:
    """x: [..., K] on CUDA -> [..., N] bf16 through the Triton kernels. Deterministic for a given
    shape, row count and GPU (the K split is fixed by the shape and the SM count)."""
    n, k = packed.shape
    if triton is None or not x.is_cuda:
        raise RuntimeError("w12_linear needs Triton and a CUDA tensor; use w12_linear_ref or w12_linear_emulated")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).to(torch.bfloat16).contiguous()  # [M, K]
    m = x2.shape[0]
    tn, tk, _ = packed.data.shape
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    m_blocks = -(-m // block_m)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    splits, per = split_for(tn, tk, sms)
    np_ = tn * TILE_N
    part = torch.empty(splits, m, np_, dtype=torch.float32, device=x.device)  # [split, M, Np]
    _w12_splitk_kernel[(tn, splits, m_blocks)](x2, packed.data, packed.base, part, m, k, tk, per, x2.stride(0), np_,
                                               BLOCK_M=block_m, num_warps=4)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)  # [M, N]
    e_max = packed.esc_cols.shape[1]
    cols, vals = packed.esc_cols, packed.esc_vals
    if e_max == 0:  # NOTE: never read, but Triton refuses a pointer of an empty (null) tensor
        cols, vals = _dummy(x.device, torch.int32), _dummy(x.device, torch.bfloat16)
    block_n = 128
    _w12_reduce_kernel[(triton.cdiv(n, block_n), m_blocks)](part, x2, cols, vals, y, m, n, np_, x2.stride(0),
                                                            y.stride(0), splits, e_max, BLOCK_M=block_m,
                                                            BLOCK_N=block_n, num_warps=4)
    return y.reshape(*lead, n)
