"""One target forward over many requests' rows, reading and writing a paged KV pool.

A pass holds M rows from R requests, packed one request after another (varlen). Request r
feeds T_r rows (a prefill chunk, or a verify pass: root + draft tree) as the last of its S_r
columns in the pool; its rows attend to its own columns under its own visibility (causal for a
chunk, the tree's ancestors for a tree), never to another request's: the attention mask over
the whole pass is block-diagonal over requests.

What a pass needs is kept compact, so a step's host work does not grow with the context: per
request its block table and column count, per row a prefix length and a bitmask (below), all
packed into one int64 buffer that crosses to the device in one copy. On CUDA the attention is
one Triton kernel (tandem.kernels.paged_attention) and the whole pass is a CUDA graph per row
bucket (padding rows write a scratch slot and are dropped); on the CPU, and for what the kernel
does not take, `paged_attention_ref` runs SDPA over a padded per-request view built on the
device from the same fields.

Deterministic mode (tandem.engine.invariant) swaps the pass's reductions for batch-invariant
ones: on CUDA the invariant GEMM (tandem.kernels.invariant_gemm) for every row-wise product and
the invariant attention (tandem.kernels.invariant_attention), captured in the same graphs; on
the CPU their torch references.

The layers are those of `tandem.models.transformer.Transformer` (embedding, norms,
projections, MLP, RoPE from tandem.kernels.fused), called here with a paged attention.
"""
from __future__ import annotations

import gc
import logging
import math
import os
from dataclasses import dataclass, field
from itertools import chain
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import invariant
from tandem.kernels import invariant_attention as ia
from tandem.kernels import invariant_gemm as ig
from tandem.kernels import fused_layer
from tandem.kernels import paged_attention as pk
from tandem.kernels.fused import add_rmsnorm, rope_, silu_mul
from tandem.kv.paged import PagedKVPool
from tandem.models.layers import MLP, fusable
from tandem.models.transformer import Transformer
from tandem.tree.draft_tree import node_masks
from tandem.kernels.upload import upload

log = logging.getLogger("tandem.engine")

WORD = 64  # columns per int64 word of a row's bitmask
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Segment:
    """One request's rows in a pass: the last T of its `context` columns.

    Visibility: with `prefix` None the rows are causal (row t sees every column up to its own,
    context - T + t); otherwise row t sees every column < `prefix` and column prefix + j for
    each bit j set in `bits[t]` (a tree: its ancestors and itself; python ints, any width)."""

    tokens: list[int]  # [T] fed tokens
    positions: list[int]  # [T]
    blocks: list[int]  # the sequence's block table (covers its `context` columns)
    context: int  # S: columns of the request in this pass, its new rows last
    logits: bool  # whether the pass returns logits for these rows (verify: yes, prefill: no)
    prefix: int | None = None
    bits: list[int] | None = None

    @staticmethod
    def chunk(tokens: list[int], start: int, blocks: list[int], logits: bool = False) -> "Segment":
        """Causal rows at positions start.. after `start` committed columns."""
        return Segment(tokens, list(range(start, start + len(tokens))), blocks, start + len(tokens), logits)

    @staticmethod
    def tree(tokens: list[int], parents: list[int], start: int, blocks: list[int], logits: bool = True) -> "Segment":
        """A tree (parents[i] < i, the root's -1) after `start` committed columns; node i sits at
        position start + depth(i) and sees the committed columns and its own ancestors."""
        bits, depth = node_masks(parents)
        return Segment(tokens, [start + d for d in depth], blocks, start + len(tokens), logits, start, bits)


