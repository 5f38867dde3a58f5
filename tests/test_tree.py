"""Exact hand-built cases: tree masks (SwiftSpec Figure 3) and KV commit (Figure 4)."""
from __future__ import annotations

import torch

from tandem.kv.cache import KVCache
from tandem.tree.draft_tree import DraftTree, ancestor_mask, tree_attention_mask


def test_figure3_non_square_mask():
    # Existing tree t1..t6 (blue), new leaves t7..t10 (yellow). The figure's text fixes
    # t7 -> t1, t2, t4, t7; the rest of the shape is reconstructed: t2, t3 under t1; t4 under
    # t2; t5, t6 under t3; t7, t8 under t4; t9 under t5; t10 under t6.
    parents = [-1, 0, 0, 1, 2, 2, 3, 3, 4, 5]  # node i is t(i+1)
    mask = tree_attention_mask(prefix_len=0, tree_parents=parents, new_rows=[6, 7, 8, 9])
    expected = torch.zeros(4, 10, dtype=torch.bool)
    for row, visible in enumerate([(1, 2, 4, 7), (1, 2, 4, 8), (1, 3, 5, 9), (1, 3, 6, 10)]):
        for t in visible:
            expected[row, t - 1] = True
    assert mask.shape == (4, 10)
    assert torch.equal(mask, expected)


def test_mask_prefix_columns_always_visible_and_padding_hidden():
    mask = tree_attention_mask(prefix_len=3, tree_parents=[-1, 0, 0, 1], width=9)
    assert mask.shape == (4, 9)
    assert mask[:, :3].all()
    assert not mask[:, 7:].any()
    assert torch.equal(mask[:, 3:7], ancestor_mask([-1, 0, 0, 1]))
    assert torch.equal(ancestor_mask([-1, 0, 1, 2]), torch.ones(4, 4, dtype=torch.bool).tril())


def test_figure4_commit_moves_path_and_keeps_subtree_bit_identical():
    # Verified prefix t1, t3, t7, t10; tree region t11..t18 with t11, t12 under the prefix end,
    # t13, t14 under t11, t15, t16 under t12, t17, t18 under t15. The target accepts t12, t15.
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=4, capacity=16, dtype=torch.float32, device="cpu")
    cache.append_prefix(4)
    cache.reserve(8)
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    rel = {f"t{11 + i}": i for i in range(8)}  # tree-relative row of each node
    cache.commit(path=[rel["t12"], rel["t15"]], keep=[rel["t17"], rel["t18"]])
    assert (cache.prefix_len, cache.tree_len) == (6, 2)
    order = [0, 1, 2, 3, 4 + rel["t12"], 4 + rel["t15"], 4 + rel["t17"], 4 + rel["t18"]]
    assert torch.equal(cache.k[:, :, :, :8], before_k[:, :, :, order])
    assert torch.equal(cache.v[:, :, :, :8], before_v[:, :, :, order])


def test_subset_reindexes_parents():
    t = DraftTree(tokens=[5, 6, 7, 8, 9], parents=[-1, 0, 0, 1, 3], logp=[0, -1, -2, -1.5, -1.7])
    s = t.subset([0, 1, 3, 4])
    assert s.tokens == [5, 6, 8, 9]
    assert s.parents == [-1, 0, 1, 2]
    assert s.depth == [0, 1, 2, 3]


def test_ancestor_mask_matches_the_definition_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = int(torch.randint(1, 90, (), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
        mask = ancestor_mask(parents)
        for i in range(n):
            chain, j = set(), i
            while j >= 0:
                chain.add(j)
                j = parents[j]
            assert mask[i].tolist() == [k in chain for k in range(n)]
