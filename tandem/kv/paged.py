"""Paged KV pool: one model's K/V in fixed-size blocks shared by many requests.

Storage is one tensor [2 (K, V), layers, num_blocks, block_size, kv_heads, head_dim]; a
*slot* is a row of it, `block * block_size + offset`, so a layer's K (or V) is also a flat
[num_slots, kv_heads, head_dim] view that attention gathers from by slot index.

Per sequence the pool keeps a block table and the same two regions as the single-request
cache (tandem.kv.cache): `[committed rows | reserved rows]`. A step `reserve`s rows for what it
feeds (a prefill chunk, or a verify pass: root + draft tree); `commit(path)` moves the
accepted path's rows to the end of the committed rows by one gather inside the pool and frees
the blocks that only the rest used.

Prefix caching: a full committed block is keyed by the hash chain of its tokens (its own and
every earlier block's), so a later request with the same prefix maps those blocks into its
table instead of recomputing them. A block's refcount counts the tables that hold it; a
freed block that has a hash stays findable until the allocator reuses it (oldest first).
Only full blocks are shared, and nothing ever writes into a full committed block, so no
copy-on-write is needed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tandem.kernels.upload import upload


class PoolExhausted(RuntimeError):
    """Not enough free blocks for a reservation (the scheduler preempts and retries)."""


@dataclass
class SeqBlocks:
    """One sequence's block table and its rows."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # committed rows
    reserved: int = 0  # rows after them, written by the current step
    tokens: list[int] = field(default_factory=list)  # token of each committed row (for hashing)
    hashes: list[int] = field(default_factory=list)  # hash chain of the full committed blocks
    # changes whenever `blocks` does, unique within the pool: a packed pass's static buffer
    # rewrites only the block tables whose version it does not hold (BatchRows.pack)
    version: int = 0
    # rows past the committed ones that blocks of earlier reservations may still cover: a commit
    # keeps its reservation's blocks (the next step reserves about as many again), so a tree
    # step neither takes nor returns blocks nor changes its table; committed rows use the slack
    # up, and the pool takes it back when it runs short
    slack: int = 0


