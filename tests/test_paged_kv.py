"""Paged KV pool (reserve / commit by gather / free / prefix caching / check) and paged tree
attention against dense attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models_for_tests import tiny_model
from tandem.engine.batched_model import BatchedModel, BatchRows, Segment, paged_attention_ref
from tandem.kv.paged import PagedKVPool, PoolExhausted
from tandem.tree.draft_tree import ancestor_mask


def pool(num_blocks=8, block_size=4, layers=2, heads=2, dim=3, prefix_caching=True) -> PagedKVPool:
    return PagedKVPool(layers, heads, dim, num_blocks, block_size, torch.float32, "cpu", prefix_caching)


def write_rows(p: PagedKVPool, sid: str, start: int, values: list[float]) -> None:
    """Write value v into every K and V element of row start + i (all layers)."""
    for i, v in enumerate(values):
        s = p.slots(sid, start + i, start + i + 1)[0]
        p.kv.flatten(2, 3)[:, :, s] = v


def row_values(p: PagedKVPool, sid: str, start: int, end: int) -> list[float]:
    slots = p.slots(sid, start, end)
    return [float(p.kv.flatten(2, 3)[0, 0, s, 0, 0]) for s in slots]


def test_commit_gathers_the_path_and_frees_the_rest():
    p = pool()
    assert p.allocate("a", [], max_cached=0) == 0
    p.reserve("a", 3)  # a prefill chunk
    write_rows(p, "a", 0, [10, 11, 12])
    p.commit("a", [0, 1, 2], [1, 2, 3])
    p.reserve("a", 9)  # a tree of 9 rows after 3 committed: blocks for 12 rows
    assert len(p.seqs["a"].blocks) == 3 and p.num_free == 5
    write_rows(p, "a", 3, [100 + i for i in range(9)])
    p.commit("a", [0, 2, 5], [7, 8, 9])  # root, then nodes 2 and 5
    assert row_values(p, "a", 0, 6) == [10, 11, 12, 100, 102, 105]
    assert p.seqs["a"].length == 6 and p.seqs["a"].tokens == [1, 2, 3, 7, 8, 9]
    # the third block held only dropped rows: it stays as slack (the next step reserves as many)
    assert len(p.seqs["a"].blocks) == 3 and p.num_free == 5 and p.seqs["a"].slack == 6  # (9 reserved, 3 kept)
    assert p.check() == []
    p.free("a")
    assert p.num_free == 8 and p.check() == []


def test_a_tree_steps_blocks_stay_for_the_next_step_and_go_when_another_sequence_is_short():
    """A commit keeps the blocks its reservation took (slack): the next step's reservation of
    about as many rows takes no block and leaves the table's version, so a packed pass does not
    rewrite it. A sequence short of free blocks takes other sequences' slack back first."""
    p = pool(num_blocks=8, block_size=4)  # 8 blocks of 4 rows
    p.allocate("a", [], 0)
    p.reserve("a", 9)
    p.commit("a", [0, 1], [1, 2])  # 2 rows kept, 3 blocks held
    version = p.seqs["a"].version
    assert p.try_reserve("a", 9) and len(p.seqs["a"].blocks) == 3 and p.seqs["a"].version == version
    p.commit("a", [0], [3])
    assert p.check() == [] and p.num_free == 5
    p.allocate("b", [], 0)
    assert p.can_reserve("b", 24) and p.try_reserve("b", 24)  # 6 blocks: a's two unused ones come back
    assert len(p.seqs["a"].blocks) == 1 and p.seqs["a"].slack == 0 and p.num_free == 1
    assert p.check() == []
    assert not p.try_reserve("b", 8)  # 2 more blocks: 1 free, and nobody has slack
    assert p.check() == []


