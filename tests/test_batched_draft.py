"""The batched draft tree (engine.batched_draft.BatchedTreeDrafter), grown level by level on the
device, against the draft model's own uncached forward: every node is one of its parent's top-w
children, its log-prob is the cumulative log-softmax along its path, and the tree holds the N
best nodes, prefix-closed."""
from __future__ import annotations

import pytest
import torch

from models_for_tests import tiny_model, token_path
from tandem.engine.batched_draft import BatchedTreeDrafter


def _path(tree, i: int) -> list[int]:
    return token_path(tree.tokens, tree.parents, i)


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_level_tree_nodes_follow_the_drafts_own_distribution(graphs):
    # "emulate": every pass padded to a graph bucket and the whole tree run over the captured
    # tree's static buffers (3 requests in a bucket of 4: one padding request), as on a GPU
    draft = tiny_model(seed=4)
    w, depth, n = 3, 4, 12
    bd = BatchedTreeDrafter(draft, num_blocks=64, block_size=4, width=w, depth=depth, max_seqs=4, max_seq_blocks=16,
                            use_graphs=graphs, nodes=n)
    assert bd.tree_graphs == bool(graphs)
    g = torch.Generator().manual_seed(1)
    contexts = {str(i): torch.randint(1, 90, (k,), generator=g).tolist() for i, k in enumerate((5, 9, 2))}
    for _ in range(2):  # the second call catches up on two more tokens per request
        trees = bd.propose([(rid, toks, n) for rid, toks in contexts.items()])
        for rid, toks in contexts.items():
            tree = trees[rid]
            assert len(tree) == n + 1 and tree.tokens[0] == toks[-1]
            assert all(0 <= p < i for i, p in enumerate(tree.parents) if i > 0)  # prefix-closed, parents first
            for i in range(1, len(tree)):
                path = _path(tree, i)
                ids = torch.tensor([toks + path])
                logp = torch.log_softmax(draft(ids)[0].float(), -1)  # [len, V]
                L = len(toks)
                want = sum(float(logp[L - 1 + j, t]) for j, t in enumerate(path))
                assert abs(tree.logp[i] - want) < 1e-4, (rid, i)
                parent_row = logp[L - 2 + len(path)]  # the distribution the node was drawn from
                assert path[-1] in parent_row.topk(w).indices.tolist()
            # the N best: no left-out child of a kept node scores above the worst kept node
            worst = min(tree.logp[1:])
            for i in range(len(tree)):
                if len(_path(tree, i)) >= depth:
                    continue
                ids = torch.tensor([toks + _path(tree, i)])
                row = torch.log_softmax(draft(ids)[0, -1].float(), -1)
                kids = {tree.tokens[j] for j in range(1, len(tree)) if tree.parents[j] == i}
                for lp_, t in zip(*row.topk(w)):
                    if int(t) not in kids:
                        assert tree.logp[i] + float(lp_) <= worst + 1e-4
        for rid in contexts:
            contexts[rid] = contexts[rid] + [7, 11]
    for rid in contexts:
        bd.release(rid)
    assert bd.pool.check() == [] and bd.pool.num_free == bd.pool.num_blocks


