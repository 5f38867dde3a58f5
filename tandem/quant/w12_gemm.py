"""y = x @ W^T with W in W12 records, for the 1-64 rows of decoding and tree verification.

At these row counts a GEMM is a read of the weights, so both kernels are built to stream them.
`w12_linear` picks one by the row count M: M <= `gemv_max_rows` (GEMV_MAX_ROWS) runs the GEMV
kernel, more rows the tensor-core kernel.

Shared by both:

* A partition fixed at packing (`W12Plan`): program (block, split) owns a block of output channels
  and a contiguous range of column tiles, with enough splits for several programs per SM
  (`split_for`); it writes fp32 partials that a second kernel sums in split order and rounds to
  bf16 once (or, with one split, rounds and stores them itself). The split ignores M.
* Decoding in registers with no select: bits = sign << 15 | ((view & 0x7F) << 4 | low) + (B_n << 7).
  The reserved code (escaped or padded slot) then decodes to z_n = 2^(B_n - 127) (exactly 0 when
  B_n = 0; B_n >= 0 always, see w12.py), never to a special value. Padded columns meet x = 0.
* Corrections instead of an escape epilogue. Each escaped slot needs its value added and z_n taken
  away. Per program and channel, a cell with more than DENSE_SLOTS_PER_TILE slots per tile of the
  split is dense: a [2, per * 64] row pair (values, -z_n; zero elsewhere) dotted with x, so an
  escape-heavy channel (an outlier channel, denormals) costs a vector pass instead of a long serial
  list. (With the lists alone, the first version's H200 times matched about 1 us per 16 entries of
  its longest list: the benchmark's weights have a channel of denormals and one mostly below an
  outlier, 1-5k entries in one program, which is most of why it was 2-8x slower than cuBLAS.)
  The other slots go to the program's sparse list. A channel of zeros costs nothing: its B_n is 0,
  so z_n = 0 and zero-valued escapes need no correction. Every correction product is bf16 x bf16,
  exact in fp32, so only the additions round.
* Rows past M in a program's last row group recompute row M - 1 (never stored), so x needs no row
  masks; columns past K (the last tile, K % 64 != 0 only) read x = 0.

The GEMV kernel (M <= gemv_max_rows; no tensor cores, fp32 FMAs):

* Programs of `block_n` (32, 64 or 128) channels of one record row. A tile is read as 32-bit
  words: [block_n, 8] words of view bytes for columns 0..31, the same for 32..63, and [block_n, 8]
  words of low bytes (a thread holds one word of each for a few channels, so it needs only 8 columns
  of x per row). The next tile's words are loaded before the current one is decoded.
* SWAR decode: byte k of a view word and byte k of the low word are interleaved into 16-bit lanes
  v << 8 | l (two lanes per 32-bit op: PRMT in inline PTX with `asm=True`, shifts otherwise; the
  same bits), then one mask, add and OR give two bf16 patterns per op; bf16 bits << 16 are the fp32
  bits, so the weight feeds an FMA directly. (`asm=True` also prefetches the program's first 64
  sparse corrections into L2 before the record walk.)
* Rows in registers: up to 8 rows (a power of 2; more rows run as further row groups) share each
  decode. acc[row, channel, j] (j: the thread's word) gets, per tile, columns 4j .. 4j+3 of the
  first half, then of the second, in that order; at the end acc is summed over j by adjacent pairs
  (0+1, 2+3, ...; then again), then the sparse list is added entry by entry (value * x + (-z_n) * x),
  then each dense cell (a [rows, 64] accumulator, lane c % 64 taking column c's value * x then
  -z_n * x in column order, summed by adjacent pairs).
  Every step is elementwise per row, so a row's bits do not depend on M or the other rows, and
  `w12_gemv_emulated` reproduces them in torch (bitwise under Triton's interpreter; on a GPU too,
  as every product is exact, unless the GPU flushes denormals).

The tensor-core kernel (M > gemv_max_rows):

* Programs of 128 channels; each half tile is decoded (the GEMV kernel's words and lanes, repacked as
  [128, 32] bf16 in column order) and multiplied by 16-row blocks of x^T with tl.dot ([128, 32] x
  [32, 16]) into its own [128, 16] fp32 accumulator; a program holds up to four (64 rows), so a
  record is decoded once for up to 64 rows. (The first version loaded the tile as bytes, which
  Triton laid out one byte per thread and staged through shared memory: ~15 instructions per
  weight, against ~6 now in the SASS of an sm_90 build.)
* Sparse corrections go through the same tensor-core dot (a one-hot [128, 16] matrix of values times
  16 gathered x columns), 16 at a time, the next 16 loaded while one is applied; dense cells as in
  the GEMV kernel, per 16-row block.
* A row's output is the same chain of the same dots (its 16-row block's) in the same order: the
  split's tiles left to right, half a then half b, the sparse list, the dense cells; so it does not
  depend on M either, within this kernel.

NOTE: the two kernels sum in different orders, so a row's bits can differ between M <= gemv_max_rows
and M > gemv_max_rows (both are within rounding of `w12_linear_ref`). Code that needs a row's bits
to be the same in every batch (the engine's batch-invariant mode) must pin one kernel, e.g. pass
gemv_max_rows=0 (the tensor-core kernel for every M) or route through its own invariant kernels.

Knobs: the partitions are the packing's (`pack_w12`: programs_per_sm for the tensor-core kernel,
gemv_block_n and gemv_programs_per_sm for the GEMV; `plan_w12` makes one plan, for sweeps); the
launch ones are `w12_linear`'s (gemv_max_rows, num_warps, num_stages, PRMT in inline PTX). The
defaults are guesses until bench/gpu_w12.py --sweep has run on an H200.

Beside them: `w12_linear_ref` (decode, then one matmul: the semantics), `w12_linear_emulated` (the
tensor-core kernel's walk in torch) and `w12_gemv_emulated` (the GEMV kernel's arithmetic in torch).

NOTE: not yet in the decode path; the loader decodes W12 to bf16 at load time. Running these
kernels inside the CUDA-graph runner is later work (issue 15).
"""
from __future__ import annotations

import os
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
FIX_CHUNK = 16  # sparse corrections per step; each program's list is padded to a multiple
# tensor-core kernel: the H200 sweep's best at 8-64 rows on the 8B's qkv, o, gate_up and down (the head: 2),
# 2026-12-03 (bench/results/h200-2026-12-03-session14)
PROGRAMS_PER_SM = 4
DENSE_SLOTS_PER_TILE = 2  # a (channel, split) cell with more escaped slots than this per tile of the split is dense
DENSE_CHUNK = 64  # a dense cell's accumulator: columns c, c + 64, c + 128, ... add into lane c % 64
# default: w12_linear runs the GEMV kernel up to this many rows. A guess from sm_90 SASS: the GEMV's main loop issues
# ~6.4 instructions per weight at 1 row and ~1.2 more per row (~14 at 8 rows, about what an SM can issue while
# streaming 1.5 bytes a weight at HBM speed), the tensor-core kernel's ~6.2 at up to 16 rows (~8.5 at 64)
GEMV_MAX_ROWS = 4
GEMV_ROWS = 8  # rows per GEMV program at most (more: further row groups)
GEMV_BLOCK_N = 64  # the H200 sweep's best at one row on o, gate_up, down and the head (qkv: 128)
GEMV_PROGRAMS_PER_SM = 4  # the sweep: best on qkv and o; gate_up and down ran best at 16, the head at 8