def test_commit_many_moves_every_sequences_path_at_once():
    """Three sequences' trees committed in one call (one gather, one scatter): each keeps its
    own path's rows in order, as three commit() calls would, and the pool checks clean."""
    p = pool(num_blocks=16)
    paths = {"a": [0, 2, 5], "b": [0, 1, 2], "c": [0, 3]}  # "b" in place: no move
    for k, sid in enumerate(paths):
        p.allocate(sid, [], max_cached=0)
        p.reserve(sid, 2)
        write_rows(p, sid, 0, [k, k + 0.5])
        p.commit(sid, [0, 1], [1, 2])
        p.reserve(sid, 7)
        write_rows(p, sid, 2, [10 * (k + 1) + i for i in range(7)])
    p.commit_many([(sid, path, [5] * len(path)) for sid, path in paths.items()])
    for k, (sid, path) in enumerate(paths.items()):
        assert row_values(p, sid, 0, 2 + len(path)) == [k, k + 0.5] + [10 * (k + 1) + i for i in path]
        assert p.seqs[sid].length == 2 + len(path) and p.seqs[sid].reserved == 0
    assert p.check() == []


def test_reserve_beyond_the_pool_raises_and_changes_nothing():
    p = pool(num_blocks=2)
    p.allocate("a", [], 0)
    assert not p.can_reserve("a", 9)
    with pytest.raises(PoolExhausted, match="3 blocks needed, 2 free"):
        p.reserve("a", 9)
    assert p.num_free == 2 and p.seqs["a"].blocks == [] and p.check() == []


def test_prefix_cache_hits_full_blocks_and_counts_them():
    p = pool(num_blocks=8, block_size=4)
    tokens = list(range(10))
    p.allocate("a", tokens, max_cached=9)
    p.reserve("a", 9)
    write_rows(p, "a", 0, [float(t) for t in range(9)])
    p.commit("a", list(range(9)), tokens[:9])  # two full blocks get hashes
    # same first 8 tokens, then different ones: both full blocks hit, shared with "a"
    assert p.allocate("b", tokens[:8] + [50, 51, 52], max_cached=10) == 8
    assert p.seqs["b"].blocks == p.seqs["a"].blocks[:2]
    assert row_values(p, "b", 0, 8) == [float(t) for t in range(8)]
    assert (p.stats.queries, p.stats.hits) == (3, 2)  # "a" looked up one block (a miss stops the walk)
    # a different first block: no hit at all (hash chain), and max_cached caps the lookup
    assert p.allocate("c", [99] + tokens[1:], max_cached=9) == 0
    assert p.allocate("d", tokens, max_cached=7) == 4
    assert p.refcount[p.seqs["a"].blocks[0]] == 3
    assert p.check() == []
    for sid in "abcd":
        p.free(sid)
    assert p.num_free == 8 and p.check() == []
    # freed blocks stay findable until reused
    assert p.allocate("e", tokens, max_cached=9) == 8 and p.check() == []


def test_prefix_cache_entry_is_evicted_when_its_block_is_reused():
    p = pool(num_blocks=2, block_size=2)
    p.allocate("a", [1, 2], 0)
    p.reserve("a", 2)
    p.commit("a", [0, 1], [1, 2])
    p.free("a")
    p.allocate("b", [], 0)
    p.reserve("b", 4)  # takes both blocks, the cached one included
    assert p.cached == {} and p.check() == []
    p.free("b")
    assert p.allocate("c", [1, 2, 3], max_cached=2) == 0


def test_prefix_caching_off_never_hits():
    p = pool(prefix_caching=False)
    p.allocate("a", [1, 2, 3, 4], 0)
    p.reserve("a", 4)
    p.commit("a", [0, 1, 2, 3], [1, 2, 3, 4])
    assert p.allocate("b", [1, 2, 3, 4, 5], max_cached=4) == 0 and p.cached == {}


def test_check_finds_leaked_and_double_owned_blocks():
    p = pool(num_blocks=4)
    p.allocate("a", [], 0)
    p.reserve("a", 4)
    assert p.check() == []
    leaked = p.seqs["a"].blocks.pop()  # the table forgets a block it took
    p.seqs["a"].reserved = 0
    assert any(f"block {leaked}: leaked" in m for m in p.check())
    p.seqs["a"].blocks.append(leaked)
    p.seqs["a"].reserved = 4
    p.free_blocks[leaked] = None  # the block is handed out and free at once
    assert any("double-owned" in m for m in p.check())
    del p.free_blocks[leaked]
    p.seqs["a"].blocks.append(leaked)
    assert any("appears twice" in m for m in p.check())