@dataclass
class PrefixStats:
    queries: int = 0  # full prompt blocks looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PagedKVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        # one block more than the tables can hold: the scratch block, where the padding rows of a
        # bucketed (CUDA graph) pass write their K/V; no table ever holds it
        self.kv = torch.zeros(2, num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype,
                              device=device)  # [2, layers, blocks + 1, block_size, kv_heads, D]
        self.scratch_slot = num_blocks * block_size
        self.prefix_caching = prefix_caching
        self.refcount = [0] * num_blocks
        # free blocks, oldest freed first (those with a hash stay findable until reused)
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block
        self.block_hash: dict[int, int] = {}  # block -> hash (for blocks in `cached`)
        self.seqs: dict[str, SeqBlocks] = {}
        self.stats = PrefixStats()
        self._version = 0  # the last SeqBlocks.version handed out

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, prefix_caching: bool = True) -> "PagedKVPool":
        c = model.config
        return cls(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_blocks, block_size, model.dtype,
                   model.device, prefix_caching)

    # ---- views for attention -----------------------------------------------------------
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V as [num_slots, kv_heads, D] views (slot = block * block_size + offset)."""
        k, v = self.kv[0, i], self.kv[1, i]
        return k.flatten(0, 1), v.flatten(0, 1)

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slots of the sequence's rows [start, end) (committed or reserved)."""
        return self._slots(self.seqs[seq_id], range(start, end))

    def _slots(self, s: SeqBlocks, rows) -> list[int]:
        """Slots of the sequence's rows `rows` (an iterable of row indices)."""
        bs = self.block_size
        return [s.blocks[r // bs] * bs + r % bs for r in rows]

    # ---- capacity ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_size)

    def extra_blocks(self, seq_id: str, rows: int) -> int:
        """Blocks a reservation of `rows` more rows would take from the free list."""
        s = self.seqs[seq_id]
        return max(0, self.blocks_for(s.length + s.reserved + rows) - len(s.blocks))

    # ---- lifecycle -----------------------------------------------------------------------
    def allocate(self, seq_id: str, tokens: list[int], max_cached: int) -> int:
        """Open a sequence; map the longest run of cached full blocks of `tokens` (at most
        `max_cached` rows) into its table. Returns the rows already computed (a multiple of the
        block size)."""
        assert seq_id not in self.seqs, f"sequence {seq_id} is open already"
        s = self.seqs[seq_id] = SeqBlocks(version=self._new_version())
        if not self.prefix_caching:
            return 0
        bs, h = self.block_size, None
        for i in range(max_cached // bs):
            block_tokens = tokens[i * bs:(i + 1) * bs]
            h = hash((h, tuple(block_tokens)))
            self.stats.queries += 1
            b = self.cached.get(h)
            if b is None:
                break
            self.stats.hits += 1
            if self.refcount[b] == 0:
                del self.free_blocks[b]
            self.refcount[b] += 1
            s.blocks.append(b)
            s.hashes.append(h)
            s.tokens += block_tokens
        s.length = len(s.tokens)
        s.version = self._new_version()  # (the cached blocks it maps)
        return s.length

    def can_reserve(self, seq_id: str, rows: int) -> bool:
        """Whether reserve() would succeed (other sequences' slack taken back if need be)."""
        need = self.extra_blocks(seq_id, rows)
        return need <= self.num_free or self._reclaim(need, self.seqs[seq_id])

    def try_reserve(self, seq_id: str, rows: int) -> bool:
        """reserve() when the blocks are there (True), else nothing (False): one capacity check."""
        s = self.seqs[seq_id]
        need = -(-(s.length + s.reserved + rows) // self.block_size) - len(s.blocks)  # (extra_blocks)
        if need > 0:
            if need > len(self.free_blocks) and not self._reclaim(need, s):
                return False
            for _ in range(need):
                s.blocks.append(self._take())
            s.version = self._new_version()
        s.reserved += rows
        return True

    def reserve(self, seq_id: str, rows: int) -> None:
        """Add `rows` reserved rows after the committed ones (raises PoolExhausted, changing nothing)."""
        if not self.try_reserve(seq_id, rows):
            raise PoolExhausted(f"{self.extra_blocks(seq_id, rows)} blocks needed, {self.num_free} free")

    def commit(self, seq_id: str, path: list[int], tokens: list[int]) -> None:
        """Keep reserved rows `path` (reserved-relative, in order) as the next committed rows,
        holding `tokens`; drop every other reserved row and free blocks no row uses any more."""
        self.commit_many([(seq_id, path, tokens)])

    def commit_many(self, commits: list[tuple[str, list[int], list[int]]], keep_later: bool = False) -> None:
        """commit() for several sequences (seq_id, path, tokens), their row moves as one gather
        and one scatter: a tree's accepted path is rarely in place, and a move per request costs
        two host-to-device copies and two kernels (at 32 requests, more than the verify pass).
        keep_later: each path is its reservation's first rows, in place (0, 1, .., n - 1), and
        the reserved rows after them stay reserved (the engine's async scheduling reserves the
        next step's rows before this step's are committed)."""
        src: list[int] = []  # slots the kept rows are in
        dst: list[int] = []  # slots they move to (the first len(path) reserved rows)
        seqs, bs = self.seqs, self.block_size
        for seq_id, path, tokens in commits:
            s = seqs[seq_id]
            n = len(path)
            # (a path is in tree order, parents first: ascending)
            assert n == len(tokens) and (not n or 0 <= path[0] and path[-1] < s.reserved), (path, s.reserved)
            if n and path[-1] != n - 1:  # rows already in place (0, 1, .., n - 1) need no copy
                assert not keep_later, f"{seq_id}: a path out of place would drop the later reserved rows"
                at = s.length  # (the slots of those rows alone, not of every reserved row)
                src += self._slots(s, [at + p for p in path])
                dst += self._slots(s, range(at, at + n))
            s.length += n
            # (its blocks stay: the next step reserves about as many; they cover at most
            # max(slack, reserved) rows past the old length, so that less n past the new one)
            s.slack, s.reserved = max(s.slack, s.reserved) - n, s.reserved - n if keep_later else 0
            s.tokens += tokens
            if len(s.hashes) < s.length // bs:  # (a block filled)
                self._register_full_blocks(s)
        if src:
            idx = upload(src + dst, self.kv.device)  # one host-to-device copy, not waiting for the device
            flat = self.kv.flatten(2, 3)  # [2, layers, slots, kv_heads, D]
            # NOTE: index_select copies first, then we write, so overlapping src/dst is safe
            flat[:, :, idx[len(src):]] = flat.index_select(2, idx[:len(src)])

    def free(self, seq_id: str) -> None:
        """Close a sequence (finished, aborted or preempted); its blocks return to the free list."""
        s = self.seqs.pop(seq_id, None)
        if s is None:
            return
        for b in reversed(s.blocks):  # the tail first: a prefix is the most likely to be hit again
            self._release(b)

    # ---- internals -----------------------------------------------------------------------
    def _take(self) -> int:
        b, _ = self.free_blocks.popitem(last=False)
        h = self.block_hash.pop(b, None)
        if h is not None:  # evicted from the prefix cache
            del self.cached[h]
        self.refcount[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.free_blocks[b] = None

    def _trim(self, s: SeqBlocks) -> int:
        """Release the sequence's blocks past its committed and reserved rows (its slack);
        returns how many."""
        keep = -(-(s.length + s.reserved) // self.block_size)
        s.slack = 0
        freed = len(s.blocks) - keep
        if freed > 0:
            while len(s.blocks) > keep:
                self._release(s.blocks.pop())
            s.version = self._new_version()
        return max(0, freed)

    def _reclaim(self, need: int, keep: SeqBlocks) -> bool:
        """Take other sequences' slack back until `need` more blocks are free (True), or all of
        it (False: the pool is short even so). (Blocks freed here may still be read by a copy
        queued on the stream; anything written to them comes later on the same stream.)"""
        for s in self.seqs.values():
            if s is not keep and s.slack and len(s.blocks) * self.block_size >= s.length + s.reserved + self.block_size:
                self._trim(s)
                if self.num_free >= need:
                    return True
        return self.num_free >= need

    def _new_version(self) -> int:
        self._version += 1
        return self._version

    def _register_full_blocks(self, s: SeqBlocks) -> None:
        bs = self.block_size
        while len(s.hashes) < s.length // bs:
            i = len(s.hashes)
            h = hash((s.hashes[-1] if s.hashes else None, tuple(s.tokens[i * bs:(i + 1) * bs])))
            s.hashes.append(h)
            b = s.blocks[i]
            # NOTE: a second copy of a cached block (computed before the first was registered)
            # stays private: one block per hash
            if self.prefix_caching and h not in self.cached and b not in self.block_hash:
                self.cached[h], self.block_hash[b] = b, h

    # ---- invariants ----------------------------------------------------------------------
    def check(self) -> list[str]:
        """Every inconsistency found (empty when the pool is sound): a leaked block (owned by no
        table and not free), a block both free and owned, a wrong refcount, a table that holds a
        block twice or too few blocks for its rows, a stale prefix-cache entry."""
        problems: list[str] = []
        owners = [0] * self.num_blocks
        for sid, s in self.seqs.items():
            if len(set(s.blocks)) != len(s.blocks):
                problems.append(f"{sid}: a block appears twice in its table")
            if not self.blocks_for(s.length + s.reserved) <= len(s.blocks) <= \
                    self.blocks_for(s.length + max(s.reserved, s.slack)):
                problems.append(f"{sid}: {len(s.blocks)} blocks for {s.length} + {s.reserved} rows "
                                f"(slack {s.slack})")
            if len(s.tokens) != s.length:
                problems.append(f"{sid}: {len(s.tokens)} tokens for {s.length} committed rows")
            for b in s.blocks:
                owners[b] += 1
        for b in range(self.num_blocks):
            free = b in self.free_blocks
            if owners[b] != self.refcount[b]:
                problems.append(f"block {b}: refcount {self.refcount[b]} but {owners[b]} owners")
            if free and owners[b]:
                problems.append(f"block {b}: free and owned (double-owned)")
            if not free and not owners[b]:
                problems.append(f"block {b}: leaked (neither free nor owned)")
        for h, b in self.cached.items():
            if self.block_hash.get(b) != h:
                problems.append(f"block {b}: prefix-cache entry out of date")
        return problems