def w12_linear_ref(x: torch.Tensor, records: W12Records, escapes: W12Escapes) -> torch.Tensor:
    """Reference: decode the matrix to bf16, then x @ W^T. x: [..., K] -> [..., N]."""
    w = decode_w12(records, escapes).to(x.device)  # [N, K] bf16
    return F.linear(x.to(w.dtype), w)


@dataclass(frozen=True)
class W12Plan:
    """A partition of a W12 matrix into programs and each program's corrections. Program
    p = block * splits + split owns channels [block * block_n, +block_n) and column tiles
    [split * per, +per)."""

    block_n: int
    splits: int
    per: int
    fix_off: torch.Tensor  # [P + 1] int32: program p owns fix_*[fix_off[p]:fix_off[p + 1]], a multiple of FIX_CHUNK
    fix_ch: torch.Tensor  # [F + FIX_CHUNK] int32: channel within the block (padding, and 16 more at the end: 0)
    fix_col: torch.Tensor  # [F + FIX_CHUNK] int32: input column
    # [F + FIX_CHUNK]: value to add times x[:, column]; bf16 in unpaired (tensor-core) plans, which have one entry
    # per term (an escape value, or -z_n), fp32 holding the bf16 value in paired (GEMV) plans (no conversion there)
    fix_val: torch.Tensor
    fix_negz: torch.Tensor  # [F + FIX_CHUNK] fp32, paired plans: -z_n of the entry's slot; unpaired: empty
    dense_off: torch.Tensor  # [P + 1] int32: program p owns dense cells dense_off[p]:dense_off[p + 1]
    dense_ch: torch.Tensor  # [max(D, 1)] int32: channel within the block of each dense cell
    dense_val: torch.Tensor  # [max(D, 1), 2, per * 64] fp32 (bf16 values): escapes, then -z_n at escaped slots


@dataclass(frozen=True)
class W12Packed:
    """A W12 matrix laid out for the kernels, on its device, with one fixed plan per kernel."""

    data: torch.Tensor  # [tn, tk, 12288] uint8: the records, unchanged
    base7: torch.Tensor  # [tn * 128] int32: B_n << 7, zero for padded channels
    shape: tuple[int, int]  # (N, K)
    dot: W12Plan  # the tensor-core kernel's: blocks of 128, unpaired corrections
    gemv: W12Plan  # the GEMV kernel's: blocks of block_n, paired corrections

    # the tensor-core plan under its old names
    splits = property(lambda self: self.dot.splits)
    per = property(lambda self: self.dot.per)
    fix_off = property(lambda self: self.dot.fix_off)
    fix_ch = property(lambda self: self.dot.fix_ch)
    fix_col = property(lambda self: self.dot.fix_col)
    fix_val = property(lambda self: self.dot.fix_val)