def test_a_level_tree_wider_than_one_mask_word_is_refused():
    with pytest.raises(ValueError, match="more than 64"):
        BatchedTreeDrafter(tiny_model(seed=4), num_blocks=8, block_size=4, width=16, depth=6)


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_a_smaller_budget_keeps_the_best_nodes_of_the_same_tree(graphs):
    """Requests drafted together with different node budgets: the 5-node tree is the 5 best
    nodes (by path log-prob) of the 12-node tree the same request gets alone, prefix-closed."""
    draft = tiny_model(seed=4)
    bd = BatchedTreeDrafter(draft, num_blocks=64, block_size=4, width=3, depth=4, max_seqs=4, max_seq_blocks=16,
                            use_graphs=graphs, nodes=12)
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(1, 90, (k,), generator=g).tolist() for k in (6, 9))
    small = bd.propose([("a", a, 12), ("b", b, 5)])["b"]
    full = bd.propose([("b", b, 12)])["b"]  # (nothing new to catch up: the same roots)
    assert len(small) == 6 and all(0 <= p < i for i, p in enumerate(small.parents) if i > 0)
    best = sorted(range(1, len(full)), key=lambda i: -full.logp[i])[:5]
    assert sorted(_path(small, i) for i in range(1, 6)) == sorted(_path(full, i) for i in best)


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_every_request_with_a_budget_below_the_captured_trees(graphs):
    """All requests of a call ask fewer nodes than the drafter's captured trees hold: each gets
    its best nodes by score (not the first ones in tree order), as with the full budget."""
    draft = tiny_model(seed=4)
    bd = BatchedTreeDrafter(draft, num_blocks=64, block_size=4, width=3, depth=4, max_seqs=4, max_seq_blocks=16,
                            use_graphs=graphs, nodes=12)
    toks = torch.randint(1, 90, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    small = bd.propose([("a", toks, 7)])["a"]
    full = bd.propose([("a", toks, 12)])["a"]  # (nothing new to catch up: the same root)
    best = sorted(range(1, len(full)), key=lambda i: -full.logp[i])[:7]
    assert len(small) == 8 and sorted(_path(small, i) for i in range(1, 8)) == sorted(_path(full, i) for i in best)


@pytest.mark.parametrize("w", [1, 3, 16])
def test_the_level_pack_writes_the_general_packs_buffer(w):
    """BatchedModel.load_level_rows (BatchRows.pack_level: only a step's columns and the changed
    block tables written) leaves a tree bucket's host buffer exactly as load_rows of the level's
    Segments (the general pack, versioned tables) leaves it, with the same host figures: over a
    reused buffer, requests whose tables change or not, buckets with padding requests (R below
    the bucket, R changing), and after the buffer held another pass (the fixed fields rewritten)."""
    import numpy as np

    from tandem.engine.batched_draft import level_segments
    from tandem.engine.batched_model import Capacity, PackColumns, Segment

    bd = BatchedTreeDrafter(tiny_model(seed=4), num_blocks=64, block_size=4, width=w, depth=2, max_seqs=8,
                            max_seq_blocks=12, use_graphs="emulate")
    m, bucket = bd.model, 8
    cap = Capacity(bucket * w, bucket, bucket, m.max_seq_blocks, 1)  # (as _tree_graph makes it)
    general, level = m.static_rows(cap), m.static_rows(cap)
    g = torch.Generator().manual_seed(w)

    def rand(n: int) -> int:
        return int(torch.randint(0, n, (), generator=g))

    for step, R in enumerate((8, 8, 3, 3, 5, 0, 8, 1, 1, 6)):
        if R == 0:  # another pass packed into both buffers (a chunk: causal rows, every table rewritten)
            other = [Segment.chunk([5, 6], 3, [40, 41])]
            m.load_rows(general, other)
            m.load_rows(level, other)
            assert np.array_equal(general.host_np, level.host_np)
            continue
        lengths, tables, versions = [], [], []
        for r in range(R):
            L = 1 + rand(30)
            if r % 3 == 0:  # a new table (and version) every step
                blocks, version = [(r * 12 + step + i) % 60 for i in range(-(-(L + w) // 4))], 100 * step + r
            else:  # the same table every step (long enough for any length)
                blocks, version = [r * 12 + i for i in range(12)], -r
            lengths.append(L)
            tables.append(blocks)
            versions.append(version)
        cols = PackColumns.of(level_segments(lengths, tables, w))
        cols.versions = versions
        want = m.load_rows(general, cols)
        got = m.load_level_rows(level, lengths, tables, versions, w)
        assert np.array_equal(general.host_np, level.host_np), step
        assert general.tables == level.tables
        assert torch.equal(general.packed, level.packed)
        for f in ("num_rows", "new_rows", "contexts", "offsets", "num_logits"):
            assert getattr(got, f) == getattr(want, f), (step, f)


@pytest.mark.parametrize("K", [1, 4, 9])
def test_the_chunk_pack_writes_the_general_packs_buffer(K):
    """BatchedModel.load_chunk_rows (BatchRows.pack_chunks: each request's K causal rows after
    its committed columns, only a step's columns and changed tables written; the EAGLE-3 head's
    captured pass over a step's accepts) leaves a bucket's host buffer exactly as load_rows of
    the same Segment.chunk rows leaves it, with the same host figures: a reused buffer, tables
    that change or not, padding requests, and after the buffer held another pass."""
    import numpy as np

    from tandem.engine.batched_model import Capacity, PackColumns, Segment

    bd = BatchedTreeDrafter(tiny_model(seed=4), num_blocks=64, block_size=4, width=2, depth=2, max_seqs=8,
                            max_seq_blocks=12, use_graphs="emulate")
    m, bucket = bd.model, 8
    cap = Capacity(bucket * K, bucket, bucket, m.max_seq_blocks, 1)
    general, chunks = m.static_rows(cap), m.static_rows(cap)
    g = torch.Generator().manual_seed(K)

    def rand(n: int) -> int:
        return int(torch.randint(0, n, (), generator=g))

    for step, R in enumerate((8, 8, 3, 3, 0, 5, 1, 1, 6)):
        if R == 0:  # another pass packed into both buffers
            other = [Segment.chunk([5, 6], 3, [40, 41]), Segment.tree([1, 2, 3], [-1, 0, 0], 2, [7])]
            m.load_rows(general, other)
            m.load_rows(chunks, other)
            assert np.array_equal(general.host_np, chunks.host_np)
            continue
        starts, tables, versions = [], [], []
        for r in range(R):
            L = rand(30)
            if r % 3 == 0:
                blocks, version = [(r * 12 + step + i) % 60 for i in range(-(-(L + K) // 4))], 100 * step + r
            else:
                blocks, version = [r * 12 + i for i in range(12)], -r
            starts.append(L)
            tables.append(blocks)
            versions.append(version)
        cols = PackColumns.of([Segment.chunk([0] * K, L, t, logits=True) for L, t in zip(starts, tables)])
        cols.versions = versions
        want = m.load_rows(general, cols)
        got = m.load_chunk_rows(chunks, starts, tables, versions, K)
        assert np.array_equal(general.host_np, chunks.host_np), step
        assert general.tables == chunks.tables
        for f in ("num_rows", "new_rows", "contexts", "offsets", "num_logits"):
            assert getattr(got, f) == getattr(want, f), (step, f)


def test_tree_depth_bits_equal_the_host_masks():
    """tree_depth_bits (the target's tree rows built on the device, pointer jumping in a fixed
    number of rounds) gives every node's depth and ancestor mask as draft_tree.node_masks does:
    random trees of 1-63 nodes and depth 1-12, bit 63 included."""
    import random

    from tandem.engine.batched_draft import tree_depth_bits
    from tandem.tree.draft_tree import node_masks

    rng = random.Random(0)
    for _ in range(100):
        R, n, D = rng.randint(1, 4), rng.randint(1, 63), rng.randint(1, 12)
        pars = []
        for _ in range(R):
            depth, par = [0], []
            for q in range(1, n + 1):
                p = rng.choice([j for j in range(q) if depth[j] < D])
                par.append(p)
                depth.append(depth[p] + 1)
            pars.append(par)
        d, b = tree_depth_bits(torch.tensor(pars), D)
        for r in range(R):
            bits, depth = node_masks([-1] + pars[r])
            assert d[r].tolist() == depth
            assert [x & (2 ** 64 - 1) for x in b[r].tolist()] == bits