# ---- paged tree attention ---------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 4, 2, 8), (5, 2, 2, 16), (3, 6, 2, 4)])
def test_paged_tree_attention_equals_dense(shape):
    """Requests with scattered blocks, a prefix and a random tree each: the packed varlen pass
    equals attention over each request's contiguous K/V with [prefix | ancestor] masks."""
    R, H, Hkv, D = shape
    g = torch.Generator().manual_seed(R * 100 + D)
    block, num_slots = 4, 512
    k_cache = torch.randn(num_slots, Hkv, D, generator=g)
    v_cache = torch.randn(num_slots, Hkv, D, generator=g)
    free = torch.randperm(num_slots // block, generator=g).tolist()  # blocks handed out in random order
    segments, dense = [], []
    for _ in range(R):
        L = int(torch.randint(0, 20, (), generator=g))
        T = int(torch.randint(1, 9, (), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, T)]
        blocks = [free.pop() for _ in range(-(-(L + T) // block))]
        slots = [blocks[i // block] * block + i % block for i in range(L + T)]
        mask = ancestor_mask(parents)
        segments.append(Segment.tree([0] * T, parents, L, blocks))
        dense.append((slots, L, T, mask))
    rows = BatchRows.build(segments, torch.device("cpu"), torch.float32, block)
    M = rows.offsets[-1]
    q = torch.randn(M, H, D, generator=g)
    out = paged_attention_ref(q, k_cache, v_cache, rows)  # [M, H, D]
    for r, (slots, L, T, mask) in enumerate(dense):
        qi = q[rows.offsets[r]:rows.offsets[r + 1]].transpose(0, 1)[None]  # [1, H, T, D]
        k = k_cache[slots].transpose(0, 1)[None]  # [1, Hkv, L + T, D]
        v = v_cache[slots].transpose(0, 1)[None]
        allowed = torch.cat([torch.ones(T, L, dtype=torch.bool), mask], dim=1)  # [T, L + T]
        ref = F.scaled_dot_product_attention(qi, k, v, attn_mask=allowed, enable_gqa=Hkv != H)[0].transpose(0, 1)
        torch.testing.assert_close(out[rows.offsets[r]:rows.offsets[r + 1]], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,graphs", [("llama", False), ("qwen2", False), ("qwen3", False),
                                           ("llama", "emulate"), ("qwen3", "emulate")])
def test_batched_model_equals_dense_forward(family, graphs):
    """Three requests, their prefixes fed in chunks mixed with other requests' trees, then one pass
    with all three trees: every tree row's logits equal a dense uncached forward under the same
    [causal prefix | ancestor] mask. With graphs emulated, every pass is padded to its bucket
    (padding rows write the scratch slot) exactly as a CUDA graph replays it."""
    model = tiny_model(seed=5, family=family)
    p = PagedKVPool.for_model(model, num_blocks=64, block_size=4)
    bm = BatchedModel(model, p, max_seqs=4, max_seq_blocks=8, use_graphs=graphs)
    g = torch.Generator().manual_seed(9)
    prefixes = [torch.randint(0, 95, (n,), generator=g).tolist() for n in (7, 1, 13)]
    trees = [[-1, 0, 0, 1, 2, 2], [-1], [-1, 0, 1, 2]]
    tree_tokens = [torch.randint(0, 95, (len(t),), generator=g).tolist() for t in trees]
    for i, pre in enumerate(prefixes):
        p.allocate(str(i), [], 0)
    for lo, hi in ((0, 5), (5, 13)):  # two chunked-prefill passes over every request
        segs, chunks = [], []
        for i, pre in enumerate(prefixes):
            chunk = pre[lo:hi]
            if not chunk:
                continue
            p.reserve(str(i), len(chunk))
            segs.append(Segment.chunk(chunk, lo, p.seqs[str(i)].blocks))
            chunks.append((str(i), chunk))
        assert bm.forward(bm.rows(segs)).shape[0] == 0
        for sid, chunk in chunks:
            p.commit(sid, list(range(len(chunk))), chunk)
    segs = []
    for i, (pre, parents, toks) in enumerate(zip(prefixes, trees, tree_tokens)):
        p.reserve(str(i), len(toks))
        segs.append(Segment.tree(toks, parents, len(pre), p.seqs[str(i)].blocks))
    logits = bm.forward(bm.rows(segs))  # [sum T, vocab]
    row = 0
    for pre, parents, toks, seg in zip(prefixes, trees, tree_tokens, segs):
        L, T = len(pre), len(toks)
        allowed = torch.zeros(L + T, L + T, dtype=torch.bool)
        allowed[:L, :L] = torch.ones(L, L, dtype=torch.bool).tril()
        allowed[L:, :L] = True
        allowed[L:, L:] = ancestor_mask(parents)
        pos = torch.tensor([list(range(L)) + seg.positions])
        ref = model(torch.tensor([pre + toks]), pos, mask=allowed[None, None])[0, L:]  # [T, vocab]
        torch.testing.assert_close(logits[row:row + T], ref, rtol=1e-4, atol=1e-4)
        row += T
    assert p.check() == []


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_padded_pass_writes_only_its_rows_and_the_scratch_slot(deterministic):
    """Emulated graph bucket: 3 real rows padded to 4; the pool changes in exactly the 3 rows'
    slots and the scratch slot, and the logits are those of the exact (unpadded) pass: bit for
    bit in deterministic mode (batch-invariant GEMMs), else up to fp32 rounding (a BLAS may
    block a 4-row GEMM differently from a 3-row one: MKL on an AVX2 CPU does)."""
    model = tiny_model(seed=2)
    p = PagedKVPool.for_model(model, num_blocks=8, block_size=4)
    exact = BatchedModel(model, p, deterministic=deterministic)
    padded = BatchedModel(model, p, max_seqs=4, max_seq_blocks=4, use_graphs="emulate", deterministic=deterministic)
    p.allocate("a", [], 0)
    p.reserve("a", 3)
    seg = [Segment.chunk([5, 6, 7], 0, p.seqs["a"].blocks, logits=True)]
    rows = padded.rows(seg)
    assert rows.graph == 4 and rows.tokens.shape[0] == 4 and rows.num_rows == 3
    before = p.kv.clone()
    out = padded.forward(rows)
    changed = (p.kv != before).flatten(2, 3).any(-1).any(-1).any(0).any(0)  # [slots]
    assert changed.nonzero().flatten().tolist() == p.slots("a", 0, 3) + [p.scratch_slot]
    tol = 0 if deterministic else 1e-5
    torch.testing.assert_close(out, exact.forward(exact.rows(seg)), rtol=tol, atol=tol)


def test_trees_wider_than_one_mask_word_equal_dense_forward():
    """A 70-node chain-shaped tree (bits beyond 64 columns: two mask words, the reference path)
    equals the dense forward."""
    model = tiny_model(seed=3)
    p = PagedKVPool.for_model(model, num_blocks=64, block_size=4)
    bm = BatchedModel(model, p)
    pre = list(range(1, 6))
    p.allocate("a", [], 0)
    p.reserve("a", len(pre))
    bm.forward(bm.rows([Segment.chunk(pre, 0, p.seqs["a"].blocks)]))
    p.commit("a", list(range(len(pre))), pre)
    parents = [-1] + [i - 1 for i in range(1, 40)] + [0] + [i - 1 for i in range(41, 70)]  # two branches
    toks = [(7 * i) % 90 + 1 for i in range(70)]
    p.reserve("a", 70)
    rows = bm.rows([Segment.tree(toks, parents, len(pre), p.seqs["a"].blocks)])
    assert rows.words == 2
    logits = bm.forward(rows)
    L, T = len(pre), len(toks)
    allowed = torch.zeros(L + T, L + T, dtype=torch.bool)
    allowed[:L, :L] = torch.ones(L, L, dtype=torch.bool).tril()
    allowed[L:, :L] = True
    allowed[L:, L:] = ancestor_mask(parents)
    depth = [0] * T
    for j in range(1, T):
        depth[j] = depth[parents[j]] + 1
    pos = torch.tensor([list(range(L)) + [L + d for d in depth]])
    ref = model(torch.tensor([pre + toks]), pos, mask=allowed[None, None])[0, L:]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_try_reserve_takes_the_blocks_or_changes_nothing():
    p = pool(num_blocks=3, block_size=4)
    p.allocate("a", [], 0)
    assert p.try_reserve("a", 6) and p.seqs["a"].reserved == 6 and len(p.seqs["a"].blocks) == 2
    before = (list(p.seqs["a"].blocks), p.num_free)
    assert not p.try_reserve("a", 7)  # 13 rows need 4 blocks; 3 exist
    assert (p.seqs["a"].blocks, p.num_free, p.seqs["a"].reserved) == (before[0], before[1], 6)
    assert p.try_reserve("a", 6) and p.num_free == 0 and p.check() == []


@pytest.mark.parametrize("kind", ["roots", "trees", "mixed", "wide"])
def test_columns_pack_the_same_pass_as_segments_and_a_reused_buffer_rewrites_changed_tables(kind):
    """The engine's columns (one loop, masks and depths from tree_masks, versioned block tables)
    pack the very buffer the Segment path packs: plain decode roots (pack's short path), trees,
    trees beside prefill chunks, trees wider than one mask word; over a bucket's buffer reused
    from a pass of other tables, rewriting only the tables whose version changed."""
    import numpy as np

    from tandem.engine.batched_model import Capacity, PackColumns
    from tandem.tree.draft_tree import tree_masks

    g = torch.Generator().manual_seed({"roots": 1, "trees": 2, "mixed": 3, "wide": 4}[kind])

    def rand(n: int) -> int:
        return int(torch.randint(0, n, (), generator=g))

    block, R = 4, 6
    cap = Capacity(512, R, 512, 40, 2)
    host = np.full(cap.size, 7, dtype=np.int64)  # (stale contents: the reused buffer's)
    views, tables = BatchRows.host_views(host, cap), [None] * R
    for step in range(4):
        segments, cols_in = [], []
        for r in range(R):
            L = 1 + rand(30)
            chunk = kind == "mixed" and r % 2 == 1
            T = 1 if kind == "roots" else rand(6) + 1 if chunk else {"wide": 70}.get(kind, 1 + rand(12))
            if r % 3 == 0:  # a new table, a new version, every pass
                blocks, version = [(r * 40 + step + i) % 300 for i in range(-(-(L + T) // block))], step
            else:  # the same table every pass (long enough for any of them)
                blocks, version = [r * 40 + i for i in range(25)], -r
            tokens = [rand(100) for _ in range(T)]
            if chunk:
                segments.append(Segment.chunk(tokens, L, blocks))
                parents = None
            else:
                parents = [-1] + [rand(i) for i in range(1, T)]
                segments.append(Segment.tree(tokens, parents, L, blocks))
            cols_in.append((tokens, parents, L, blocks, version))
        want = np.zeros(cap.size, dtype=np.int64)
        expected = BatchRows.pack(segments, want, cap, block, 999, 16)
        tokens, T, S, prefix, logits, tbl, versions, parents, sizes = [], [], [], [], [], [], [], [], []
        for toks, par, L, blocks, version in cols_in:  # (as Engine._rows builds them)
            tokens += toks
            T.append(len(toks))
            S.append(L + len(toks))
            prefix.append(-1 if par is None else L)
            logits.append(par is not None)
            tbl.append(blocks)
            versions.append(version)
            if par is not None:
                parents += par
                sizes.append(len(par))
        bits, depth, words = tree_masks(parents, sizes)
        cols = PackColumns(tokens, T, S, prefix, logits, tbl, bits, None, np.asarray(depth), words, versions)
        assert cols.capacity(16).W == BatchRows.capacity(segments).W
        got = BatchRows.pack(cols, host, cap, block, 999, 16, views, tables)
        assert got == expected
        assert np.array_equal(host, want), step
