"""y = x @ W^T with W in W12 records, for the 1-64 rows of decoding and tree verification.

At these row counts a GEMM is a read of the weights, so the kernel is built to stream them:

* Split-K over many programs. Program (pn, s) owns one block of 128 output channels (a row of
  records) and a fixed, contiguous range of column tiles; there are about two programs per SM
  (`split_for`), so every SM streams records even when N is small (o, down: 32 channel blocks).
* Whole records, wide loads. A record's 8 KB view and 4 KB low bits are contiguous; each half-tile
  load is [128, 32] bytes with 32 contiguous bytes per channel (16-byte vector loads).
* Decoding in registers with no select: bits = sign << 15 | ((view & 0x7F) << 4 | low) + (B_n << 7).
  The reserved code (escaped or padded slot) then decodes to z_n = 2^(B_n - 127) (exactly 0 when
  B_n = 0; B_n >= 0 always, see w12.py), never to a special value.
* Corrections instead of an escape epilogue. Each program carries a short list of (channel,
  column, value) corrections for its own tile range: every escape's value, and -z_n at every
  escaped slot (so the slot's z_n cancels). They go through the same tensor-core dot (a one-hot
  [128, 16] matrix of values times 16 gathered x columns), 16 at a time, after the record walk.
  A channel that escapes entirely (a row of zeros, say) costs nothing: its B_n is 0, so z_n = 0
  and zero-valued escapes need no correction. The old kernel looped over the longest escape list
  (K for such a channel) in every channel block, which is what made it 100-700x slower than cuBLAS.
* Rows in blocks of 16. Every tl.dot is [128, 32] x [32, 16] (records) or [128, 16] x [16, 16]
  (corrections) into its own [128, 16] fp32 accumulator; a program holds up to four of them
  (64 rows), so a record is decoded once for up to 64 rows.
* Deterministic, and independent of the row count: a row's output is the same chain of the same
  dots (its 16-row block's), in the same order: the split's tiles left to right, half a then half b,
  then the corrections in list order; then a second kernel sums the split partials in split order
  and rounds to bf16 once. The split depends only on the shape and the SM count fixed at packing.

Beside it: `w12_linear_ref` (decode, then one matmul: the semantics) and `w12_linear_emulated`
(the kernel's own walk in torch: packing, select-free decode, dot shapes, corrections, split
sums; what the CPU tests run).

NOTE: not yet in the decode path; the loader decodes W12 to bf16 at load time. Running this
kernel inside the CUDA-graph runner is later work (issue 15).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.quant.w12 import (TILE_K, TILE_N, VIEW_BYTES, W12Escapes, W12Records, _escape_rows, _from_bits,
                              check_w12, decode_w12, encode_w12)

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

ROW_BLOCK = 16  # rows per tl.dot: the smallest tensor-core N
MAX_ROW_BLOCKS = 4  # accumulators per program: up to 64 rows share one decode of each record
FIX_CHUNK = 16  # corrections per dot (its K); each program's list is padded to a multiple
PROGRAMS_PER_SM = 2


def w12_linear_ref(x: torch.Tensor, records: W12Records, escapes: W12Escapes) -> torch.Tensor:
    """Reference: decode the matrix to bf16, then x @ W^T. x: [..., K] -> [..., N]."""
    w = decode_w12(records, escapes).to(x.device)  # [N, K] bf16
    return F.linear(x.to(w.dtype), w)


@dataclass(frozen=True)
class W12Packed:
    """A W12 matrix laid out for the kernel, on its device, for one fixed K split."""

    data: torch.Tensor  # [tn, tk, 12288] uint8: the records, unchanged
    base7: torch.Tensor  # [tn * 128] int32: B_n << 7, zero for padded channels
    fix_off: torch.Tensor  # [tn * splits + 1] int32: program pn * splits + s owns fix_*[fix_off[p]:fix_off[p + 1]]
    fix_ch: torch.Tensor  # [F] int32: channel within the program's block of 128 (padding: 0)
    fix_col: torch.Tensor  # [F] int32: input column (padding: 0)
    fix_val: torch.Tensor  # [F] bf16: value to add times x[:, column] (padding: 0)
    shape: tuple[int, int]  # (N, K)
    splits: int  # K splits
    per: int  # column tiles per split


def split_for(n_tiles: int, k_tiles: int, sms: int, programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """(number of K splits, column tiles per split): at most programs_per_sm * sms programs per row
    group, as many as that allows. NOTE: it ignores the row count, so a row's reduction order does
    not depend on the batch."""
    if k_tiles == 0:
        return 1, 1
    want = max(1, min(k_tiles, programs_per_sm * sms // max(n_tiles, 1)))
    per = -(-k_tiles // want)
    return -(-k_tiles // per), per


def _corrections(records: W12Records, escapes: W12Escapes, splits: int, per: int):
    """Per-program correction lists (see the module docstring): (offsets, channel, column, value bits)."""
    n, k = records.shape
    tn = records.data.shape[0]
    rows = _escape_rows(escapes).cpu()  # [E]
    cols = escapes.index.cpu().long()  # [E]
    bits = escapes.bits.cpu().to(torch.int32) & 0xFFFF  # [E]
    zbits = records.base.cpu().to(torch.int32)[rows] << 7  # [E] what each escaped slot decodes to
    has_val = (bits & 0x7FFF) != 0  # +-0 escapes add nothing
    has_z = zbits != 0
    e_rows = torch.cat((rows[has_val], rows[has_z]))
    e_cols = torch.cat((cols[has_val], cols[has_z]))
    e_bits = torch.cat((bits[has_val], zbits[has_z] | 0x8000))  # -z_n
    kind = torch.cat((torch.zeros(int(has_val.sum()), dtype=torch.long),
                      torch.ones(int(has_z.sum()), dtype=torch.long)))  # value first, then -z_n
    prog = (e_rows // TILE_N) * splits + (e_cols // TILE_K) // per  # [F0]
    # a fixed order: program, channel, column, kind
    order = torch.argsort(((prog * max(n, 1) + e_rows) * max(k, 1) + e_cols) * 2 + kind)
    prog, e_rows, e_cols, e_bits = prog[order], e_rows[order], e_cols[order], e_bits[order]
    n_prog = tn * splits
    counts = torch.bincount(prog, minlength=n_prog)  # [P]
    padded = -(-counts // FIX_CHUNK) * FIX_CHUNK
    off = torch.zeros(n_prog + 1, dtype=torch.long)
    off[1:] = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # [P] index of each program's first entry in the sorted list
    pos = off[prog] + torch.arange(prog.numel()) - first[prog]  # [F0] slot in the padded list
    total = max(int(off[-1]), FIX_CHUNK)  # NOTE: never empty: Triton refuses a pointer of an empty tensor
    ch = torch.zeros(total, dtype=torch.int32)
    col = torch.zeros(total, dtype=torch.int32)
    val = torch.zeros(total, dtype=torch.int32)
    ch[pos], col[pos], val[pos] = (e_rows % TILE_N).int(), e_cols.int(), e_bits
    return off.int(), ch, col, _from_bits(val)


def pack_w12(records: W12Records, escapes: W12Escapes, device: str | torch.device, sms: int | None = None,
             programs_per_sm: int = PROGRAMS_PER_SM) -> W12Packed:
    """Lay a W12 matrix out for `w12_linear` on `device`. The K split is fixed here from `sms`
    (default: the CUDA device's SM count, 4 elsewhere), so every call reduces in the same order."""
    check_w12(records, escapes)
    if records.base.numel() and int(records.base.min()) < 0:  # written before bases were clamped at 0
        records, escapes = encode_w12(decode_w12(records, escapes))
    device = torch.device(device)
    if sms is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    n, _ = records.shape
    tn, tk, _ = records.data.shape
    splits, per = split_for(tn, tk, sms, programs_per_sm)
    base7 = torch.zeros(tn * TILE_N, dtype=torch.int32)
    base7[:n] = records.base.cpu().to(torch.int32) << 7
    off, ch, col, val = _corrections(records, escapes, splits, per)
    return W12Packed(records.data.to(device).contiguous(), base7.to(device), off.to(device), ch.to(device),
                     col.to(device), val.to(device), records.shape, splits, per)


def _decode_half_torch(view: torch.Tensor, low: torch.Tensor, base7: torch.Tensor) -> torch.Tensor:
    """[128, 32] view bytes + [128, 32] low nibbles (int32) + [128] B_n << 7 -> [128, 32] bf16, as the kernel
    decodes: no select, a reserved slot reads z_n = 2^(B_n - 127) (0 when B_n = 0)."""
    bits = ((view & 0x80) << 8) | ((((view & 0x7F) << 4) | low) + base7[:, None])
    return _from_bits(bits)


def w12_linear_emulated(x: torch.Tensor, records: W12Records, escapes: W12Escapes, sms: int = 4) -> torch.Tensor:
    """The kernel's algorithm in torch (CPU): same packing, decode, dot shapes, order and split sums.
    NOTE: each product is a fixed-shape [128, 32] x [32, 16] matmul, as the kernel's tl.dot, so a
    row's result does not depend on the other rows here either."""
    p = pack_w12(records, escapes, "cpu", sms=sms)
    n, k = p.shape
    tn, tk, _ = p.data.shape
    lead, x2 = x.shape[:-1], x.reshape(-1, k).to(torch.bfloat16)  # the kernel reads bf16 x
    m = x2.shape[0]
    mp = -(-m // ROW_BLOCK) * ROW_BLOCK
    xp = torch.zeros(mp, max(tk * TILE_K, 1))  # [Mp, tk * 64] fp32 copy of bf16 x, zero outside [M, K)
    xp[:m, :k] = x2.float()
    blocks = [slice(b, b + ROW_BLOCK) for b in range(0, mp, ROW_BLOCK)]
    h = TILE_K // 2
    part = torch.zeros(p.splits, mp, tn * TILE_N)  # [split, Mp, Np] fp32
    for pn in range(tn):
        base7 = p.base7[pn * TILE_N:(pn + 1) * TILE_N]
        for s in range(p.splits):
            acc = torch.zeros(TILE_N, mp)  # [128, Mp]: one [128, 16] accumulator per row block
            for kt in range(s * p.per, min((s + 1) * p.per, tk)):
                rec = p.data[pn, kt].to(torch.int32)
                view, low = rec[:VIEW_BYTES].view(TILE_N, TILE_K), rec[VIEW_BYTES:].view(TILE_N, h)
                w_a = _decode_half_torch(view[:, :h], low & 0xF, base7).float()  # columns 0..31
                w_b = _decode_half_torch(view[:, h:], low >> 4, base7).float()  # columns 32..63
                c = kt * TILE_K
                for b in blocks:
                    acc[:, b] = acc[:, b] + w_a @ xp[b, c:c + h].T  # [128, 32] @ [32, 16]
                    acc[:, b] = acc[:, b] + w_b @ xp[b, c + h:c + TILE_K].T
            lo, hi = int(p.fix_off[pn * p.splits + s]), int(p.fix_off[pn * p.splits + s + 1])
            for e in range(lo, hi, FIX_CHUNK):
                ch, col = p.fix_ch[e:e + FIX_CHUNK].long(), p.fix_col[e:e + FIX_CHUNK].long()
                val = p.fix_val[e:e + FIX_CHUNK].float()
                onehot = torch.where(torch.arange(TILE_N)[:, None] == ch[None, :], val[None, :], 0.0)  # [128, 16]
                for b in blocks:
                    acc[:, b] = acc[:, b] + onehot @ xp[b][:, col].T  # [128, 16] @ [16, 16]
            part[s, :, pn * TILE_N:(pn + 1) * TILE_N] = acc.T
    y = torch.zeros(mp, tn * TILE_N)
    for s in range(p.splits):  # split order, as the reduce kernel
        y = y + part[s]
    return y[:m, :n].to(torch.bfloat16).reshape(*lead, n)


if triton is not None:

    @triton.jit
    def _decode_half(view, low, base7):
        # view: [128, 32] uint8; low: [128, 32] int32 nibbles; base7: [128] int32 -> [128, 32] bf16
        v = view.to(tl.int32)  # zero-extended
        bits = ((v & 0x80) << 8) | ((((v & 0x7F) << 4) | low) + base7[:, None])  # < 2^16: see the docstring
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _x_t(x_ptr, rows, cols, M, K, stride_xm):
        # x^T [len(cols), 16] bf16: the block's rows as columns, zero outside [0, M) x [0, K)
        mask = (rows[None, :] < M) & (cols[:, None] < K)
        return tl.load(x_ptr + rows[None, :] * stride_xm + cols[:, None], mask=mask, other=0.0)

    @triton.jit
    def _w12_splitk_kernel(x_ptr, rec_ptr, base7_ptr, fix_off_ptr, fix_ch_ptr, fix_col_ptr, fix_val_ptr, part_ptr,
                           M, K, n_ktiles, per_split, n_splits, stride_xm, Np, ROW_BLOCKS: tl.constexpr):
        pid_n = tl.program_id(0)  # block of 128 output channels
        pid_s = tl.program_id(1)  # K split
        pid_g = tl.program_id(2)  # group of ROW_BLOCKS * 16 rows
        offs_n = tl.arange(0, 128)
        offs_h = tl.arange(0, 32)
        r0 = pid_g * (ROW_BLOCKS * 16) + tl.arange(0, 16)  # rows of block 0; block i is r0 + 16 i
        base7 = tl.load(base7_ptr + pid_n * 128 + offs_n)  # [128]
        acc0 = tl.zeros((128, 16), dtype=tl.float32)  # [channels, rows], one per row block
        acc1 = tl.zeros((128, 16), dtype=tl.float32)
        acc2 = tl.zeros((128, 16), dtype=tl.float32)
        acc3 = tl.zeros((128, 16), dtype=tl.float32)
        kt_lo = pid_s * per_split
        kt_hi = tl.minimum(kt_lo + per_split, n_ktiles)
        for kt in range(kt_lo, kt_hi):  # fixed order: the split's tiles, left to right
            rec = rec_ptr + (pid_n * n_ktiles + kt).to(tl.int64) * 12288
            view_a = tl.load(rec + offs_n[:, None] * 64 + offs_h[None, :])  # [128, 32] columns 0..31
            view_b = tl.load(rec + offs_n[:, None] * 64 + 32 + offs_h[None, :])  # columns 32..63
            low = tl.load(rec + 8192 + offs_n[:, None] * 32 + offs_h[None, :]).to(tl.int32)  # two nibbles each
            w_a = _decode_half(view_a, low & 0xF, base7)
            w_b = _decode_half(view_b, low >> 4, base7)
            col_a = kt * 64 + offs_h  # [32]
            col_b = col_a + 32
            acc0 = tl.dot(w_a, _x_t(x_ptr, r0, col_a, M, K, stride_xm), acc=acc0)
            acc0 = tl.dot(w_b, _x_t(x_ptr, r0, col_b, M, K, stride_xm), acc=acc0)
            if ROW_BLOCKS > 1:
                acc1 = tl.dot(w_a, _x_t(x_ptr, r0 + 16, col_a, M, K, stride_xm), acc=acc1)
                acc1 = tl.dot(w_b, _x_t(x_ptr, r0 + 16, col_b, M, K, stride_xm), acc=acc1)
            if ROW_BLOCKS > 2:
                acc2 = tl.dot(w_a, _x_t(x_ptr, r0 + 32, col_a, M, K, stride_xm), acc=acc2)
                acc2 = tl.dot(w_b, _x_t(x_ptr, r0 + 32, col_b, M, K, stride_xm), acc=acc2)
            if ROW_BLOCKS > 3:
                acc3 = tl.dot(w_a, _x_t(x_ptr, r0 + 48, col_a, M, K, stride_xm), acc=acc3)
                acc3 = tl.dot(w_b, _x_t(x_ptr, r0 + 48, col_b, M, K, stride_xm), acc=acc3)
        # corrections: escape values and -z_n at escaped slots, 16 per dot, in list order
        prog = pid_n * n_splits + pid_s
        e_lo = tl.load(fix_off_ptr + prog)
        e_hi = tl.load(fix_off_ptr + prog + 1)
        offs_e = tl.arange(0, 16)
        for e in range(e_lo, e_hi, 16):
            ch = tl.load(fix_ch_ptr + e + offs_e)  # [16]
            col = tl.load(fix_col_ptr + e + offs_e)  # [16]
            val = tl.load(fix_val_ptr + e + offs_e).to(tl.float32)  # [16]
            onehot = tl.where(offs_n[:, None] == ch[None, :], val[None, :], 0.0).to(tl.bfloat16)  # [128, 16], exact
            acc0 = tl.dot(onehot, _x_t(x_ptr, r0, col, M, K, stride_xm), acc=acc0)
            if ROW_BLOCKS > 1:
                acc1 = tl.dot(onehot, _x_t(x_ptr, r0 + 16, col, M, K, stride_xm), acc=acc1)
            if ROW_BLOCKS > 2:
                acc2 = tl.dot(onehot, _x_t(x_ptr, r0 + 32, col, M, K, stride_xm), acc=acc2)
            if ROW_BLOCKS > 3:
                acc3 = tl.dot(onehot, _x_t(x_ptr, r0 + 48, col, M, K, stride_xm), acc=acc3)
        chan = (pid_n * 128 + offs_n)[:, None]  # [128, 1]
        tl.store(part_ptr + (pid_s * M + r0[None, :]).to(tl.int64) * Np + chan, acc0, mask=r0[None, :] < M)
        if ROW_BLOCKS > 1:
            r = r0 + 16
            tl.store(part_ptr + (pid_s * M + r[None, :]).to(tl.int64) * Np + chan, acc1, mask=r[None, :] < M)
        if ROW_BLOCKS > 2:
            r = r0 + 32
            tl.store(part_ptr + (pid_s * M + r[None, :]).to(tl.int64) * Np + chan, acc2, mask=r[None, :] < M)
        if ROW_BLOCKS > 3:
            r = r0 + 48
            tl.store(part_ptr + (pid_s * M + r[None, :]).to(tl.int64) * Np + chan, acc3, mask=r[None, :] < M)

    @triton.jit
    def _w12_reduce_kernel(part_ptr, y_ptr, M, N, Np, stride_ym, n_splits, BLOCK_N: tl.constexpr):
        pid_n = tl.program_id(0)
        m = tl.program_id(1)  # one row
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for s in range(0, n_splits):  # partials in split order
            acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * Np + offs, mask=ok, other=0.0)
        tl.store(y_ptr + m.to(tl.int64) * stride_ym + offs, acc.to(tl.bfloat16), mask=ok)


def w12_linear(x: torch.Tensor, packed: W12Packed) -> torch.Tensor:
    """x: [..., K] on CUDA -> [..., N] bf16 through the Triton kernels. Deterministic, and a row's
    bits do not depend on the other rows or their number (see the module docstring)."""
    n, k = packed.shape
    if triton is None or not x.is_cuda:
        raise RuntimeError("w12_linear needs Triton and a CUDA tensor; use w12_linear_ref or w12_linear_emulated")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).to(torch.bfloat16).contiguous()  # [M, K]
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    tn, tk, _ = packed.data.shape
    row_blocks = min(MAX_ROW_BLOCKS, -(-m // ROW_BLOCK))
    groups = -(-m // (ROW_BLOCK * row_blocks))
    np_ = tn * TILE_N
    part = torch.empty(packed.splits, m, np_, dtype=torch.float32, device=x.device)  # [split, M, Np]
    _w12_splitk_kernel[(tn, packed.splits, groups)](
        x2, packed.data, packed.base7, packed.fix_off, packed.fix_ch, packed.fix_col, packed.fix_val, part,
        m, k, tk, packed.per, packed.splits, x2.stride(0), np_, ROW_BLOCKS=row_blocks, num_warps=4, num_stages=3)
    block_n = 1024
    _w12_reduce_kernel[(triton.cdiv(n, block_n), m)](part, y, m, n, np_, y.stride(0), packed.splits,
                                                     BLOCK_N=block_n, num_warps=4)
    return y.reshape(*lead, n)
