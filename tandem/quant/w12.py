"""W12: a lossless 12-bit format for bfloat16 weight matrices (SpecPilot s4.1).

A bf16 weight is sign (1 bit), exponent (8) and mantissa (7). Within one output channel (a row
of a [N out, K in] matrix) almost every weight lies in the 16 binades below the channel's largest
exponent E_n, so the exponent fits in a 4-bit offset from the window's bottom B_n = max(E_n - 15, 0):

    code (12 bits) = sign | exponent offset (4) | mantissa (7)
    value          = (-1)^sign * 2^(B_n + offset - 127) * (1 + mantissa / 128)

Everything else goes to the channel's escape list as (column, raw bf16 bits) and is restored
exactly: weights below the window, zeros, denormals, infinities and NaNs (E_n is the largest
exponent of the channel's finite normal weights, so a non-finite weight never widens the window).

NOTE: the codes with offset 0 and mantissa 0 (either sign) are reserved: they decode to +-0 and
mark an escaped (or padded) slot, so a GEMM that decodes records in registers reads exactly 0
there and adds the escapes back in its epilogue. The one window value they would have named,
+-2^(B_n - 127), is escaped instead (1/128 of the window's bottom binade, which is itself rare).

Storage: 128 x 64 weight tiles (128 output channels x 64 input columns), one 12 KB record each,
records ordered [row tile, column tile] so a kernel walking K for a block of channels reads
contiguous memory:

    bytes [0, 8192)      the 8-bit view, [128, 64] row-major: sign << 7 | offset << 3 | mantissa >> 4
    bytes [8192, 12288)  the 4 low mantissa bits, [128, 32]: byte (n, j) holds column j in its low
                         nibble and column j + 32 in its high nibble

The 8-bit view alone is a coarse copy of the weights (the low bits set to their midpoint), which
is what a Q pass of two-level verification would read. Shapes not divisible by the tile are
zero-padded (padded slots hold the reserved zero code and are never escapes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.config import ConfigError

TILE_N, TILE_K = 128, 64  # output channels x input columns per record
VIEW_BYTES = TILE_N * TILE_K  # 8192: the 8-bit view
LOW_BYTES = TILE_N * TILE_K // 2  # 4096: two 4-bit low mantissas per byte
RECORD_BYTES = VIEW_BYTES + LOW_BYTES  # 12288
WINDOW = 16  # binades per channel
ESCAPE_BYTES = 6  # int32 column + int16 raw bits


@dataclass(frozen=True)
class W12Records:
    """The dense part of a W12 matrix."""

    data: torch.Tensor  # [ceil(N / 128), ceil(K / 64), 12288] uint8: one record per tile
    base: torch.Tensor  # [N] int16: biased bf16 exponent of each channel's window bottom, B_n = E_n - 15
    shape: tuple[int, int]  # (N, K) of the original matrix


@dataclass(frozen=True)
class W12Escapes:
    """Per-channel escape lists, CSR style: channel n owns entries offsets[n]:offsets[n + 1]."""

    offsets: torch.Tensor  # [N + 1] int32, non-decreasing, offsets[0] = 0
    index: torch.Tensor  # [E] int32: column of each escaped weight, ascending within a channel
    bits: torch.Tensor  # [E] int16: its raw bf16 bits


@dataclass(frozen=True)
class W12Stats:
    weights: int
    escapes: int
    stored_bytes: int  # records + escapes + per-channel base and offsets

    @property
    def escape_rate(self) -> float:
        return self.escapes / max(self.weights, 1)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.stored_bytes / max(self.weights, 1)


def _bf16_bits(w: torch.Tensor) -> torch.Tensor:
    """Raw bf16 bits as non-negative int32 (0..65535)."""
    return w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 holding 0..65535 -> bf16 with exactly those bits."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


def encode_w12(w: torch.Tensor) -> tuple[W12Records, W12Escapes]:
    """Encode a 2-D bfloat16 matrix [N, K]. Exact: decode_w12 gives back the same bits."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ConfigError(f"W12 encodes 2-D bfloat16 matrices, got a {w.dim()}-D {w.dtype} tensor")
    n, k = w.shape
    w = w.contiguous()
    bits = _bf16_bits(w)  # [N, K]
    sign, exp, mant = bits >> 15, (bits >> 7) & 0xFF, bits & 0x7F
    normal = (exp >= 1) & (exp <= 254)  # finite, non-zero, not denormal
    top = torch.where(normal, exp, -1).amax(dim=1) if k else torch.full((n,), -1, dtype=torch.int32, device=w.device)  # [N]
    # NOTE: B_n >= 0 (a channel whose top exponent is below 15 gets the window [0, 15]; exponent 0 is never
    # inside, as denormals escape). A GEMM decoding without a select relies on it: a reserved slot then
    # decodes to 2^(B_n - 127) >= 0 (exactly 0 when B_n = 0), never to a negative or non-finite pattern.
    base = (top - (WINDOW - 1)).clamp_min(0)  # [N]; 0 for a channel of escapes
    off = exp - base[:, None]  # [N, K]
    inside = normal & (off >= 0) & (off <= WINDOW - 1) & ((off | mant) != 0)  # (0, 0) is the reserved code
    hi = torch.where(inside, (sign << 7) | (off << 3) | (mant >> 4), 0)  # [N, K]: the 8-bit view
    lo = torch.where(inside, mant & 0xF, 0)  # [N, K]

    tn, tk = -(-n // TILE_N), -(-k // TILE_K)
    pad = (0, tk * TILE_K - k, 0, tn * TILE_N - n)
    hi = torch.nn.functional.pad(hi, pad).to(torch.uint8)  # [tn*128, tk*64]
    lo = torch.nn.functional.pad(lo, pad).to(torch.uint8)
    hi = hi.view(tn, TILE_N, tk, TILE_K).permute(0, 2, 1, 3)  # [tn, tk, 128, 64]
    lo = lo.view(tn, TILE_N, tk, TILE_K).permute(0, 2, 1, 3)
    low = lo[..., : TILE_K // 2] | (lo[..., TILE_K // 2:] << 4)  # [tn, tk, 128, 32]: columns j and j + 32
    data = torch.cat((hi.reshape(tn, tk, VIEW_BYTES), low.reshape(tn, tk, LOW_BYTES)), dim=-1).contiguous()

    rows, cols = (~inside).nonzero(as_tuple=True)  # row-major: by channel, then column
    counts = torch.bincount(rows, minlength=n)  # [N]
    offsets = torch.zeros(n + 1, dtype=torch.int32, device=w.device)
    offsets[1:] = counts.cumsum(0)
    esc = W12Escapes(offsets, cols.to(torch.int32), w.view(torch.int16)[rows, cols].contiguous())
    return W12Records(data, base.to(torch.int16), (n, k)), esc


def check_w12(records: W12Records, escapes: W12Escapes) -> None:
    """Refuse (ConfigError) a W12 matrix whose parts do not fit together, before decoding it."""
    n, k = records.shape
    tn, tk = -(-n // TILE_N), -(-k // TILE_K)
    if records.data.dtype != torch.uint8 or tuple(records.data.shape) != (tn, tk, RECORD_BYTES):
        raise ConfigError(f"W12 records have shape {tuple(records.data.shape)} ({records.data.dtype}), "
                          f"a [{n}, {k}] matrix needs ({tn}, {tk}, {RECORD_BYTES}) uint8")
    if records.base.dtype != torch.int16 or tuple(records.base.shape) != (n,):
        raise ConfigError(f"W12 window bases have shape {tuple(records.base.shape)}, expected ({n},) int16")
    if n and (int(records.base.min()) < 1 - WINDOW or int(records.base.max()) > 255 - WINDOW):
        raise ConfigError("W12 window bases are out of the bf16 exponent range")
    off, idx, bits = escapes.offsets, escapes.index, escapes.bits
    if off.dtype != torch.int32 or idx.dtype != torch.int32 or bits.dtype != torch.int16:
        raise ConfigError("W12 escape lists must be int32 offsets, int32 columns and int16 bits")
    if tuple(off.shape) != (n + 1,) or idx.dim() != 1 or idx.shape != bits.shape:
        raise ConfigError(f"W12 escape lists have inconsistent shapes for a [{n}, {k}] matrix")
    if int(off[0]) != 0 or int(off[-1]) != idx.numel() or bool((off[1:] < off[:-1]).any()):
        raise ConfigError("W12 escape offsets are not a valid per-channel partition of the escape list")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= k):
        raise ConfigError(f"a W12 escape column is outside [0, {k})")
    if idx.numel() > 1:
        rows = _escape_rows(escapes)
        if bool(((rows[1:] == rows[:-1]) & (idx[1:] <= idx[:-1])).any()):
            raise ConfigError("W12 escape columns are not strictly ascending within a channel")


def _escape_rows(escapes: W12Escapes) -> torch.Tensor:
    n = escapes.offsets.numel() - 1
    counts = (escapes.offsets[1:] - escapes.offsets[:-1]).long()  # [N]
    return torch.repeat_interleave(torch.arange(n, device=counts.device), counts)  # [E]


def _codes(records: W12Records) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit view, low nibble), each [N, K] int32, out of the tiles."""
    n, k = records.shape
    tn, tk, _ = records.data.shape
    d = records.data
    hi = d[..., :VIEW_BYTES].reshape(tn, tk, TILE_N, TILE_K)
    low = d[..., VIEW_BYTES:].reshape(tn, tk, TILE_N, TILE_K // 2)
    lo = torch.cat((low & 0xF, low >> 4), dim=-1)  # [tn, tk, 128, 64]
    hi = hi.permute(0, 2, 1, 3).reshape(tn * TILE_N, tk * TILE_K)[:n, :k]
    lo = lo.permute(0, 2, 1, 3).reshape(tn * TILE_N, tk * TILE_K)[:n, :k]
    return hi.to(torch.int32), lo.to(torch.int32)


def decode_w12(records: W12Records, escapes: W12Escapes) -> torch.Tensor:
    """The bfloat16 matrix [N, K] on the records' device, escapes restored bit for bit."""
    check_w12(records, escapes)
    n, k = records.shape
    hi, lo = _codes(records)  # [N, K] each
    sign, off, mant = hi >> 7, (hi >> 3) & 0xF, ((hi & 0x7) << 4) | lo
    bits = (sign << 15) | ((records.base.to(torch.int32)[:, None] + off) << 7) | mant
    bits = torch.where((off | mant) == 0, sign << 15, bits)  # the reserved code: +-0
    if escapes.index.numel():
        flat = _escape_rows(escapes) * k + escapes.index.long()  # [E]
        # NOTE: a kernel adds escapes to what the slot decodes to, so the slot must read exactly 0.
        if bool(((hi.reshape(-1)[flat] | lo.reshape(-1)[flat]) != 0).any()):
            raise ConfigError("a W12 escaped weight's record slot is not the reserved zero code")
        bits.view(-1)[flat] = escapes.bits.to(torch.int32) & 0xFFFF
    return _from_bits(bits)


def decode_w12_view8(records: W12Records, escapes: W12Escapes) -> torch.Tensor:
    """The coarse matrix the 8-bit view alone gives (low mantissa bits at their midpoint, escapes
    exact): what a Q pass would multiply by. Not lossless; a reference for later TLV work."""
    check_w12(records, escapes)
    n, k = records.shape
    hi, _ = _codes(records)  # the low nibbles are not read
    sign, off, mant = hi >> 7, (hi >> 3) & 0xF, ((hi & 0x7) << 4) | 0x8
    # NOTE: reserved zero codes sit only at escapes (overwritten below) and padding (cropped).
    bits = (sign << 15) | ((records.base.to(torch.int32)[:, None] + off) << 7) | mant
    if escapes.index.numel():
        bits.view(-1)[_escape_rows(escapes) * k + escapes.index.long()] = escapes.bits.to(torch.int32) & 0xFFFF
    return _from_bits(bits)


def verify_w12(original: torch.Tensor, records: W12Records, escapes: W12Escapes, name: str = "tensor") -> None:
    """Refuse (ConfigError, one line) unless the W12 matrix restores `original` bit for bit."""
    restored = decode_w12(records, escapes)
    a, b = _bf16_bits(original.to(restored.device)), _bf16_bits(restored)
    if a.shape != b.shape:
        raise ConfigError(f"W12 {name}: restored shape {tuple(b.shape)} differs from the checkpoint's {tuple(a.shape)}")
    bad = (a != b).nonzero()
    if bad.numel():
        r, c = bad[0].tolist()
        raise ConfigError(f"W12 {name}: {bad.shape[0]} weight(s) differ from the checkpoint after restoring, "
                          f"first at [{r}, {c}] ({a[r, c]:#06x} != {b[r, c]:#06x}); refusing the conversion")


def w12_stats(records: W12Records, escapes: W12Escapes) -> W12Stats:
    n, k = records.shape
    stored = (records.data.numel() + records.base.numel() * 2 + escapes.offsets.numel() * 4
              + escapes.index.numel() * ESCAPE_BYTES)
    return W12Stats(weights=n * k, escapes=escapes.index.numel(), stored_bytes=stored)


def dense_escapes(escapes: W12Escapes, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Escapes as a padded [N, E_max] table (columns int32, values bf16; padding: column 0,
    value 0) for a kernel epilogue that adds x[:, column] * value per channel in a fixed order."""
    counts = (escapes.offsets[1:] - escapes.offsets[:-1]).long()  # [N]
    e_max = int(counts.max()) if n and escapes.index.numel() else 0
    dev = escapes.index.device
    cols = torch.zeros(n, e_max, dtype=torch.int32, device=dev)
    vals = torch.zeros(n, e_max, dtype=torch.bfloat16, device=dev)
    if e_max:
        rows = _escape_rows(escapes)  # [E]
        slot = torch.arange(rows.numel(), device=dev) - escapes.offsets[:-1].long()[rows]  # position within its channel
        cols[rows, slot] = escapes.index
        vals[rows, slot] = escapes.bits.view(torch.bfloat16)
    return cols, vals


def gemv_operand(records: W12Records, escapes: W12Escapes, device: torch.device | str | None = None):
    """The matrix as tandem.kernels.gemv's one-row kernels read it (they decode the records in registers)."""
    from tandem.kernels.gemv import W12Gemv

    check_w12(records, escapes)
    dev = records.data.device if device is None else torch.device(device)
    col, bits = escapes.index, escapes.bits
    if not col.numel():  # (one unread entry: a launch needs a pointer)
        col, bits = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int16)
    return W12Gemv(records.data.reshape(-1).to(dev), (records.base.to(torch.int32) << 7).to(dev),
                   escapes.offsets.to(dev), col.to(dev), bits.to(dev), records.shape)