@dataclass
class PackColumns:
    """A pass's segments as flat columns, what `BatchRows.pack` writes: R requests, M rows, in
    request order. The engine builds these directly (one loop over its requests, no Segment
    each); `of(segments)` flattens Segments into them."""

    tokens: list[int]  # [M]
    new_rows: list[int]  # [R] T_r
    contexts: list[int]  # [R] S_r
    prefix: list[int]  # [R] tree rows see columns < prefix plus their bits; -1: causal rows
    logits: list[bool]  # [R] whether the pass returns these rows' logits
    tables: list[list[int]]  # [R] block tables
    bits: "list[int] | np.ndarray"  # [tree rows] masks, in row order: python ints (any width) or uint64
    positions: "list[int] | None" = None  # [M]; None: a causal row's column, a tree row's prefix + depth
    depth: "np.ndarray | None" = None  # [tree rows] (with positions None)
    words: int = 1  # mask words a row needs
    # [R] the pool's block-table versions (SeqBlocks.version): a static buffer rewrites only the
    # tables that changed since its last pass; None: rewrite every table
    versions: "list[int] | None" = None
    # a hybrid target's pass (tandem.engine.hybrid_model): [R] each request's sequence id, and
    # [tree rows] every tree's tree-local parents in row order (its GDN layers walk them)
    seq_ids: "list[str] | None" = None
    parents: "list[int] | None" = None

    @staticmethod
    def of(segments: list[Segment]) -> "PackColumns":
        tokens: list[int] = []
        positions: list[int] = []
        bits: list[int] = []
        words = 1
        for s in segments:
            tokens += s.tokens
            positions += s.positions
            if s.prefix is not None:
                bits += s.bits
                words = max(words, -(-max(s.bits).bit_length() // WORD))  # (the largest has the highest bit)
        return PackColumns(tokens, [len(s.tokens) for s in segments], [s.context for s in segments],
                           [-1 if s.prefix is None else s.prefix for s in segments], [s.logits for s in segments],
                           [s.blocks for s in segments], bits, positions, words=words)

    def capacity(self, tile_rows: int) -> "Capacity":
        T = self.new_rows
        NT = len(T) if max(T, default=0) <= tile_rows else sum(-(-t // tile_rows) for t in T)
        B = max(map(len, self.tables), default=1) or 1
        return Capacity(len(self.tokens), len(T), max(NT, 1), B, self.words)


@dataclass(frozen=True)
class Capacity:
    """Sizes of a packed pass: rows, requests, attention tiles, block-table width, mask words."""

    M: int
    R: int
    NT: int
    B: int
    W: int

    @cached_property
    def layout(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """name -> (offset, shape) inside the packed int64 buffer; logit_rows last (up to M)."""
        shapes = {"tokens": (self.M,), "positions": (self.M,), "slots": (self.M,), "row_seq": (self.M,),
                  "row_prefix": (self.M,), "row_base": (self.M,), "row_bits": (self.M, self.W),
                  "seq_len": (self.R,), "block_tables": (self.R, self.B), "tiles": (self.NT, 3),
                  "logit_rows": (self.M,)}
        out, at = {}, 0
        for name, shape in shapes.items():
            out[name] = (at, shape)
            at += math.prod(shape)
        return out

    @property
    def size(self) -> int:
        at, shape = self.layout["logit_rows"]
        return at + shape[0]


class _PackedField:
    """A field of BatchRows: its view of the packed buffer, made once (kept in the instance)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, rows: "BatchRows | None", owner=None):
        if rows is None:  # looked up on the class
            return self
        view = rows._view(self.name)
        rows.__dict__[self.name] = view  # (a frozen dataclass: set past its __setattr__, as cached_property does)
        return view


@dataclass(frozen=True)
class BatchRows:
    """A pass's rows, packed (M rows of R requests), as views of one device int64 buffer.

    Per row: token, position, the slot its K/V is written to, its request (`row_seq`), `row_prefix` (columns
    it sees in full), `row_base` and `row_bits` (further columns base + j, bit j, in words of 64).
    Per request: `seq_len` (columns) and its block table. `tiles` [NT, 3]: (request, first row,
    rows) for the attention kernel, up to `tile_rows` rows each. Buffers may be padded beyond
    `num_rows` rows and the R real requests (a CUDA graph's bucket): padding rows write `scratch`
    slots and belong to no tile."""

    packed: torch.Tensor  # the device buffer (a graph's static input when padded)
    cap: Capacity
    num_rows: int  # M (real rows)
    new_rows: list[int]  # [R] T_r
    contexts: list[int]  # [R] S_r
    offsets: list[int]  # [R + 1] request r's rows are M[offsets[r]:offsets[r + 1]]
    num_logits: int
    block_size: int
    tile_rows: int
    dtype: torch.dtype
    window: int | None = None
    graph: int | None = None  # the CUDA graph bucket these buffers belong to (None: an exact, eager pass)

    @property
    def words(self) -> int:
        """Mask words each row needs (the kernel takes 1)."""
        return self.cap.W

    # views of `packed` (Capacity.layout), made on first use
    tokens = _PackedField()  # [M]
    positions = _PackedField()  # [M]
    slots = _PackedField()  # [M]
    row_seq = _PackedField()  # [M] (padding rows: 0, seeing nothing)
    row_prefix = _PackedField()  # [M]
    row_base = _PackedField()  # [M]
    row_bits = _PackedField()  # [M, W]
    seq_len = _PackedField()  # [R]
    block_tables = _PackedField()  # [R, B]
    tiles = _PackedField()  # [NT, 3]

    def _view(self, name: str) -> torch.Tensor:
        at, shape = self.cap.layout[name]
        return self.packed[at:at + math.prod(shape)].view(shape)

    @cached_property
    def logit_rows(self) -> torch.Tensor:  # [n] rows of M whose logits the pass returns
        return self._view("logit_rows")[:self.num_logits]

    # ---- building ----------------------------------------------------------------------------
    @staticmethod
    def capacity(segments: "list[Segment] | PackColumns", tile_rows: int = 16) -> Capacity:
        cols = segments if isinstance(segments, PackColumns) else PackColumns.of(segments)
        return cols.capacity(tile_rows)

    @staticmethod
    def host_views(host: np.ndarray, cap: Capacity) -> dict[str, np.ndarray]:
        """name -> numpy view of `host` (a graph bucket keeps them: building them costs as much
        as filling them)."""
        return {name: host[at:at + math.prod(shape)].reshape(shape) for name, (at, shape) in cap.layout.items()}

    @staticmethod
    def pack(segments: "list[Segment] | PackColumns", host: np.ndarray, cap: Capacity, block_size: int,
             scratch: int, tile_rows: int, views: dict[str, np.ndarray] | None = None,
             tables: list | None = None) -> tuple[list[int], list[int], list[int], int]:
        """Write the segments into `host` (int64, cap.size) as `cap.layout` says (through `views`
        of it when given); padding rows write `scratch`. `tables`: the block-table version each
        row of `host`'s block tables holds (a static buffer's, kept between passes; updated here),
        so only tables that changed are rewritten. Returns T_r, S_r, the row offsets and the
        number of logit rows."""
        cols = segments if isinstance(segments, PackColumns) else PackColumns.of(segments)
        view = (views or BatchRows.host_views(host, cap)).__getitem__
        R, M = len(cols.new_rows), len(cols.tokens)
        bt_at, bt_shape = cap.layout["block_tables"]
        bt_end = bt_at + math.prod(bt_shape)
        bt = view("block_tables")
        # (vectorised: at 64 requests a python loop per row or per request costs more than the pass)
        if tables is not None and cols.versions is not None:  # rewrite only the tables that changed
            host[:bt_at] = 0
            host[bt_end:] = 0
            BatchRows._changed_tables(bt, cols.tables, cols.versions, tables)
        else:
            host[:] = 0
            if tables is not None:  # (unversioned tables: none of the rows is known any more)
                tables[:] = [None] * len(tables)
            nb = np.fromiter(map(len, cols.tables), dtype=np.int64, count=R)
            b_seq = np.repeat(np.arange(R), nb)
            bt[b_seq, np.arange(len(b_seq)) - np.repeat(np.cumsum(nb) - nb, nb)] = \
                list(chain.from_iterable(cols.tables))
        T, S = cols.new_rows, cols.contexts
        if M == R and R and min(cols.prefix) >= 0 and cols.positions is None and cols.words == 1:
            return BatchRows._pack_roots(cols, cap, view, block_size, scratch)
        Ta, Sa = np.asarray(T, dtype=np.int64), np.asarray(S, dtype=np.int64)
        offsets = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(Ta, out=offsets[1:])
        view("tokens")[:M] = cols.tokens
        view("seq_len")[:R] = Sa
        seq = np.repeat(np.arange(R), Ta)  # [M] request of each row
        view("row_seq")[:M] = seq
        col = (Sa - Ta - offsets[:-1])[seq] + np.arange(M)  # [M] the column each row's K/V lands at
        slots = view("slots")
        slots[:M] = bt[seq, col // block_size] * block_size + col % block_size
        slots[M:] = scratch
        prefix, base, bits = view("row_prefix"), view("row_base"), view("row_bits")
        # causal rows see up to their own column; tree rows every column < prefix plus their bits
        pre = np.asarray(cols.prefix, dtype=np.int64)[seq]  # [M]
        tree = pre >= 0
        prefix[:M] = np.where(tree, pre, col + 1)
        base[:M] = np.where(tree, pre, Sa[seq])
        tree_rows = np.flatnonzero(tree)
        if cols.positions is not None:
            view("positions")[:M] = cols.positions
        else:  # a causal row sits at its column, a tree node at prefix + its depth
            pos = view("positions")[:M]
            pos[:] = col
            pos[tree_rows] = pre[tree_rows] + cols.depth
        if cap.W == 1:  # every mask fits one word: two's complement int64 (bit 63 is the sign)
            bits[tree_rows, 0] = np.asarray(cols.bits, dtype=np.uint64).view(np.int64)
        else:
            for row, b in zip(tree_rows.tolist(), cols.bits):
                w = 0
                while b:
                    word = b & MASK64
                    bits[row, w] = word - (1 << 64) if word >> 63 else word
                    b >>= WORD
                    w += 1
        wants = np.asarray(cols.logits, dtype=bool)
        n_logits = M if wants.all() else None
        if n_logits is None:
            logit_rows = np.flatnonzero(wants[seq])
            n_logits = len(logit_rows)
            view("logit_rows")[:n_logits] = logit_rows
        else:
            view("logit_rows")[:M] = np.arange(M)
        # attention tiles: up to tile_rows rows of one request each
        tiles = view("tiles")
        if R and Ta.max() <= tile_rows:  # (every request one tile: a decode step's usual case)
            tiles[:R, 0] = np.arange(R)
            tiles[:R, 1] = offsets[:-1]
            tiles[:R, 2] = Ta
        else:
            nt = -(-Ta // tile_rows)
            t_seq = np.repeat(np.arange(R), nt)
            t0 = (np.arange(len(t_seq)) - np.repeat(np.cumsum(nt) - nt, nt)) * tile_rows
            tiles[:len(t_seq), 0] = t_seq
            tiles[:len(t_seq), 1] = offsets[:-1][t_seq] + t0
            tiles[:len(t_seq), 2] = np.minimum(tile_rows, Ta[t_seq] - t0)
        return list(T), list(S), offsets.tolist(), n_logits

    @staticmethod
    def _changed_tables(bt: np.ndarray, tables: list[list[int]], versions: list[int], held: list) -> None:
        """Rewrite row r of the block tables bt [R', B] only where its version `held[r]` (the
        buffer's, updated here) is not the request's `versions[r]`."""
        for r, (v, blocks) in enumerate(zip(versions, tables)):
            if held[r] != v:
                n = len(blocks)
                bt[r, :n] = blocks
                bt[r, n:] = 0
                held[r] = v

    @staticmethod
    def _pack_roots(cols: PackColumns, cap: Capacity, view, block_size: int,
                    scratch: int) -> tuple[list[int], list[int], list[int], int]:
        """pack() of a plain decode step: every request one tree row, its root, at column S - 1
        = prefix, seeing the columns before it and itself, its logits wanted. The general pack's
        fields in half its array ops (at one request the op count is the cost)."""
        R = len(cols.new_rows)
        rows = np.arange(R)
        pre = np.asarray(cols.prefix, dtype=np.int64)  # [R] = column = position of each root
        view("tokens")[:R] = cols.tokens
        view("positions")[:R] = pre
        view("seq_len")[:R] = pre + 1
        view("row_seq")[:R] = rows
        slots = view("slots")
        slots[:R] = view("block_tables")[rows, pre // block_size] * block_size + pre % block_size
        slots[R:] = scratch
        view("row_prefix")[:R] = pre
        view("row_base")[:R] = pre
        view("row_bits")[:R, 0] = 1
        view("logit_rows")[:R] = rows
        tiles = view("tiles")
        tiles[:R, 0] = rows
        tiles[:R, 1] = rows
        tiles[:R, 2] = 1
        return list(cols.new_rows), list(cols.contexts), list(range(R + 1)), R

    @staticmethod
    def pack_level(host: np.ndarray, cap: Capacity, views: dict[str, np.ndarray], lengths: list[int],
                   tables: list[list[int]], versions: list[int], held: list, w: int, block_size: int, scratch: int,
                   tile_rows: int, fixed: "_LevelPack | None") -> "_LevelPack":
        """pack() of a level tree's first level (BatchedTreeDrafter.propose): request r's w rows
        after its lengths[r] committed columns, each the root's child s (token 0: the captured tree
        writes it), at position lengths[r], seeing the committed columns and itself (bit s), its
        logits wanted; i.e. pack() of Segment([0] * w, [L] * w, blocks, L + w, True, L, [1 << s ..])
        per request with `versions` (writes exactly what that pack writes into the same buffer).
        What depends only on R and w (row requests, bits, tiles, logit rows, padding) is written
        when `fixed` (the buffer's last level pack, None: something else packed it since) was for
        another R or w; a step writes its columns: positions, prefixes, slots, column counts and
        the block tables whose version `held` (the buffer's, updated here) does not hold.
        Returns the buffer's level pack (pass it back next step)."""
        R = len(lengths)
        if fixed is None or fixed.key != (R, w):
            fixed = _LevelPack.write(host, cap, views, R, w, scratch, tile_rows)
        BatchRows._changed_tables(fixed.bt, tables, versions, held)
        L = np.array(lengths, dtype=np.int64)  # [R] committed columns = every row's prefix and position
        np.add(L, w, out=fixed.seq_len)
        Lc = L[:, None]  # [R, 1]
        fixed.positions[:] = Lc
        fixed.prefix_base[:] = Lc  # (row_prefix and row_base: adjacent fields, one write)
        blk, off = np.divmod(Lc + fixed.arange_w, block_size)  # [R, w] each row's column -> block, offset
        slots = fixed.slots
        np.multiply(fixed.bt[fixed.rows, blk], block_size, out=slots)
        slots += off
        return fixed

    @staticmethod
    def pack_chunks(host: np.ndarray, cap: Capacity, views: dict[str, np.ndarray], starts: list[int],
                    tables: list[list[int]], versions: list[int], held: list, K: int, block_size: int, scratch: int,
                    tile_rows: int, fixed: "_LevelPack | None") -> "_LevelPack":
        """pack() of R = len(starts) requests' K causal rows each, after starts[r] committed
        columns (Segment.chunk([0] * K, starts[r], blocks) each, tokens left 0: the device writes
        them), as pack_level does a level: what depends only on R and K once, the columns each
        step. Returns the buffer's pack (pass it back next step)."""
        R = len(starts)
        if fixed is None or fixed.key != ("chunk", R, K):
            fixed = _LevelPack.write_chunks(host, cap, views, R, K, scratch, tile_rows)
        BatchRows._changed_tables(fixed.bt, tables, versions, held)
        L = np.array(starts, dtype=np.int64)  # [R]
        np.add(L, K, out=fixed.seq_len)
        col = L[:, None] + fixed.arange_w  # [R, K] each row's column = its position
        fixed.positions[:] = col
        fixed.prefix_base[0] = col + 1  # (a causal row sees up to its own column)
        fixed.prefix_base[1] = (L + K)[:, None]
        blk, off = np.divmod(col, block_size)
        np.multiply(fixed.bt[fixed.rows, blk], block_size, out=fixed.slots)
        fixed.slots += off
        return fixed

    @staticmethod
    def build(segments: "list[Segment] | PackColumns", device: torch.device, dtype: torch.dtype, block_size: int,
              window: int | None = None, tile_rows: int = 16, scratch: int = 0,
              cap: Capacity | None = None) -> "BatchRows":
        """window: the target's sliding window, if some of its layers use one. scratch: the slot
        padding rows write (none here: this pass is not padded). cap: the segments' capacity, if
        the caller has it already."""
        cap = cap or BatchRows.capacity(segments, tile_rows)
        host = np.empty(cap.size, dtype=np.int64)
        T, S, offsets, n = BatchRows.pack(segments, host, cap, block_size, scratch, tile_rows)
        return BatchRows(upload(host, device), cap, offsets[-1], T, S, offsets, n, block_size,
                         tile_rows, dtype, window)

    # ---- the padded per-request view (the reference path) --------------------------------------
    @cached_property
    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q_index [R, Tmax] (row of M; padding 0), q_valid [R, Tmax], kv_slots [R, Smax] (slot of
        each column; padding 0), mask [R, 1, Tmax, Smax] additive (0 / -inf) and the same for
        sliding-window layers (None without a window). Padded rows see column 0 only."""
        dev = self.packed.device
        R = len(self.new_rows)
        tmax, smax = max(self.new_rows), max(self.contexts)
        Tt = torch.tensor(self.new_rows, device=dev)
        St = torch.tensor(self.contexts, device=dev)
        off = torch.tensor(self.offsets[:-1], device=dev)
        t = torch.arange(tmax, device=dev)
        s = torch.arange(smax, device=dev)
        q_valid = t[None] < Tt[:, None]  # [R, tmax]
        q_index = torch.where(q_valid, off[:, None] + t[None], 0)
        bt = self.block_tables[:R]
        blk = bt.gather(1, (s // self.block_size).clamp(max=bt.shape[1] - 1)[None].expand(R, -1))
        kv_slots = torch.where(s[None] < St[:, None], blk * self.block_size + s % self.block_size, 0)  # [R, smax]
        prefix = self.row_prefix[q_index]  # [R, tmax]
        base = self.row_base[q_index]
        words = self.row_bits[q_index]  # [R, tmax, W]
        j = s[None, None] - base[..., None]  # [R, tmax, smax]
        inside = (j >= 0) & (j < WORD * self.cap.W)
        jc = j.clamp(0, WORD * self.cap.W - 1)
        word = words.gather(2, jc // WORD)
        bit = ((word >> (jc % WORD)) & 1).bool() & inside
        allowed = ((s[None, None] < prefix[..., None]) | bit) & (s[None, None] < St[:, None, None]) & q_valid[..., None]
        allowed[:, :, 0] |= ~q_valid
        mask = torch.zeros(R, 1, tmax, smax, dtype=self.dtype, device=dev).masked_fill_(~allowed[:, None], float("-inf"))
        window_mask = None
        if self.window is not None:  # a row sees the keys at positions > its own - window
            q_pos = self.positions[q_index]  # [R, tmax]
            new = s[None] - (St - Tt)[:, None]  # [R, smax] index among the new rows (< 0: committed)
            is_new = (new >= 0) & (s[None] < St[:, None])
            k_pos = torch.where(is_new, self.positions[(off[:, None] + new).clamp(0, max(self.num_rows - 1, 0))],
                                s[None])
            seen = allowed & (k_pos[:, None, :] > q_pos[:, :, None] - self.window)
            seen[:, :, 0] |= ~seen.any(-1)  # (a row never sees nothing: padding rows keep column 0)
            window_mask = torch.zeros(R, 1, tmax, smax, dtype=self.dtype, device=dev).masked_fill_(~seen[:, None],
                                                                                                 float("-inf"))
        return q_index, q_valid, kv_slots, mask, window_mask

    @property
    def mask(self) -> torch.Tensor:  # [R, 1, Tmax, Smax] additive
        return self.dense[3]

    @property
    def window_mask(self) -> torch.Tensor | None:
        return self.dense[4]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: BatchRows,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: [M, H, D] (rotated; M may include padding rows); k_cache, v_cache: [num_slots, Hkv, D]
    (new rows already stored); mask: rows.mask (default) or rows.window_mask.

    Returns [M, H, D]: each row's attention over its own request's columns under its mask
    (padding rows: zeros)."""
    q_index, q_valid, kv_slots, dense_mask, _ = rows.dense
    mask = dense_mask if mask is None else mask
    H, Hkv = q.shape[1], k_cache.shape[1]
    qp = q[q_index].transpose(1, 2)  # [R, H, Tmax, D]
    kp = k_cache[kv_slots].transpose(1, 2)  # [R, Hkv, Smax, D]
    vp = v_cache[kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=Hkv != H)  # [R, H, Tmax, D]
    packed = torch.zeros_like(q)
    packed[q_index[q_valid]] = out.transpose(1, 2)[q_valid]  # [M, H, D]
    return packed


# Row buckets of the captured passes (a pass of M rows replays the smallest bucket >= M; a
# larger one runs eagerly). Past 2048: 64 requests' 33-row trees are 2,112 rows, and that pass
# run eagerly launched ~100 kernels from the host every step (H200, 2026-12-02); an engine
# captures only the buckets up to its max_num_batched_tokens.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 2560, 3072,
                 4096)


class _LevelPack:
    """A static buffer's level-1 rows of R requests, w each (BatchRows.pack_level): the fields
    that depend only on R and w, written once, and views of what a step writes."""

    @staticmethod
    def write(host: np.ndarray, cap: Capacity, views: dict[str, np.ndarray], R: int, w: int, scratch: int,
              tile_rows: int) -> "_LevelPack":
        assert w <= tile_rows and R <= cap.R and R * w <= cap.M and cap.W == 1, (R, w, cap)
        M = R * w
        bt_at, bt_shape = cap.layout["block_tables"]
        host[:bt_at] = 0  # (as pack() with versions: everything but the block tables)
        host[bt_at + math.prod(bt_shape):] = 0
        views["row_seq"][:M] = np.repeat(np.arange(R), w)
        views["row_bits"][:M, 0] = np.tile(np.left_shift(1, np.arange(w)), R)
        views["slots"][M:] = scratch
        views["logit_rows"][:M] = np.arange(M)
        tiles = views["tiles"]
        tiles[:R, 0] = np.arange(R)
        tiles[:R, 1] = np.arange(0, M, w)
        tiles[:R, 2] = w
        f = _LevelPack()
        f.key = (R, w)
        f.bt = views["block_tables"]
        f.seq_len = views["seq_len"][:R]
        f.positions = views["positions"][:M].reshape(R, w)
        pre_at = cap.layout["row_prefix"][0]
        assert cap.layout["row_base"][0] == pre_at + cap.M
        f.prefix_base = host[pre_at:pre_at + 2 * cap.M].reshape(2, cap.M)[:, :M].reshape(2, R, w)
        f.slots = views["slots"][:M].reshape(R, w)
        f.rows = np.arange(R)[:, None]  # [R, 1]
        f.arange_w = np.arange(w)
        for name in ("positions", "prefix_base", "slots"):  # (views of host, or the writes are lost)
            assert np.shares_memory(getattr(f, name), host), name
        return f

    @staticmethod
    def write_chunks(host: np.ndarray, cap: Capacity, views: dict[str, np.ndarray], R: int, K: int, scratch: int,
                     tile_rows: int) -> "_LevelPack":
        """write() for R requests of K causal rows each (BatchRows.pack_chunks): no mask bits."""
        assert K <= tile_rows and R <= cap.R and R * K <= cap.M and cap.W == 1, (R, K, cap)
        M = R * K
        bt_at, bt_shape = cap.layout["block_tables"]
        host[:bt_at] = 0
        host[bt_at + math.prod(bt_shape):] = 0
        views["row_seq"][:M] = np.repeat(np.arange(R), K)
        views["slots"][M:] = scratch
        views["logit_rows"][:M] = np.arange(M)
        tiles = views["tiles"]
        tiles[:R, 0] = np.arange(R)
        tiles[:R, 1] = np.arange(0, M, K)
        tiles[:R, 2] = K
        f = _LevelPack()
        f.key = ("chunk", R, K)
        f.bt = views["block_tables"]
        f.seq_len = views["seq_len"][:R]
        f.positions = views["positions"][:M].reshape(R, K)
        pre_at = cap.layout["row_prefix"][0]
        f.prefix_base = host[pre_at:pre_at + 2 * cap.M].reshape(2, cap.M)[:, :M].reshape(2, R, K)
        f.slots = views["slots"][:M].reshape(R, K)
        f.rows = np.arange(R)[:, None]
        f.arange_w = np.arange(K)
        for name in ("positions", "prefix_base", "slots"):
            assert np.shares_memory(getattr(f, name), host), name
        return f


@dataclass
class StaticRows:
    """The static input buffers of a captured pass (BatchedModel.static_rows)."""

    cap: Capacity
    host: torch.Tensor  # [cap.size] int64 (pinned on CUDA): segments are packed here
    packed: torch.Tensor  # [cap.size] int64 on the device: the captured ops read it
    rows: "BatchRows"  # views of `packed`, every row padding
    views: dict  # numpy views of `host`, one per packed field
    staged: object = None  # event after the last host-to-device copy (the host buffer is free after it)
    # [cap.R] the block-table version each row of the buffers' block tables holds (PackColumns.versions)
    tables: list = field(default_factory=list)
    # the packed fields' device views (BatchRows' _PackedField), made once: every pass over these
    # buffers shares them (making ten views a pass cost ~30 us of host time on the H200's CPU)
    device_views: dict = field(default_factory=dict)
    host_np: "np.ndarray | None" = None  # `host` as numpy (made once)
    level: "_LevelPack | None" = None  # the last BatchRows.pack_level into `host` (None: another pack since)


@dataclass
class _InputGraph:
    """A captured drafter pass whose rows read a float input each (BatchedModel.run_rows)."""

    st: StaticRows
    inputs: torch.Tensor  # [bucket, F] static input
    outputs: tuple | None = None  # per-row outputs [bucket, ...] of the capture
    graph: object = None  # torch.cuda.CUDAGraph (None: emulated)


@dataclass
class _Graph:
    """One captured pass of `st.cap.M` rows: its static buffers and outputs."""

    st: StaticRows
    graph: object = None  # torch.cuda.CUDAGraph (None: emulated on the CPU)
    logits: torch.Tensor | None = None  # [cap.M, vocab] every row's logits, written by a replay
    features: torch.Tensor | None = None  # [cap.M, F]


class BatchedModel:
    """`forward(rows) -> logits [len(rows.logit_rows), vocab]` of a Transformer over a PagedKVPool.

    `rows(segments)` packs a pass. With `max_seqs` and `max_seq_blocks` (a request's block-table
    width) known, a pass that fits a bucket is packed into that bucket's static buffers and
    replayed as a CUDA graph (`use_graphs`: None = on CUDA; "emulate" = the same padded buckets
    run eagerly, on any device, to test the bookkeeping)."""

    def __init__(self, model: Transformer, pool: PagedKVPool, deterministic: bool = False,
                 max_seqs: int | None = None, max_seq_blocks: int | None = None, use_graphs: bool | str | None = None,
                 features: bool = True, device_tokens: int = 0):
        # (a drafter's own module, e.g. an EAGLE-3 head, has no `model.layers`: never sharded)
        if any(layer.self_attn.tp_group is not None for layer in getattr(getattr(model, "model", None), "layers", ())):
            raise ValueError("the batched engine does not run a tensor-parallel shard yet")
        self.model, self.pool = model, pool
        # batch-invariant arithmetic (tandem.engine.invariant): a row's logits do not depend on
        # the other rows of the pass, nor on whether it is an AR step or a tree node
        self.deterministic = deterministic
        # [>= M, F] of the last pass (feature drafters): a graph's padded buffer or the pass's own;
        # `last_features` slices it on demand (a slice a pass cost the async plain step ~8 us)
        self.padded_features: torch.Tensor | None = None
        self._feature_rows: int | None = None
        # whether its passes keep the target's features (when enabled on the model): an engine
        # without a feature drafter says no, as the model is shared with engines that have one
        # (keeping them cost `ar` 0.55 -> 0.74 ms a step at one request on the H200)
        self.features = features
        c = model.config
        self.window = c.sliding_window if getattr(c, "sliding_layers", None) else None
        self.tile_rows = pk.tile_rows(c.num_attention_heads, c.num_key_value_heads)
        self.emulate = use_graphs == "emulate"
        if use_graphs is None:
            use_graphs = model.device.type == "cuda" and os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0"
        # graphs replay fixed kernels: not a sliding window (its mask view is built per pass), not
        # without the sizes to pad to. Deterministic mode is captured too on CUDA: its kernels
        # (invariant GEMM and attention) are as capturable as the fast ones
        self.use_graphs = (bool(use_graphs) and self.window is None
                           and max_seqs is not None and max_seq_blocks is not None)
        self.max_seqs, self.max_seq_blocks = max_seqs, max_seq_blocks
        self._graphs: dict[int, _Graph] = {}
        self._graph_pool = None
        # NOTE: one capture stream for all of this model's graphs, as ModelRunner does: cuBLAS
        # keys its workspace by (handle, stream) and a graph keeps its capture stream's
        self._capture_stream = None
        self._input_graphs: dict[int, _InputGraph] = {}  # run_rows' captures, by row bucket
        # Tokens that stay on the device between passes (the engine's async scheduling; 0: off).
        # Each pass writes the argmax of its logit rows into `next_tokens` (by logit row), and
        # reads a row's token from there where `feed_src` names a logit row of the pass before
        # (-1: the packed token). Both are static buffers, so the captured passes do it too.
        self.device_tokens = device_tokens > 0
        self.next_tokens: torch.Tensor | None = None  # [size] int64: the last pass's argmax per logit row
        self.feed_src: torch.Tensor | None = None  # [size] int64: per row, a logit row of the pass before, or -1
        self._feed_set = False  # feed_src holds a launch's sources (a pass without them resets it)
        if self.device_tokens:
            size = max(device_tokens, GRAPH_BUCKETS[-1])
            self.next_tokens = torch.zeros(size, dtype=torch.int64, device=model.device)
            self.feed_src = torch.full((size,), -1, dtype=torch.int64, device=model.device)

    # ---- packing -----------------------------------------------------------------------------
    def rows(self, segments: "list[Segment] | PackColumns") -> BatchRows:
        """The pass's rows: in a graph bucket's static buffers when one takes them, else exact."""
        cols = segments if isinstance(segments, PackColumns) else PackColumns.of(segments)
        cap = cols.capacity(self.tile_rows)
        g = None
        if self.use_graphs and cap.W == 1 and cap.R <= self.max_seqs and cap.B <= self.max_seq_blocks:
            bucket = next((b for b in GRAPH_BUCKETS if b >= cap.M), None)
            # (None from _graph: the kernel does not take this model, and graphs are off)
            g = self._graph(bucket) if bucket is not None else None
        if g is None:
            return BatchRows.build(cols, self.model.device, self.model.dtype, self.pool.block_size,
                                   self.window, self.tile_rows, self.pool.scratch_slot, cap)
        return self.load_rows(g.st, cols, graph=g.st.cap.M)

    def exact_rows(self, segments: list[Segment]) -> BatchRows:
        """The pass's rows as they are (no padding, no graph)."""
        return BatchRows.build(segments, self.model.device, self.model.dtype, self.pool.block_size, self.window,
                               self.tile_rows, self.pool.scratch_slot)

    def run_rows(self, segments: list[Segment], inputs: "torch.Tensor | list[torch.Tensor]", body,
                 picked: list[int] | None = None, tokens: torch.Tensor | None = None,
                 pick: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """A drafter's pass whose rows also read a float input each (an EAGLE-3 head's hidden
        state, a block drafter's target features): body(rows, inputs [M', F]) -> per-row outputs
        [M', ...] (every row). inputs: [M, F], or chunks of it in row order. Returns the outputs
        of rows `picked` ([len(picked), ...] each; default: the segments' M rows), or of rows
        `pick` (a device index: rows the host does not know yet). tokens: the rows' tokens [M]
        on the device, written over the segments' (placeholders then). With graphs, replayed
        from the row bucket's capture (inputs written into its static buffer); else one exact pass."""
        cap = BatchRows.capacity(segments, self.tile_rows)
        g = None
        if self.use_graphs and cap.W == 1 and cap.R <= self.max_seqs and cap.B <= self.max_seq_blocks:
            bucket = next((b for b in GRAPH_BUCKETS if b >= cap.M), None)
            g = self._input_graph(bucket, inputs[0] if isinstance(inputs, list) else inputs, body) \
                if bucket is not None else None
        if g is None:
            rows = self.exact_rows(segments)
            if tokens is not None:
                rows.tokens[:cap.M].copy_(tokens)
            out = body(rows, torch.cat(inputs) if isinstance(inputs, list) else inputs)
            if picked is None and pick is None:
                return out
            idx = pick if pick is not None else upload(picked, out[0].device)
            return tuple(o[idx] for o in out)
        # (the picked rows travel with the packed rows: no index tensor of their own to copy)
        rows = self.load_rows(g.st, segments, picked=picked)
        if tokens is not None:  # (after the packed rows' copy, on the same stream)
            rows.tokens[:cap.M].copy_(tokens)
        if isinstance(inputs, list) and inputs[0].dtype == g.inputs.dtype:  # (the chunks share a dtype)
            torch.cat(inputs, out=g.inputs[:cap.M])  # (straight into the static buffer: one kernel)
        else:
            g.inputs[:cap.M].copy_(torch.cat(inputs) if isinstance(inputs, list) else inputs)
        if g.graph is None:  # emulated: the same padded buffers, eagerly
            g.outputs = body(rows, g.inputs)
        else:
            g.graph.replay()
        if pick is not None:  # (gathers: copies already, as the next replay overwrites g.outputs)
            return tuple(o[pick] for o in g.outputs)
        if picked is not None:
            return tuple(o[rows.logit_rows] for o in g.outputs)
        return tuple(o[:cap.M].clone() for o in g.outputs)  # (copies: the next replay overwrites them)

    def warmup_inputs(self, max_rows: int, inputs: torch.Tensor, body) -> None:
        """run_rows' captures for every bucket up to `max_rows` rows, now (inputs: [1, F], its dtype)."""
        for b in GRAPH_BUCKETS:
            if not self.use_graphs:
                return
            self._input_graph(b, inputs, body)
            if b >= max_rows:
                return

    def _input_graph(self, bucket: int, like: torch.Tensor, body) -> "_InputGraph | None":
        g = self._input_graphs.get(bucket)
        if g is not None:
            return g
        if not self.emulate and not self.kernel_applies():
            self.use_graphs = False  # (the reference attention cannot be captured)
            return None
        cap = Capacity(bucket, min(bucket, self.max_seqs), bucket, self.max_seq_blocks, 1)
        g = _InputGraph(self.static_rows(cap), like.new_zeros(bucket, like.shape[1]))
        if not self.emulate:
            def fn():
                g.outputs = body(g.st.rows, g.inputs)
            g.graph = self.capture(fn)
            if g.graph is None:
                self.use_graphs = False
                return None
        self._input_graphs[bucket] = g
        return g

    def static_rows(self, cap: Capacity) -> "StaticRows":
        """Buffers for passes of capacity `cap` that a caller captures itself (a drafter's whole
        tree of level passes): every row padding, so a warm-up writes only the scratch slot."""
        pinned = self.model.device.type == "cuda" and not self.emulate
        host = torch.empty(cap.size, dtype=torch.int64, pin_memory=pinned)
        BatchRows.pack([], host.numpy(), cap, self.pool.block_size, self.pool.scratch_slot, self.tile_rows)
        packed = host.to(self.model.device)
        rows = BatchRows(packed, cap, cap.M, [], [], [0], cap.M, self.pool.block_size, self.tile_rows,
                         self.model.dtype)
        device_views = {name: getattr(rows, name) for name, f in vars(BatchRows).items() if isinstance(f, _PackedField)}
        device_views["logit_rows"] = rows._view("logit_rows")  # (every row of it: load_rows cuts it)
        return StaticRows(cap, host, packed, rows, BatchRows.host_views(host.numpy(), cap), tables=[None] * cap.R,
                          device_views=device_views, host_np=host.numpy())

    def load_rows(self, st: "StaticRows", segments: "list[Segment] | PackColumns",
                  graph: int | None = None, picked: list[int] | None = None) -> BatchRows:
        """Pack `segments` (at most st.cap) into st's buffers, once the previous pass's copy has
        left them -> rows over them with the segments' host figures (the reference path's view).
        `graph`: the bucket of this model's own graph (the rows are the segments' rows and logit
        rows); None: a caller's own capture, whose body reads every row (the rows keep st.cap.M
        rows and logit rows, whatever the segments hold; with `picked`, its logit rows are those
        rows instead: the rows whose outputs the caller gathers after the pass)."""
        if st.staged is not None:
            st.staged.synchronize()
        st.level = None  # (pack() rewrites what a level pack keeps)
        T, S, offsets, n = BatchRows.pack(segments, st.host_np, st.cap, self.pool.block_size,
                                          self.pool.scratch_slot, self.tile_rows, st.views, st.tables)
        if picked is not None and graph is None:  # (before the copy: they travel with the rows)
            st.views["logit_rows"][:len(picked)] = picked
        M, logits = (offsets[-1], n) if graph is not None else (st.cap.M, st.cap.M if picked is None else len(picked))
        return self._staged_rows(st, M, T, S, offsets, logits, graph)

    def load_level_rows(self, st: "StaticRows", lengths: list[int], tables: list[list[int]], versions: list[int],
                        w: int) -> BatchRows:
        """load_rows() of a level tree's first level (BatchRows.pack_level: R = len(lengths)
        requests, w rows each after lengths[r] committed columns; block tables and their versions),
        for a caller's own capture."""
        return self._load_fixed(st, BatchRows.pack_level, lengths, tables, versions, w)

    def load_chunk_rows(self, st: "StaticRows", starts: list[int], tables: list[list[int]], versions: list[int],
                        K: int) -> BatchRows:
        """load_rows() of R = len(starts) requests' K causal rows each (BatchRows.pack_chunks),
        for a caller's own capture."""
        return self._load_fixed(st, BatchRows.pack_chunks, starts, tables, versions, K)

    def _load_fixed(self, st: "StaticRows", pack, lengths: list[int], tables: list[list[int]], versions: list[int],
                    T: int) -> BatchRows:
        """A fixed-structure pack (T rows a request after lengths[r] committed columns) into st's
        buffers, once the previous pass's copy has left them."""
        if st.staged is not None:
            st.staged.synchronize()
        st.level = pack(st.host_np, st.cap, st.views, lengths, tables, versions, st.tables, T, self.pool.block_size,
                        self.pool.scratch_slot, self.tile_rows, st.level)
        R = len(lengths)
        return self._staged_rows(st, st.cap.M, [T] * R, [n + T for n in lengths], list(range(0, R * T + 1, T)),
                                 st.cap.M, None)

    def _staged_rows(self, st: "StaticRows", M: int, T: list[int], S: list[int], offsets: list[int], logits: int,
                     graph: int | None) -> BatchRows:
        """st's host buffer (packed) copied to the device -> rows over it with these host figures."""
        st.packed.copy_(st.host, non_blocking=True)  # (a capture or replay follows on this stream)
        if not self.emulate:
            if st.staged is None:  # (one event, recorded again each pass)
                st.staged = torch.cuda.Event()
            st.staged.record()
        rows = BatchRows(st.packed, st.cap, M, T, S, offsets, logits, self.pool.block_size, self.tile_rows,
                         self.model.dtype, graph=graph)
        views = st.device_views
        rows.__dict__.update(views)  # (as _PackedField would make them, made once)
        rows.__dict__["logit_rows"] = views["logit_rows"][:logits]  # (the cached_property's value)
        return rows

    @torch.no_grad()  # (as the passes run: the Triton kernels only take over without autograd)
    def capture(self, fn) -> object:
        """Run fn() twice on this model's capture stream (compiles, cuBLAS handles), then capture
        it as a CUDA graph sharing the model's memory pool -> the graph (None: the capture failed,
        with a warning; the caller runs fn eagerly). fn must only touch static buffers."""
        dev = self.model.device
        if self._capture_stream is None or os.environ.get("TANDEM_GRAPH_STREAM") == "bucket":
            self._capture_stream = torch.cuda.Stream(device=dev)
        s = self._capture_stream
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(dev).wait_stream(s)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # NOTE: no garbage collection inside the capture: collecting an earlier engine (engines
        # hold reference cycles) frees its pinned buffers, and the host allocator's event calls
        # then invalidate the capture (seen on the H200 when a benchmark built engine after
        # engine). Not gc.collect() first either: at 0.2 s a bucket it made start-up 10x slower.
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=s):
                fn()
        except RuntimeError as e:
            log.warning("CUDA graph capture failed (%s); running eagerly", e)
            torch.cuda.synchronize(dev)
            return None
        finally:
            gc.enable()
        return graph

    @torch.no_grad()  # (the passes run without autograd: ask as they will run, whoever builds the engine)
    def kernel_applies(self) -> bool:
        """Whether the Triton paged kernel (in deterministic mode the invariant one) takes this
        model's attention (what a capture needs: the reference path builds its view on the host
        per pass)."""
        m = self.model
        if hasattr(m, "model"):  # a Transformer
            attn = m.model.layers[0].self_attn
        else:  # an EAGLE-3 head, a block drafter
            attn = m.midlayer.self_attn if hasattr(m, "midlayer") else m.layers[0].self_attn
        k_cache = self.pool.layer(0)[0]
        probe = k_cache.new_empty(1, attn.n_heads, attn.head_dim)
        return ia.applies(probe, k_cache) if self.deterministic else pk.applies(probe, k_cache, 1)

    def warmup(self, max_rows: int) -> None:
        """Capture every bucket up to the one that holds `max_rows` rows now, as a server does at
        start-up, so no pass pays a capture later (no effect without graphs)."""
        if not self.use_graphs:
            return
        for b in GRAPH_BUCKETS:
            self._graph(b)
            if b >= max_rows:
                break

    def _graph(self, bucket: int) -> _Graph | None:
        g = self._graphs.get(bucket)
        if g is not None or not self.use_graphs:
            return g
        if not self.emulate and not self.kernel_applies():
            # the reference attention builds its view on the host per pass: it cannot be captured
            self.use_graphs = False
            return None
        g = _Graph(self.static_rows(Capacity(bucket, min(bucket, self.max_seqs), bucket, self.max_seq_blocks, 1)))
        if not self.emulate:
            def body():
                g.logits, g.features = self._body(g.st.rows, every_row=True)
            g.graph = self.capture(body)
            if g.graph is None:  # serve eagerly rather than not at all
                self.use_graphs = False
                return None
        self._graphs[bucket] = g
        return g

    # ---- the pass ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, rows: BatchRows, feed: tuple[list[int], list[int]] | None = None,
                logits: bool = True) -> torch.Tensor | None:
        """With the target's features on (Transformer.enable_features, for feature drafters) and
        `features`, `last_features` holds every row's [M, F] afterwards, as the single-request
        runner keeps them. With device tokens: `feed` = (rows, logit rows of the pass before):
        those rows take their tokens from the pass before's argmax (next_tokens) rather than the
        packed ones; `logits` False: none returned (the caller reads next_tokens only)."""
        if self.device_tokens:
            self._load_feed(rows.tokens.shape[0], feed)
        if rows.graph is None:
            out, self.padded_features = self._body(rows, every_row=False)
            self._feature_rows = None
            return out if logits else None
        g = self._graphs[rows.graph]
        if self.emulate:
            g.logits, g.features = self._body(rows, every_row=True)  # (its padded views, eagerly)
        else:
            g.graph.replay()
        # NOTE: a view of the graph's buffer, not a copy: its one reader (Engine._apply) copies the
        # rows it keeps (prefill chunks, accepted paths) before the target's next replay
        self.padded_features, self._feature_rows = g.features, rows.num_rows
        return g.logits[rows.logit_rows] if logits else None  # [n, vocab] (a copy: the next replay overwrites g.logits)

    @property
    def last_features(self) -> torch.Tensor | None:
        """[M, F]: every row's features of the last pass (None: not kept)."""
        f = self.padded_features
        return f if f is None or self._feature_rows is None else f[:self._feature_rows]

    def _load_feed(self, M: int, feed: tuple[list[int], list[int]] | None) -> None:
        """feed_src[:M] for the coming pass of M (packed or bucket) rows: -1 but at feed's rows."""
        if feed is None:
            if self._feed_set:  # (the last launch's sources must not feed this pass)
                self.feed_src.fill_(-1)
                self._feed_set = False
            return
        src = np.full(M, -1, dtype=np.int64)
        src[feed[0]] = feed[1]
        self.feed_src[:M].copy_(upload(src, self.feed_src.device))  # (queued: no wait for the device)
        self._feed_set = True

    def _body(self, rows: BatchRows, every_row: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over every packed row; logits of every row or of rows.logit_rows, features."""
        m = self.model
        tokens = rows.tokens  # [M]
        if self.device_tokens:  # rows fed from the pass before's argmax (feed_src; -1: packed)
            src = self.feed_src[:tokens.shape[0]]
            tokens = torch.where(src >= 0, self.next_tokens[src.clamp(min=0)], tokens)
        x, delta = m.model.embed_tokens(tokens)[None], None  # [1, M, hidden]
        want = (m.feature_layers or ()) if self.features else ()
        feats: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.model.layers):
            if self._fused(layer, x):  # five launches a layer (tandem.kernels.fused_layer)
                entering, x, delta = self._fused_layer(layer, i, x, delta, rows)
                if i in want:
                    feats[i] = entering
                continue
            if i in want:  # the residual stream entering layer i (the add is deferred)
                feats[i] = x if delta is None else x + delta
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            x, h = add_rmsnorm(x, delta, ln1.weight, ln1.eps)
            a = self._attention(layer.self_attn, i, h, rows)
            x, h = add_rmsnorm(x, a, ln2.weight, ln2.eps)
            delta = self._rowwise(layer.mlp, h)
        features = torch.cat([feats[i] for i in want], dim=-1)[0] if want else None  # [M, F]
        norm = m.model.norm
        h = add_rmsnorm(x, delta, norm.weight, norm.eps)[1][0]  # [M, hidden]
        logits = self._rowwise(m.lm_head, h if every_row else h[rows.logit_rows])  # [M or n, vocab]
        if self.device_tokens:  # every logit row's argmax, by logit row (what the next pass may feed)
            top = logits.argmax(-1)
            top = top[rows.logit_rows] if every_row else top  # [n] (a graph's: every row of its bucket)
            self.next_tokens[:top.shape[0]].copy_(top)
        return logits, features

    def _fused(self, layer, x: torch.Tensor) -> bool:
        """Whether a layer's pass over x [1, M, hidden] runs as the fused kernels: not in deterministic
        mode (its GEMMs are the batch-invariant ones), a small model, M <= fused_layer.MAX_M rows
        (a step of decodes and trees; prefill chunks keep cuBLAS), the paged attention kernel's case."""
        return not self.deterministic and fusable(layer.self_attn, layer.mlp, x[0])

    def _fused_layer(self, layer, layer_idx: int, x: torch.Tensor, delta: torch.Tensor | None,
                     rows: BatchRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer as fused kernels over the paged pool: (x + delta, norm, q/k/v, RoPE, K/V
        store at the rows' slots), the paged attention, o_proj, (add, norm, gate/up, SiLU * up), down.
        Returns (x + delta: the stream entering the layer, the residual after it [1, M, hidden], its
        MLP output)."""
        attn, mlp = layer.self_attn, layer.mlp
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        M = x.shape[1]
        H, D = attn.n_heads, attn.head_dim
        k_cache, v_cache = self.pool.layer(layer_idx)  # [num_slots, Hkv, D]
        d = None if delta is None else delta[0]
        entering, q = fused_layer.norm_qkv_rope_store(x[0], d, ln1.weight, ln1.eps, attn.qkv_weight, attn.qkv_bias,
                                                      rows.positions, self.model.inv_freq, H, attn.n_kv, k_cache,
                                                      v_cache, rows.slots)
        if pk.applies(q, k_cache, rows.words):
            out = pk.paged_attention(q, k_cache, v_cache, rows)  # [M, H, D]
        else:
            out = paged_attention_ref(q, k_cache, v_cache, rows, None)
        a = attn.o_proj(out.reshape(M, H * D))
        s, h = fused_layer.norm_gate_up_silu(entering, a, ln2.weight, ln2.eps, mlp.gate_up_weight)
        return entering[None], s[None], mlp.down_proj(h)[None]

    def _rowwise(self, fn, x: torch.Tensor) -> torch.Tensor:
        """fn (a row-wise layer) over the rows of x [..., M, h]. In deterministic mode batch-invariant:
        an nn.Linear or the MLP through the invariant GEMM where it applies (CUDA), anything else
        (the CPU, a quantized head) in fixed chunks of rows (tandem.engine.invariant)."""
        if not self.deterministic:
            return fn(x)
        if type(fn) is nn.Linear and ig.applies(x, fn.weight):
            return ig.linear(x, fn.weight, fn.bias)
        if type(fn) is MLP and fn.tp_group is None and ig.applies(x, fn.down_proj.weight) and all(
                type(p) is nn.Linear and p.bias is None for p in (fn.gate_proj, fn.up_proj, fn.down_proj)):
            if fn.gate_up_weight is not None:
                gate_up = ig.linear(x, fn.gate_up_weight)  # [..., M, 2 * inter]
                return ig.linear(silu_mul(gate_up), fn.down_proj.weight)
            gate, up = ig.linear(x, fn.gate_proj.weight), ig.linear(x, fn.up_proj.weight)
            return ig.linear(F.silu(gate) * up, fn.down_proj.weight)
        return invariant.rowwise(fn, x)

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, weight, bias) as a row-wise layer (_rowwise), for weights without a module."""
        if self.deterministic and ig.applies(x, weight):
            return ig.linear(x, weight, bias)
        return self._rowwise(lambda t: F.linear(t, weight, bias), x)

    def _attention(self, attn, layer_idx: int, x: torch.Tensor, rows: BatchRows) -> torch.Tensor:
        # x: [1, M, hidden]
        M = x.shape[1]
        H, Hkv, D = attn.n_heads, attn.n_kv, attn.head_dim
        if attn.qkv_weight is not None:
            qkv = self._project(x, attn.qkv_weight, attn.qkv_bias)
        else:
            qkv = torch.cat([self._rowwise(p, x) for p in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=-1)
        qkv = qkv.view(1, M, H + 2 * Hkv, D)
        if attn.q_norm is not None:
            qkv = torch.cat([attn.q_norm(qkv[:, :, :H]), attn.k_norm(qkv[:, :, H:H + Hkv]), qkv[:, :, H + Hkv:]], dim=2)
        rope_(qkv, rows.positions[None], self.model.inv_freq, H + Hkv)  # q and k heads, in place
        k_cache, v_cache = self.pool.layer(layer_idx)  # [num_slots, Hkv, D]
        k_cache.index_copy_(0, rows.slots, qkv[0, :, H:H + Hkv])  # (padding rows: the scratch slot)
        v_cache.index_copy_(0, rows.slots, qkv[0, :, H + Hkv:])
        q = qkv[0, :, :H]  # [M, H, D]
        if self.deterministic and attn.window is None and ia.applies(q, k_cache):
            out = ia.paged(q, k_cache, v_cache, rows)  # [M, H, D] each row over its visible sequence
        elif self.deterministic:
            q_index, q_valid, kv_slots, mask, window_mask = rows.dense
            mask = window_mask if attn.window is not None else mask  # [R, 1, Tmax, Smax]
            valid = q_index[q_valid]  # [M] the pass row of each (request, row) entry
            col_slots = kv_slots[:, None, :].expand_as(mask[:, 0])[q_valid]  # [M, Smax]
            visible = (mask[:, 0] == 0)[q_valid]  # [M, Smax]
            out = torch.empty(M, H, D, dtype=qkv.dtype, device=qkv.device)
            out[valid] = invariant.attention(q[valid], k_cache, v_cache, col_slots, visible)
        elif attn.window is None and pk.applies(q, k_cache, rows.words):
            out = pk.paged_attention(q, k_cache, v_cache, rows)  # [M, H, D]
        else:
            out = paged_attention_ref(q, k_cache, v_cache, rows, rows.window_mask if attn.window is not None else None)
        return self._rowwise(attn.o_proj, out.reshape(1, M, H * D))