def split_for(n_tiles: int, k_tiles: int, sms: int, programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """(number of K splits, column tiles per split): at most programs_per_sm * sms programs for
    n_tiles channel blocks, as many as that allows. NOTE: it ignores the row count, so a row's
    reduction order does not depend on the batch."""
    if k_tiles == 0:
        return 1, 1
    want = max(1, min(k_tiles, programs_per_sm * sms // max(n_tiles, 1)))
    per = -(-k_tiles // want)
    return -(-k_tiles // per), per


def _padded_lists(prog: torch.Tensor, n_prog: int, cols: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Entries already sorted by program -> (offsets [P + 1], columns padded per program to a multiple of
    FIX_CHUNK, plus FIX_CHUNK zero entries at the end so a kernel may load one chunk past its list)."""
    counts = torch.bincount(prog, minlength=n_prog)  # [P]
    padded = -(-counts // FIX_CHUNK) * FIX_CHUNK
    off = torch.zeros(n_prog + 1, dtype=torch.long)
    off[1:] = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # [P] index of each program's first entry
    pos = off[prog] + torch.arange(prog.numel()) - first[prog]  # [F0] slot in the padded list
    out = []
    for c in cols:
        t = torch.zeros(int(off[-1]) + FIX_CHUNK, dtype=c.dtype)
        t[pos] = c
        out.append(t)
    return off.int(), out


def _plan(records: W12Records, escapes: W12Escapes, block_n: int, splits: int, per: int, paired: bool) -> W12Plan:
    """Corrections for one partition (see the module docstring), on the CPU."""
    n, k = records.shape
    n_prog = records.data.shape[0] * (TILE_N // block_n) * splits
    rows = _escape_rows(escapes).cpu()  # [E]
    cols = escapes.index.cpu().long()  # [E]
    bits = escapes.bits.cpu().to(torch.int32) & 0xFFFF  # [E]
    zbits = records.base.cpu().to(torch.int32)[rows] << 7  # [E] what each escaped slot decodes to
    has_val, has_z = (bits & 0x7FFF) != 0, zbits != 0  # +-0 escapes add nothing; z_n = 0 needs no fix
    need = has_val | has_z
    rows, cols, bits, zbits, has_val, has_z = (t[need] for t in (rows, cols, bits, zbits, has_val, has_z))
    split = cols // TILE_K // per  # [S]
    prog = rows // block_n * splits + split
    cell = rows * splits + split  # (channel, split)
    heavy = torch.bincount(cell, minlength=max(n * splits, 1))[cell] > DENSE_SLOTS_PER_TILE * per  # [S]
    val = torch.where(has_val, bits, 0)
    negz = torch.where(has_z, zbits | 0x8000, 0)  # -z_n

    # dense cells, ordered by program, then channel
    cells, inv = torch.unique(cell[heavy], return_inverse=True)
    c_rows = cells // splits
    c_prog = c_rows // block_n * splits + cells % splits
    order = torch.argsort(c_prog * max(n, 1) + c_rows)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    n_dense = cells.numel()
    dense = torch.zeros(max(n_dense, 1), 2, per * TILE_K, dtype=torch.int32)
    d, pos = rank[inv], cols[heavy] - split[heavy] * per * TILE_K
    dense[d, 0, pos], dense[d, 1, pos] = val[heavy], negz[heavy]
    dense_ch = torch.zeros(max(n_dense, 1), dtype=torch.int32)
    dense_ch[:n_dense] = (c_rows[order] % block_n).int()
    dense_off = torch.zeros(n_prog + 1, dtype=torch.int32)
    dense_off[1:] = torch.bincount(c_prog, minlength=n_prog).cumsum(0)

    # sparse lists, in a fixed order: program, channel, column (, kind: value first, then -z_n)
    light = ~heavy
    rows, cols, prog, val, negz, has_val, has_z = (t[light] for t in (rows, cols, prog, val, negz, has_val, has_z))
    if paired:
        kind = torch.zeros_like(rows)
    else:  # one entry per term
        rows, cols, prog = (torch.cat((t[has_val], t[has_z])) for t in (rows, cols, prog))
        val = torch.cat((val[has_val], negz[has_z]))
        kind = torch.cat((torch.zeros(int(has_val.sum()), dtype=torch.long),
                          torch.ones(int(has_z.sum()), dtype=torch.long)))
        negz = torch.zeros(0, dtype=torch.int32)
    order = torch.argsort(((prog * max(n, 1) + rows) * max(k, 1) + cols) * 2 + kind)
    lists = [(rows[order] % block_n).int(), cols[order].int(), val[order]] + ([negz[order]] if paired else [])
    off, lists = _padded_lists(prog[order], n_prog, lists)
    if paired:
        val, negz = _from_bits(lists[2]).float(), _from_bits(lists[3]).float()
    else:
        val, negz = _from_bits(lists[2]), torch.zeros(0)
    return W12Plan(block_n, splits, per, off, lists[0], lists[1], val, negz, dense_off, dense_ch,
                   _from_bits(dense).float())


def _to(plan: W12Plan, device: torch.device) -> W12Plan:
    return W12Plan(*(getattr(plan, f).to(device) if isinstance(getattr(plan, f), torch.Tensor) else getattr(plan, f)
                     for f in W12Plan.__dataclass_fields__))


def _sms(device: torch.device, sms: int | None) -> int:
    if sms is not None:
        return sms
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _current(records: W12Records, escapes: W12Escapes) -> tuple[W12Records, W12Escapes]:
    check_w12(records, escapes)
    if records.base.numel() and int(records.base.min()) < 0:  # written before bases were clamped at 0
        records, escapes = encode_w12(decode_w12(records, escapes))
    return records, escapes


def plan_w12(records: W12Records, escapes: W12Escapes, device: str | torch.device, kernel: str,
             programs_per_sm: int, block_n: int = TILE_N, sms: int | None = None) -> W12Plan:
    """One kernel's plan on `device`: kernel "dot" (blocks of 128 channels, unpaired corrections) or "gemv"
    (blocks of block_n, paired corrections), with at most about programs_per_sm * sms programs per row group.
    (pack_w12 makes both; a sweep swaps plans into a packing with dataclasses.replace.)"""
    records, escapes = _current(records, escapes)
    if kernel not in ("dot", "gemv") or block_n not in (32, 64, 128) or (kernel == "dot" and block_n != TILE_N):
        raise ValueError(f"no {kernel!r} plan with blocks of {block_n} channels (dot: 128; gemv: 32, 64 or 128)")
    device = torch.device(device)
    tn, tk, _ = records.data.shape
    blocks = tn * (TILE_N // block_n)
    plan = _plan(records, escapes, block_n, *split_for(blocks, tk, _sms(device, sms), programs_per_sm),
                 paired=kernel == "gemv")
    return _to(plan, device)


def pack_w12(records: W12Records, escapes: W12Escapes, device: str | torch.device, sms: int | None = None,
             programs_per_sm: int = PROGRAMS_PER_SM, gemv_block_n: int = GEMV_BLOCK_N,
             gemv_programs_per_sm: int = GEMV_PROGRAMS_PER_SM) -> W12Packed:
    """Lay a W12 matrix out for `w12_linear` on `device`. Both kernels' partitions are fixed here from
    `sms` (default: the CUDA device's SM count, 4 elsewhere), so every call reduces in the same order."""
    records, escapes = _current(records, escapes)
    device = torch.device(device)
    sms = _sms(device, sms)
    n, _ = records.shape
    tn = records.data.shape[0]
    base7 = torch.zeros(tn * TILE_N, dtype=torch.int32)
    base7[:n] = records.base.cpu().to(torch.int32) << 7
    return W12Packed(records.data.to(device).contiguous(), base7.to(device), records.shape,
                     plan_w12(records, escapes, device, "dot", programs_per_sm, sms=sms),
                     plan_w12(records, escapes, device, "gemv", gemv_programs_per_sm, gemv_block_n, sms=sms))


def _decode_half_torch(view: torch.Tensor, low: torch.Tensor, base7: torch.Tensor) -> torch.Tensor:
    """[128, 32] view bytes + [128, 32] low nibbles (int32) + [128] B_n << 7 -> [128, 32] bf16, as the kernel
    decodes: no select, a reserved slot reads z_n = 2^(B_n - 127) (0 when B_n = 0)."""
    bits = ((view & 0x80) << 8) | ((((view & 0x7F) << 4) | low) + base7[:, None])
    return _from_bits(bits)


def _kernel_weights(p: W12Packed) -> torch.Tensor:
    """[tn * 128, tk * 64] fp32: every slot as the kernels decode it (reserved slots read z_n)."""
    tn, tk, _ = p.data.shape
    rec = p.data.to(torch.int32)
    view = rec[..., :VIEW_BYTES].reshape(tn, tk, TILE_N, TILE_K)
    low = rec[..., VIEW_BYTES:].reshape(tn, tk, TILE_N, TILE_K // 2)
    low = torch.cat((low & 0xF, low >> 4), dim=-1)  # [tn, tk, 128, 64]
    b7 = p.base7.view(tn, 1, TILE_N, 1)
    bits = ((view & 0x80) << 8) | ((((view & 0x7F) << 4) | low) + b7)
    return _from_bits(bits).float().permute(0, 2, 1, 3).reshape(tn * TILE_N, tk * TILE_K)


def _pairwise(t: torch.Tensor) -> torch.Tensor:
    """Sum the last axis (a power of 2) by adjacent pairs, level by level, as the kernels do."""
    while t.shape[-1] > 1:
        t = t[..., 0::2] + t[..., 1::2]
    return t[..., 0]


def _dense_emulated(xp: torch.Tensor, plan: W12Plan, d: int, col0: int, span: int) -> torch.Tensor:
    """A dense cell's sum for every row of xp ([rows, >= col0 + span] fp32, zero beyond K) -> [rows]."""
    acc = torch.zeros(xp.shape[0], DENSE_CHUNK)
    vals = F.pad(plan.dense_val[d].float(), (0, DENSE_CHUNK))  # [2, per * 64 + DENSE_CHUNK]
    for c in range(0, span, DENSE_CHUNK):
        xs = F.pad(xp[:, col0 + c:col0 + min(c + DENSE_CHUNK, span)], (0, max(0, c + DENSE_CHUNK - span)))
        acc = acc + vals[0, c:c + DENSE_CHUNK] * xs
        acc = acc + vals[1, c:c + DENSE_CHUNK] * xs
    return _pairwise(acc)


def _padded_x(x: torch.Tensor, k: int, width: int, rows: int) -> tuple[torch.Tensor, tuple, int]:
    """x [..., K] -> (fp32 copy of its bf16 values [rows >= M, width], zero outside [M, K); leading shape; M)."""
    lead, x2 = x.shape[:-1], x.reshape(-1, k).to(torch.bfloat16)  # the kernels read bf16 x
    m = x2.shape[0]
    xp = torch.zeros(max(rows, m), max(width, 1))
    xp[:m, :k] = x2.float()
    return xp, lead, m


def w12_linear_emulated(x: torch.Tensor, records: W12Records, escapes: W12Escapes, sms: int = 4,
                        programs_per_sm: int = PROGRAMS_PER_SM) -> torch.Tensor:
    """The tensor-core kernel's algorithm in torch (CPU): same packing, decode, dot shapes, order and
    split sums. NOTE: each product is a fixed-shape [128, 32] x [32, 16] matmul, as the kernel's tl.dot,
    so a row's result does not depend on the other rows here either (its bits are the GPU's only to
    within the tensor cores' summation order)."""
    p = pack_w12(records, escapes, "cpu", sms=sms, programs_per_sm=programs_per_sm)
    plan = p.dot
    n, k = p.shape
    tn, tk, _ = p.data.shape
    mp = -(-x.reshape(-1, k).shape[0] // ROW_BLOCK) * ROW_BLOCK
    xp, lead, m = _padded_x(x, k, tk * TILE_K, mp)  # [Mp, tk * 64]
    mp = xp.shape[0]
    blocks = [slice(b, b + ROW_BLOCK) for b in range(0, mp, ROW_BLOCK)]
    h = TILE_K // 2
    wk = _kernel_weights(p)  # [Np, tk * 64]
    part = torch.zeros(plan.splits, mp, tn * TILE_N)  # [split, Mp, Np] fp32
    for pn in range(tn):
        for s in range(plan.splits):
            prog = pn * plan.splits + s
            acc = torch.zeros(TILE_N, mp)  # [128, Mp]: one [128, 16] accumulator per row block
            kt_lo, kt_hi = s * plan.per, min((s + 1) * plan.per, tk)
            for kt in range(kt_lo, kt_hi):
                w = wk[pn * TILE_N:(pn + 1) * TILE_N, kt * TILE_K:(kt + 1) * TILE_K]
                c = kt * TILE_K
                for b in blocks:
                    acc[:, b] = acc[:, b] + w[:, :h] @ xp[b, c:c + h].T  # [128, 32] @ [32, 16]
                    acc[:, b] = acc[:, b] + w[:, h:] @ xp[b, c + h:c + TILE_K].T
            lo, hi = int(plan.fix_off[prog]), int(plan.fix_off[prog + 1])
            for e in range(lo, hi, FIX_CHUNK):
                ch, col = plan.fix_ch[e:e + FIX_CHUNK].long(), plan.fix_col[e:e + FIX_CHUNK].long()
                val = plan.fix_val[e:e + FIX_CHUNK].float()
                onehot = torch.where(torch.arange(TILE_N)[:, None] == ch[None, :], val[None, :], 0.0)  # [128, 16]
                for b in blocks:
                    acc[:, b] = acc[:, b] + onehot @ xp[b][:, col].T  # [128, 16] @ [16, 16]
            for d in range(int(plan.dense_off[prog]), int(plan.dense_off[prog + 1])):
                acc[int(plan.dense_ch[d])] += _dense_emulated(xp, plan, d, kt_lo * TILE_K, (kt_hi - kt_lo) * TILE_K)
            part[s, :, pn * TILE_N:(pn + 1) * TILE_N] = acc.T
    return _split_sums(part, m, n, lead)


def _split_sums(part: torch.Tensor, m: int, n: int, lead: tuple) -> torch.Tensor:
    """The reduce kernel: [splits, >= M, >= N] fp32 partials summed in split order, rounded to bf16 once.
    One split: the program stores its partial rounded (no 0 + p, which would turn -0 into +0)."""
    y = part[0]
    if part.shape[0] > 1:
        y = torch.zeros_like(part[0])
        for s in range(part.shape[0]):
            y = y + part[s]
    return y[:m, :n].to(torch.bfloat16).reshape(*lead, n)


def w12_gemv_emulated(x: torch.Tensor, records: W12Records, escapes: W12Escapes, sms: int = 4,
                      block_n: int = GEMV_BLOCK_N, programs_per_sm: int = GEMV_PROGRAMS_PER_SM) -> torch.Tensor:
    """The GEMV kernel's arithmetic in torch (CPU), step for step (see the module docstring): the bits
    of `w12_linear` at M <= gemv_max_rows with the same packing."""
    p = pack_w12(records, escapes, "cpu", sms=sms, gemv_block_n=block_n, gemv_programs_per_sm=programs_per_sm)
    plan = p.gemv
    n, k = p.shape
    tn, tk, _ = p.data.shape
    xp, lead, m = _padded_x(x, k, tk * TILE_K, 0)  # [M, tk * 64]
    wk = _kernel_weights(p)  # [Np, tk * 64]
    np_, bn = tn * TILE_N, plan.block_n
    j4 = 4 * torch.arange(8)
    part = torch.zeros(plan.splits, m, np_)
    for blk in range(np_ // bn):
        chans = slice(blk * bn, (blk + 1) * bn)
        for s in range(plan.splits):
            prog = blk * plan.splits + s
            kt_lo, kt_hi = s * plan.per, min((s + 1) * plan.per, tk)
            acc = torch.zeros(m, bn, 8)  # [rows, channels, j]
            for kt in range(kt_lo, kt_hi):
                for c in (kt * TILE_K + j4 + q + half for half in (0, 32) for q in range(4)):  # [8] columns
                    acc = acc + wk[chans][:, c][None] * xp[:, c][:, None, :]
            y = _pairwise(acc)  # [rows, channels]
            for e in range(int(plan.fix_off[prog]), int(plan.fix_off[prog + 1])):
                ch, col = int(plan.fix_ch[e]), int(plan.fix_col[e])
                val, negz = plan.fix_val[e].float(), plan.fix_negz[e].float()
                if val != 0 or negz != 0:  # padding is skipped
                    y[:, ch] = y[:, ch] + (val * xp[:, col] + negz * xp[:, col])
            for d in range(int(plan.dense_off[prog]), int(plan.dense_off[prog + 1])):
                ch = int(plan.dense_ch[d])
                y[:, ch] = y[:, ch] + _dense_emulated(xp, plan, d, kt_lo * TILE_K, (kt_hi - kt_lo) * TILE_K)
            part[s, :, chans] = y
    return _split_sums(part, m, n, lead)


if triton is not None:
    # sizes that vary with the shape and the plan but not the code: not specialized on (fewer compilations)
    _RUNTIME_INTS = ["M", "N", "K", "n_ktiles", "per_split", "n_splits"]

    # ---- shared ---------------------------------------------------------------------------------------------
    # NOTE: bf16 <-> fp32 conversions go through the bits: exact, and the same under Triton's CPU interpreter (3.6),
    # whose own casts truncate on the way down and flush bf16 denormals on the way up.

    @triton.jit
    def _f32(t):
        # bf16 -> fp32, exactly
        return (t.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_bf16(y):
        # fp32 -> bf16, round to nearest even (NaN -> 0x7FC0), as torch's .to(torch.bfloat16)
        b = y.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _dot(a, b, acc, F32: tl.constexpr):
        # bf16 tensor-core dot; F32 (the CPU interpreter, which multiplies bf16 dot operands as raw bits): fp32
        # operands instead. The products are exact either way.
        if F32:
            return tl.dot(_f32(a), _f32(b), acc=acc, input_precision="ieee")
        return tl.dot(a, b, acc=acc)

    @triton.jit
    def _pair_tree(t, R: tl.constexpr, N: tl.constexpr):
        # [R, N] -> [R]: adjacent pairs summed, level by level (a fixed order, whatever the layout)
        for i in tl.static_range(N.bit_length() - 1):
            a, b = tl.split(tl.reshape(t, (R, N >> (i + 1), 2)))
            t = a + b
        return tl.reshape(t, (R,))

    @triton.jit
    def _dense_sum(x16_ptr, rows_c, stride_xm, K, dv_ptr, per64, col0, span, R: tl.constexpr, DCH: tl.constexpr):
        # one dense cell: sum over the split's columns of (value + -z_n) * x for R rows -> [R] fp32.
        # x16_ptr: x as uint16 (bf16 bits); dv_ptr: the cell's [2, per64] fp32 row pair; rows_c: [R] row indices,
        # clamped into [0, M). Columns in blocks of DCH, each block's products added to a [R, DCH] accumulator in
        # column order (value, then -z_n), 4 blocks per step so that their loads are in flight together; then the
        # accumulator's adjacent pairs are summed.
        ar = tl.arange(0, DCH)
        acc = tl.zeros((R, DCH), dtype=tl.float32)
        for c in range(0, span, 4 * DCH):
            for i in tl.static_range(4):
                o = c + i * DCH + ar  # [DCH] columns of the split
                ok = o < span
                v = tl.load(dv_ptr + o, mask=ok, other=0.0)
                nz = tl.load(dv_ptr + per64 + o, mask=ok, other=0.0)
                xv = tl.load(x16_ptr + rows_c[:, None] * stride_xm + (col0 + o)[None, :],
                             mask=(ok & (col0 + o < K))[None, :], other=0)  # [R, DCH] bf16 bits
                xv = (xv.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                acc = acc + v[None, :] * xv
                acc = acc + nz[None, :] * xv
        return _pair_tree(acc, R, DCH)

    # ---- GEMV kernel ----------------------------------------------------------------------------------------

    @triton.jit
    def _lanes(V, L, ASM: tl.constexpr):
        # V: [BN, 8] uint32 words of view bytes; L: low bytes with the wanted nibble in each byte's HIGH half.
        # -> 16-bit lanes V_k << 8 | L_k: (byte 0 | byte 2 << 16, byte 1 | byte 3 << 16)
        if ASM:
            we, wo = tl.inline_asm_elementwise("prmt.b32 $0, $3, $2, 0x6240; prmt.b32 $1, $3, $2, 0x7351;",
                                               "=r,=r,r,r", [V, L], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        else:
            we = ((V & 0x00FF00FF) << 8) | (L & 0x00FF00FF)
            wo = (V & 0xFF00FF00) | ((L >> 8) & 0x00FF00FF)
        return we, wo

    @triton.jit
    def _prefetch_l2(ptrs):
        # ask L2 for these addresses now (inline PTX; no value comes back)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _bf16_lanes(w, b2):
        # lanes s.oooo.mmm.nnnn.xxxx -> bf16 bits: ((v & 0x7F) << 4 | nibble) + B_n << 7, sign on top. Lanes stay
        # below 0x8000 before the sign (B_n <= 239), so nothing carries across them.
        return (((w & 0x7FF07FF0) >> 4) + b2) | (w & 0x80008000)

    @triton.jit
    def _gemv_half(acc, V, L, b2, x01, x23, ASM: tl.constexpr):
        # half a tile: columns 4j + q of the half, q = 0..3 in order; x01, x23: [R, 8] words of x (two bf16 each)
        # acc [R, BN, 8] += w [BN, 8] * x [R, 8] for each column; fp32 bits = bf16 bits << 16; the products are exact
        we, wo = _lanes(V, L, ASM)
        te = _bf16_lanes(we, b2)  # bytes 0 and 2
        to = _bf16_lanes(wo, b2)  # bytes 1 and 3
        f32 = tl.float32
        w0, w1 = (te << 16).to(f32, bitcast=True), (to << 16).to(f32, bitcast=True)  # [BN, 8] columns 4j, 4j + 1
        w2, w3 = (te & 0xFFFF0000).to(f32, bitcast=True), (to & 0xFFFF0000).to(f32, bitcast=True)  # 4j + 2, 4j + 3
        x0, x1 = (x01 << 16).to(f32, bitcast=True), (x01 & 0xFFFF0000).to(f32, bitcast=True)  # [R, 8]
        x2, x3 = (x23 << 16).to(f32, bitcast=True), (x23 & 0xFFFF0000).to(f32, bitcast=True)
        acc = acc + w0[None, :, :] * x0[:, None, :]
        acc = acc + w1[None, :, :] * x1[:, None, :]
        acc = acc + w2[None, :, :] * x2[:, None, :]
        acc = acc + w3[None, :, :] * x3[:, None, :]
        return acc

    @triton.jit(do_not_specialize=_RUNTIME_INTS)
    def _w12_gemv_kernel(x_ptr, rec_ptr, base7_ptr, fix_off_ptr, fix_ch_ptr, fix_col_ptr, fix_val_ptr, fix_negz_ptr,
                         dense_off_ptr, dense_ch_ptr, dense_val_ptr, y_ptr, part_ptr, M, N, K, n_ktiles, per_split,
                         n_splits, stride_xm, Np, stride_ym, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                         ASM: tl.constexpr, EVEN_K: tl.constexpr, DCH: tl.constexpr):
        SUB: tl.constexpr = 128 // BLOCK_N
        pid_b = tl.program_id(0)  # block of BLOCK_N channels
        pid_s = tl.program_id(1)  # K split
        pn = pid_b // SUB  # record row
        offs = tl.arange(0, BLOCK_N)
        chan = (pid_b % SUB) * BLOCK_N + offs  # [BN] channels within the record row
        j = tl.arange(0, 8)
        view_w = chan[:, None] * 16 + j[None, :]  # [BN, 8] word offsets in a record: view bytes of columns 4j..4j+3
        low_w = 2048 + chan[:, None] * 8 + j[None, :]  # their low bytes
        base7 = tl.load(base7_ptr + pn * 128 + chan).to(tl.uint32)
        b2 = (base7 | (base7 << 16))[:, None]  # [BN, 1]: B_n << 7 in both lanes
        rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
        rows_c = tl.minimum(rows, M - 1)  # rows past M recompute row M - 1 (never stored): no masks
        x16 = x_ptr.to(tl.pointer_type(tl.uint16))  # x as bf16 bits: upcasts by shifting
        x16_row = x16 + rows_c.to(tl.int64) * stride_xm  # [R]
        x_w = x16_row.to(tl.pointer_type(tl.uint32))[:, None]  # [R, 1]: x as bf16 pairs (K, stride even)
        prog = pid_b * n_splits + pid_s
        e_lo = tl.load(fix_off_ptr + prog)
        e_hi = tl.load(fix_off_ptr + prog + 1)
        if ASM:  # the first 64 sparse corrections into L2 now: read after the record walk, they are then L2 hits
            pe = tl.minimum(e_lo + tl.arange(0, 64), e_hi + 15)  # (the lists have 16 padding entries at the end)
            _prefetch_l2(fix_ch_ptr + pe)
            _prefetch_l2(fix_col_ptr + pe)
            _prefetch_l2(fix_val_ptr + pe)
            _prefetch_l2(fix_negz_ptr + pe)
        acc = tl.zeros((ROWS, BLOCK_N, 8), dtype=tl.float32)
        kt_lo = pid_s * per_split
        kt_hi = tl.minimum(kt_lo + per_split, n_ktiles)
        rec = rec_ptr.to(tl.pointer_type(tl.uint32)) + pn.to(tl.int64) * n_ktiles * 3072  # 3072 words a record
        r = rec + kt_lo * 3072
        va, vb, lw = tl.load(r + view_w), tl.load(r + view_w + 8), tl.load(r + low_w)
        for kt in range(kt_lo, kt_hi):  # fixed order: the split's tiles, left to right
            r = rec + tl.minimum(kt + 1, kt_hi - 1) * 3072  # the next tile's words, while this one is decoded
            va_n, vb_n, lw_n = tl.load(r + view_w), tl.load(r + view_w + 8), tl.load(r + low_w)
            cw = (kt * 64 + 4 * j)[None, :] // 2  # [1, 8] word of x holding columns 4j, 4j + 1
            if EVEN_K:
                xa0, xa1 = tl.load(x_w + cw), tl.load(x_w + cw + 1)
                xb0, xb1 = tl.load(x_w + cw + 16), tl.load(x_w + cw + 17)
            else:  # the last tile reaches past K: x is 0 there (the padded weights read z_n)
                xa0 = tl.load(x_w + cw, mask=cw * 2 < K, other=0)
                xa1 = tl.load(x_w + cw + 1, mask=cw * 2 + 2 < K, other=0)
                xb0 = tl.load(x_w + cw + 16, mask=cw * 2 + 32 < K, other=0)
                xb1 = tl.load(x_w + cw + 17, mask=cw * 2 + 34 < K, other=0)
            acc = _gemv_half(acc, va, lw << 4, b2, xa0, xa1, ASM)  # columns 0..31: low nibbles
            acc = _gemv_half(acc, vb, lw, b2, xb0, xb1, ASM)  # columns 32..63: high nibbles
            va, vb, lw = va_n, vb_n, lw_n
        a, b = tl.split(tl.reshape(acc, (ROWS, BLOCK_N, 4, 2)))  # sum over j by adjacent pairs
        acc = a + b
        a, b = tl.split(tl.reshape(acc, (ROWS, BLOCK_N, 2, 2)))
        acc = a + b
        a, b = tl.split(acc)
        y = a + b  # [R, BN]
        # sparse corrections, entry by entry: y[:, ch] += value * x[:, col] + (-z_n) * x[:, col]
        for e in range(e_lo, e_hi, 16):
            for i in tl.static_range(16):
                ch = tl.load(fix_ch_ptr + e + i)
                col = tl.load(fix_col_ptr + e + i)
                val = tl.load(fix_val_ptr + e + i)
                negz = tl.load(fix_negz_ptr + e + i)
                xv = (tl.load(x16_row + col).to(tl.uint32) << 16).to(tl.float32, bitcast=True)  # [R]
                ch = tl.where((val != 0) | (negz != 0), ch, -1)  # padding hits no channel
                y = tl.where((offs == ch)[None, :], y + (val * xv + negz * xv)[:, None], y)
        # dense cells (int64 indices: a cell is 2 * per * 64 values)
        for d in range(tl.load(dense_off_ptr + prog).to(tl.int64), tl.load(dense_off_ptr + prog + 1).to(tl.int64)):
            ch = tl.load(dense_ch_ptr + d)
            s = _dense_sum(x16, rows_c, stride_xm, K, dense_val_ptr + d * 2 * per_split * 64,
                           per_split * 64, kt_lo * 64, (kt_hi - kt_lo) * 64, ROWS, DCH)
            y = tl.where((offs == ch)[None, :], y + s[:, None], y)
        ok = (rows < M)[:, None]
        ch_out = (pn * 128 + chan)[None, :]
        if n_splits == 1:  # round and store here
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + ch_out, _round_bf16(y), mask=ok & (ch_out < N))
        else:  # a partial for the reduce kernel
            tl.store(part_ptr + (pid_s * M + rows[:, None]).to(tl.int64) * Np + ch_out, y, mask=ok)

    # ---- tensor-core kernel ---------------------------------------------------------------------------------

    @triton.jit
    def _decode_words(V, L, b2, ASM: tl.constexpr):
        # [128, 8] view words + low words (nibble in each byte's high half) -> [128, 32] bf16, column 4j + q from
        # byte q of word j: the GEMV kernel's lanes, repacked in column order
        we, wo = _lanes(V, L, ASM)
        te = _bf16_lanes(we, b2)  # bytes 0, 2
        to = _bf16_lanes(wo, b2)  # bytes 1, 3
        w = tl.join(tl.join(te.to(tl.uint16), (te >> 16).to(tl.uint16)),
                    tl.join(to.to(tl.uint16), (to >> 16).to(tl.uint16)))  # [128, 8, 2, 2]: (j, a, b) is byte 2a + b
        return tl.reshape(w, (128, 32)).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _x_t(x_ptr, rows_c, cols, K, stride_xm, EVEN_K: tl.constexpr):
        # x^T [len(cols), 16] bf16: the block's rows (clamped into [0, M)) as columns, zero at columns >= K
        ptrs = x_ptr + rows_c[None, :] * stride_xm + cols[:, None]
        if EVEN_K:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=(cols < K)[:, None], other=0.0)

    @triton.jit
    def _block_dots(acc, w_a, w_b, x_ptr, rows_c, col_a, K, stride_xm, EVEN_K: tl.constexpr, F32: tl.constexpr):
        # one 16-row block: acc += w_a @ x^T[columns 0..31] then w_b @ x^T[32..63]
        acc = _dot(w_a, _x_t(x_ptr, rows_c, col_a, K, stride_xm, EVEN_K), acc, F32)
        return _dot(w_b, _x_t(x_ptr, rows_c, col_a + 32, K, stride_xm, EVEN_K), acc, F32)

    @triton.jit
    def _add_dense(acc, x_ptr, rows_c, K, stride_xm, dv_ptr, per64, col0, span, ch, DCH: tl.constexpr):
        # acc [128, 16] (channels x rows): row `ch` += the dense cell's sums for these 16 rows
        s = _dense_sum(x_ptr.to(tl.pointer_type(tl.uint16)), rows_c, stride_xm, K, dv_ptr, per64, col0, span, 16, DCH)
        return tl.where((tl.arange(0, 128) == ch)[:, None], acc + s[None, :], acc)

    @triton.jit
    def _store_rows(y_ptr, part_ptr, acc, rows, chan, pid_s, n_splits, M, N, Np, stride_ym):
        ok = rows[None, :] < M
        if n_splits == 1:  # round and store here
            tl.store(y_ptr + rows[None, :].to(tl.int64) * stride_ym + chan, _round_bf16(acc), mask=ok & (chan < N))
        else:  # a partial for the reduce kernel
            tl.store(part_ptr + (pid_s * M + rows[None, :]).to(tl.int64) * Np + chan, acc, mask=ok)

    @triton.jit(do_not_specialize=_RUNTIME_INTS)
    def _w12_splitk_kernel(x_ptr, rec_ptr, base7_ptr, fix_off_ptr, fix_ch_ptr, fix_col_ptr, fix_val_ptr,
                           dense_off_ptr, dense_ch_ptr, dense_val_ptr, y_ptr, part_ptr, M, N, K, n_ktiles, per_split,
                           n_splits, stride_xm, Np, stride_ym, ROW_BLOCKS: tl.constexpr, ASM: tl.constexpr,
                           EVEN_K: tl.constexpr, DCH: tl.constexpr, F32: tl.constexpr):
        pid_n = tl.program_id(0)  # block of 128 output channels
        pid_s = tl.program_id(1)  # K split
        pid_g = tl.program_id(2)  # group of ROW_BLOCKS * 16 rows
        offs_n = tl.arange(0, 128)
        j = tl.arange(0, 8)
        view_w = offs_n[:, None] * 16 + j[None, :]  # [128, 8] word offsets in a record: view bytes of columns 4j..4j+3
        low_w = 2048 + offs_n[:, None] * 8 + j[None, :]  # their low bytes
        base7 = tl.load(base7_ptr + pid_n * 128 + offs_n).to(tl.uint32)
        b2 = (base7 | (base7 << 16))[:, None]  # [128, 1]: B_n << 7 in both lanes
        r0 = pid_g * (ROW_BLOCKS * 16) + tl.arange(0, 16)  # rows of block 0; block i is r0 + 16 i
        # rows past M recompute row M - 1 (a dot's column depends on its own row of x only; never stored)
        rc0 = tl.minimum(r0, M - 1)
        rc1 = tl.minimum(r0 + 16, M - 1)
        rc2 = tl.minimum(r0 + 32, M - 1)
        rc3 = tl.minimum(r0 + 48, M - 1)
        prog = pid_n * n_splits + pid_s
        # the first 16 corrections, loaded now so that their latency hides behind the record walk (the lists
        # have 16 padding entries at the end, so this load is in bounds even for an empty list)
        offs_e = tl.arange(0, 16)
        e_lo = tl.load(fix_off_ptr + prog)
        e_hi = tl.load(fix_off_ptr + prog + 1)
        ch = tl.load(fix_ch_ptr + e_lo + offs_e)
        col = tl.load(fix_col_ptr + e_lo + offs_e)
        val = tl.load(fix_val_ptr + e_lo + offs_e)
        acc0 = tl.zeros((128, 16), dtype=tl.float32)  # [channels, rows], one per row block
        acc1 = tl.zeros((128, 16), dtype=tl.float32)
        acc2 = tl.zeros((128, 16), dtype=tl.float32)
        acc3 = tl.zeros((128, 16), dtype=tl.float32)
        kt_lo = pid_s * per_split
        kt_hi = tl.minimum(kt_lo + per_split, n_ktiles)
        rec = rec_ptr.to(tl.pointer_type(tl.uint32)) + pid_n.to(tl.int64) * n_ktiles * 3072
        for kt in range(kt_lo, kt_hi):  # fixed order: the split's tiles, left to right
            r = rec + kt * 3072
            lw = tl.load(r + low_w)
            w_a = _decode_words(tl.load(r + view_w), lw << 4, b2, ASM)  # [128, 32] columns 0..31: low nibbles
            w_b = _decode_words(tl.load(r + view_w + 8), lw, b2, ASM)  # columns 32..63: high nibbles
            col_a = kt * 64 + tl.arange(0, 32)
            acc0 = _block_dots(acc0, w_a, w_b, x_ptr, rc0, col_a, K, stride_xm, EVEN_K, F32)
            if ROW_BLOCKS > 1:
                acc1 = _block_dots(acc1, w_a, w_b, x_ptr, rc1, col_a, K, stride_xm, EVEN_K, F32)
            if ROW_BLOCKS > 2:
                acc2 = _block_dots(acc2, w_a, w_b, x_ptr, rc2, col_a, K, stride_xm, EVEN_K, F32)
            if ROW_BLOCKS > 3:
                acc3 = _block_dots(acc3, w_a, w_b, x_ptr, rc3, col_a, K, stride_xm, EVEN_K, F32)
        # sparse corrections: escape values and -z_n at escaped slots, 16 per dot, in list order
        for e in range(e_lo, e_hi, 16):
            ch_n = tl.load(fix_ch_ptr + e + 16 + offs_e)  # the next 16, while these are applied
            col_n = tl.load(fix_col_ptr + e + 16 + offs_e)
            val_n = tl.load(fix_val_ptr + e + 16 + offs_e)
            onehot = tl.where(offs_n[:, None] == ch[None, :], val[None, :], tl.zeros_like(val)[None, :])  # [128, 16]
            acc0 = _dot(onehot, _x_t(x_ptr, rc0, col, K, stride_xm, True), acc0, F32)
            if ROW_BLOCKS > 1:
                acc1 = _dot(onehot, _x_t(x_ptr, rc1, col, K, stride_xm, True), acc1, F32)
            if ROW_BLOCKS > 2:
                acc2 = _dot(onehot, _x_t(x_ptr, rc2, col, K, stride_xm, True), acc2, F32)
            if ROW_BLOCKS > 3:
                acc3 = _dot(onehot, _x_t(x_ptr, rc3, col, K, stride_xm, True), acc3, F32)
            ch, col, val = ch_n, col_n, val_n
        # dense cells, in order, per row block (int64 indices: a cell is 2 * per * 64 values)
        per64 = per_split * 64
        span = (kt_hi - kt_lo) * 64
        for d in range(tl.load(dense_off_ptr + prog).to(tl.int64), tl.load(dense_off_ptr + prog + 1).to(tl.int64)):
            dch = tl.load(dense_ch_ptr + d)
            dv = dense_val_ptr + d * 2 * per64
            acc0 = _add_dense(acc0, x_ptr, rc0, K, stride_xm, dv, per64, kt_lo * 64, span, dch, DCH)
            if ROW_BLOCKS > 1:
                acc1 = _add_dense(acc1, x_ptr, rc1, K, stride_xm, dv, per64, kt_lo * 64, span, dch, DCH)
            if ROW_BLOCKS > 2:
                acc2 = _add_dense(acc2, x_ptr, rc2, K, stride_xm, dv, per64, kt_lo * 64, span, dch, DCH)
            if ROW_BLOCKS > 3:
                acc3 = _add_dense(acc3, x_ptr, rc3, K, stride_xm, dv, per64, kt_lo * 64, span, dch, DCH)
        chan = (pid_n * 128 + offs_n)[:, None]  # [128, 1]
        _store_rows(y_ptr, part_ptr, acc0, r0, chan, pid_s, n_splits, M, N, Np, stride_ym)
        if ROW_BLOCKS > 1:
            _store_rows(y_ptr, part_ptr, acc1, r0 + 16, chan, pid_s, n_splits, M, N, Np, stride_ym)
        if ROW_BLOCKS > 2:
            _store_rows(y_ptr, part_ptr, acc2, r0 + 32, chan, pid_s, n_splits, M, N, Np, stride_ym)
        if ROW_BLOCKS > 3:
            _store_rows(y_ptr, part_ptr, acc3, r0 + 48, chan, pid_s, n_splits, M, N, Np, stride_ym)

    @triton.jit(do_not_specialize=["M", "N", "n_splits"])
    def _w12_reduce_kernel(part_ptr, y_ptr, M, N, Np, stride_ym, n_splits, BLOCK_N: tl.constexpr):
        pid_n = tl.program_id(0)
        m = tl.program_id(1)  # one row
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for s0 in range(0, n_splits, 16):  # partials in split order, 16 loads in flight at a time
            for i in tl.static_range(16):  # (past n_splits: + 0.0, which changes no sum that starts at +0.0)
                s = s0 + i
                acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * Np + offs, mask=ok & (s < n_splits), other=0.0)
        tl.store(y_ptr + m.to(tl.int64) * stride_ym + offs, _round_bf16(acc), mask=ok)


def _reduce(part: torch.Tensor, y: torch.Tensor) -> None:
    splits, m, np_ = part.shape
    block_n = 512
    _w12_reduce_kernel[(triton.cdiv(y.shape[1], block_n), m)](part, y, m, y.shape[1], np_, y.stride(0), splits,
                                                             BLOCK_N=block_n, num_warps=4)


def _partials(plan: W12Plan, packed: W12Packed, m: int, device) -> torch.Tensor:
    """[splits, M, Np] fp32 partials for the reduce kernel; with one split the kernel stores y itself."""
    if plan.splits == 1:
        return torch.empty(1, dtype=torch.float32, device=device)  # not written
    return torch.empty(plan.splits, m, packed.data.shape[0] * TILE_N, dtype=torch.float32, device=device)


def w12_gemv(x2: torch.Tensor, packed: W12Packed, y: torch.Tensor, num_warps: int = 4, num_stages: int = 1,
             asm: bool = False) -> None:
    """The GEMV kernel: y [M, N] bf16 = x2 [M, K] bf16 (an even row stride, 4-byte aligned rows) @ W^T."""
    plan, (n, k), (tn, tk, _) = packed.gemv, packed.shape, packed.data.shape
    m = x2.shape[0]
    rows = min(GEMV_ROWS, triton.next_power_of_2(m))
    part = _partials(plan, packed, m, x2.device)
    grid = (tn * (TILE_N // plan.block_n), plan.splits, triton.cdiv(m, rows))
    _w12_gemv_kernel[grid](x2, packed.data, packed.base7, plan.fix_off, plan.fix_ch, plan.fix_col, plan.fix_val,
                           plan.fix_negz, plan.dense_off, plan.dense_ch, plan.dense_val, y, part, m, n, k, tk, plan.per,
                           plan.splits, x2.stride(0), tn * TILE_N, y.stride(0), BLOCK_N=plan.block_n, ROWS=rows,
                           ASM=asm, EVEN_K=k % TILE_K == 0, DCH=DENSE_CHUNK, num_warps=num_warps, num_stages=num_stages)
    if plan.splits > 1:
        _reduce(part, y)


def w12_dot(x2: torch.Tensor, packed: W12Packed, y: torch.Tensor, num_warps: int = 4, num_stages: int = 3,
            asm: bool = False) -> None:
    """The tensor-core kernel: y [M, N] bf16 = x2 [M, K] bf16 @ W^T."""
    plan, (n, k), (tn, tk, _) = packed.dot, packed.shape, packed.data.shape
    m = x2.shape[0]
    row_blocks = min(MAX_ROW_BLOCKS, -(-m // ROW_BLOCK))
    part = _partials(plan, packed, m, x2.device)
    grid = (tn, plan.splits, -(-m // (ROW_BLOCK * row_blocks)))
    _w12_splitk_kernel[grid](x2, packed.data, packed.base7, plan.fix_off, plan.fix_ch, plan.fix_col, plan.fix_val,
                             plan.dense_off, plan.dense_ch, plan.dense_val, y, part, m, n, k, tk, plan.per, plan.splits,
                             x2.stride(0), tn * TILE_N, y.stride(0), ROW_BLOCKS=row_blocks, ASM=asm,
                             EVEN_K=k % TILE_K == 0, DCH=DENSE_CHUNK, F32=os.environ.get("TRITON_INTERPRET") == "1",
                             num_warps=num_warps, num_stages=num_stages)
    if plan.splits > 1:
        _reduce(part, y)


def w12_linear(x: torch.Tensor, packed: W12Packed, gemv_max_rows: int = GEMV_MAX_ROWS, gemv_warps: int = 4,
               gemv_stages: int = 1, gemv_asm: bool = False, dot_warps: int = 4, dot_stages: int = 3,
               dot_asm: bool = False) -> torch.Tensor:
    """x: [..., K] on CUDA -> [..., N] bf16 through the Triton kernels: the GEMV kernel for M <= gemv_max_rows
    rows, else the tensor-core kernel; the other arguments are their launch knobs (the partitions are the
    packing's). Deterministic, and a row's bits do not depend on the other rows or their number within one
    kernel (see the module docstring)."""
    n, k = packed.shape
    if triton is None or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):  # (the CPU tests interpret)
        raise RuntimeError("w12_linear needs Triton and a CUDA tensor; use w12_linear_ref or the emulations")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).to(torch.bfloat16).contiguous()  # [M, K]
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if m <= gemv_max_rows:
        if k % 2:  # the GEMV reads x as bf16 pairs: an even row stride (the extra column is 0) ...
            x2 = F.pad(x2, (0, 1))
        elif x2.data_ptr() % 4:  # ... and 4-byte aligned rows
            x2 = x2.clone()
        w12_gemv(x2, packed, y, num_warps=gemv_warps, num_stages=gemv_stages, asm=gemv_asm)
    else:
        w12_dot(x2, packed, y, num_warps=dot_warps, num_stages=dot_stages, asm=dot_asm)
    return y.reshape(*lead, n)
