"""Evolving tree cache (tandem.drafting.evolving): exact paper cases and a property test.

The reference for every K/V check is a from-scratch recomputation: a fresh cache is fed the
verified prefix (causal) and then the surviving fed nodes in row order with their ancestor
mask and positions; its rows must equal the re-rooted cache's rows (fp32, within 1e-5).

How the paper's trees were reconstructed (token tK has id K):

Figure 4 (s3.2): prefix t1,t3,t7,t10; tree t11..t18 hangs from t10 (t10 -> t11,t12;
t11 -> t13,t14; t12 -> t15,t16; t15 -> t17,t18), all fed, rows in node order. The target
verifies t12,t15 (accepted + bonus): t12,t15 join the prefix, t15's children t17,t18 survive
in order, t11,t13,t14,t16 are dropped.

Figure 2 (s3.1.2), bs = 4 tokens sent (the root + N = 3 nodes), d = 3, w = 2. Initial fed tree
t1..t6 with root t1: t1 -> t2,t3; t2 -> t4 (Figure 3's mask row t7 -> t1,t2,t4,t7 fixes this
branch); t3 -> t5,t6. Log-probs are chosen so the best 3 nodes are t2,t3,t5: iteration 1
sends t1,t2,t3,t5. While it is verified the draft grows 3 rounds of 2: t7 <- t4, t8 <- t5;
t9,t10 <- t6; t11 <- t9, t12 <- t10 (so t6's subtree is t9..t12, as the summary's walkthrough
says). The target answers (t1,t3,t6): re-root at t6, t9..t12 survive and iteration 2 sends
t6,t9,t10,t11. The figure names only t6's subtree, so the 6 nodes grown in iteration 2 are
placed under it by hand (t13,t14,t15 and three unnamed nodes); the target answers (t6,t9,t16)
and t16 is no child of t9: a new tree starts at t16. The figure fixes which nodes are grown,
not the draft's probabilities, so these cases feed hand-placed nodes (`add_node` + `feed`);
the property test covers model-driven expansion.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models_for_tests import unit_scaled_model
from tandem.models.transformer import Transformer
from tandem.runtime.runner import ModelRunner
from tandem.drafting.evolving import EvolvingTree

V = 32
CAP = 160


def _model(seed: int = 0) -> Transformer:
    return unit_scaled_model(V, seed, head_scale=1.0, max_positions=512)


MODEL = _model()


def _tree(width: int = 2) -> EvolvingTree:
    return EvolvingTree(ModelRunner(MODEL, CAP, use_graphs=False), width)


def _recompute(tree: EvolvingTree) -> ModelRunner:
    fresh = ModelRunner(MODEL, CAP, use_graphs=False)
    fresh.prefill(tree.prefix_tokens)
    fed = sorted((i for i in range(1, len(tree)) if tree.row[i] >= 0), key=lambda i: tree.row[i])
    if fed:
        mask = torch.zeros(len(fed), len(fed), dtype=torch.bool)
        for j, i in enumerate(fed):
            mask[j, tree.ancestor_rows(i)] = True
        root_pos = len(tree.prefix_tokens) - 1
        fresh.step([tree.tokens[i] for i in fed], [root_pos + tree.depth[i] for i in fed], mask)
    return fresh


def _assert_matches_recompute(tree: EvolvingTree) -> None:
    tree.check()
    fresh = _recompute(tree)
    L = tree.cache.length
    assert fresh.cache.length == L
    for a, b in ((tree.cache.k, fresh.cache.k), (tree.cache.v, fresh.cache.v)):
        diff = (a[:, :, :, :L] - b[:, :, :, :L]).abs().max().item() if L else 0.0
        assert diff < 1e-5, diff


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t[:, :, :, rows].clone()


def test_figure4_reroot_moves_kv_without_recomputation():
    tree = _tree()
    tree.start([1, 3, 7, 10])
    tree.feed_pending(add_children=False)
    spec = {11: 10, 12: 10, 13: 11, 14: 11, 15: 12, 16: 12, 17: 15, 18: 15}  # child -> parent token
    node = {10: 0}
    for tok, par in spec.items():
        node[tok] = tree.add_node(node[par], tok, -0.1 * (tok - 10))
    tree.feed([node[t] for t in spec], add_children=False)
    P = tree.cache.prefix_len
    assert (P, tree.cache.tree_len) == (4, 8)
    _assert_matches_recompute(tree)
    k0, v0 = tree.cache.k.clone(), tree.cache.v.clone()
    row = {t: tree.row[node[t]] for t in spec}

    r = tree.reroot([12, 15])

    assert r.hit and (r.matched, r.reused, r.dropped) == (2, 2, 4)
    assert tree.prefix_tokens == [1, 3, 7, 10, 12, 15]
    assert tree.tokens == [15, 17, 18] and tree.parents == [-1, 0, 0] and tree.row == [-1, 0, 1]
    assert tree.depth == [0, 1, 1] and tree.cache.prefix_len == 6 and tree.cache.tree_len == 2
    old = [P + row[t] for t in (12, 15, 17, 18)]
    for now, before in ((tree.cache.k, k0), (tree.cache.v, v0)):
        assert torch.equal(now[:, :, :, :P], before[:, :, :, :P])  # the old prefix is untouched
        assert torch.equal(now[:, :, :, P:P + 4], _rows(before, old))  # bit-identical, gathered
    _assert_matches_recompute(tree)


def test_figure2_reroot_then_new_tree():
    tree = _tree(width=2)
    tree.start([30, 1])
    tree.feed_pending(add_children=False)
    ids = {1: 0}

    def grow(spec: list[tuple[int, int, float]], rounds_of: int) -> None:
        for k in range(0, len(spec), rounds_of):  # one feed per expansion round (w nodes)
            batch = []
            for t, p, lp in spec[k:k + rounds_of]:
                ids[t] = tree.add_node(ids[p], t, lp)
                batch.append(ids[t])
            tree.feed(batch, add_children=False)

    # initial tree t1..t6 (fed), then iteration 1 sends the root + the best 3 nodes
    grow([(2, 1, -0.1), (3, 1, -0.2), (4, 2, -1.0), (5, 3, -0.3), (6, 3, -0.5)], rounds_of=5)
    sent = tree.select(3)
    assert sent.tokens == [1, 2, 3, 5] and sent.parents == [-1, 0, 0, 2]
    # d = 3 rounds of w = 2 while the target verifies
    grow([(7, 4, -1.1), (8, 5, -0.35), (9, 6, -0.6), (10, 6, -0.7), (11, 9, -0.8), (12, 10, -0.9)], rounds_of=2)
    assert len(tree) == 12 and tree.cache.tree_len == 11
    P = tree.cache.prefix_len
    k0 = tree.cache.k.clone()
    old_rows = {t: P + tree.row[i] for t, i in ids.items() if t != 1}

    r = tree.reroot([3, 6])  # the target answered (t1, t3, t6): t3 accepted, t6 the bonus

    assert r.hit and r.reused == 4 and r.kept_nodes == 4
    assert tree.tokens == [6, 9, 10, 11, 12] and tree.parents == [-1, 0, 0, 1, 2]
    assert tree.prefix_tokens[-3:] == [1, 3, 6]
    assert torch.equal(tree.cache.k[:, :, :, P:P + 6], _rows(k0, [old_rows[t] for t in (3, 6, 9, 10, 11, 12)]))
    _assert_matches_recompute(tree)
    sent = tree.select(3)
    assert sent.tokens == [6, 9, 10, 11]  # iteration 2 sends t6's grown subtree at once

    ids = {tree.tokens[i]: i for i in range(len(tree))}
    grow([(13, 11, -0.5), (14, 12, -0.6), (15, 13, -0.7), (25, 10, -0.75), (26, 14, -0.8), (27, 15, -0.9)],
         rounds_of=2)
    P = tree.cache.prefix_len
    k0, row9 = tree.cache.k.clone(), P + tree.row[ids[9]]

    r = tree.reroot([9, 16])  # the target answered (t6, t9, t16); t16 is not in the tree

    assert not r.hit and r.matched == 1 and r.reused == 0
    assert tree.tokens == [16] and tree.pending == [16] and tree.cache.tree_len == 0
    assert tree.prefix_tokens[-2:] == [6, 9] and tree.cache.prefix_len == P + 1
    assert torch.equal(tree.cache.k[:, :, :, P], k0[:, :, :, row9])
    tree.check()
    tree.grow(3)  # the new tree at t16: feed it, expand until 3 nodes are on offer
    assert tree.root_fed and len(tree) - 1 >= 3 and tree.prefix_tokens[-1] == 16
    _assert_matches_recompute(tree)


def test_select_is_prefix_closed_and_best_first():
    tree = _tree(width=3)
    tree.start([4, 5, 6])
    tree.grow(12)
    for _ in range(2):
        tree.expand()
    for n in (1, 3, 7, 12):
        sub = tree.select(n)
        assert len(sub) == n + 1
        assert all(0 <= p < i for i, p in enumerate(sub.parents) if i)
        chosen = sorted(sub.logp[1:], reverse=True)
        rest = sorted(tree.logp[1:], reverse=True)
        assert chosen == rest[:n]


def test_expansion_respects_the_row_cap():
    tree = EvolvingTree(ModelRunner(MODEL, CAP, use_graphs=False), width=3, max_rows=7)
    tree.start([1, 2])
    tree.grow(100)
    while tree.expand():
        pass
    assert tree.cache.tree_len == 7 and tree.expand() == 0
    _assert_matches_recompute(tree)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    width=st.integers(1, 3),
    prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=5),
    steps=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10_000), st.booleans(), st.integers(0, V - 1)),
                   min_size=1, max_size=3),
)
def test_reroot_invariant_and_kv_equal_recomputation(width, prompt, steps):
    """Random trees (model-driven expansion), random accepted paths, bonus in or out of the tree."""
    tree = _tree(width)
    tree.start(prompt)
    for rounds, pick, extra, bonus in steps:
        tree.feed_pending()
        for _ in range(rounds):
            tree.expand()
        _assert_matches_recompute(tree)
        node = pick % len(tree)  # the accepted path ends at a random node (fed or candidate)
        path = []
        while node > 0:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        verified = path[::-1] + ([bonus] if extra or not path else [])
        before = tree.cache.prefix_len
        r = tree.reroot(verified)
        assert r.matched >= len(path)
        assert tree.tokens[0] == verified[-1]
        assert tree.cache.prefix_len + len(tree.pending) == before + len(verified)
        _assert_matches_recompute(tree)


@pytest.mark.parametrize("use_graphs", [False, "emulate"])
def test_device_rounds_build_the_host_rounds_tree(use_graphs):
    """tandem.drafting.device_rounds: R rounds as tensor code (one read-back) grow the tree the
    host loop grows round by round, with equal K/V rows, before and after a re-root."""
    def build(device_rounds: bool) -> EvolvingTree:
        t = EvolvingTree(ModelRunner(MODEL, CAP, use_graphs=use_graphs), width=3, max_rows=40,
                         device_rounds=device_rounds)
        t.start([5, 9, 2, 7])
        t.feed_pending()
        return t

    host, dev = build(False), build(True)
    for _ in range(4):
        assert host.expand() == 3
    assert dev.expand_rounds(4) == 4
    for t in (host, dev):
        _assert_matches_recompute(t)
    assert (dev.tokens, dev.parents, dev.depth, dev.row) == (host.tokens, host.parents, host.depth, host.row)
    assert max(abs(a - b) for a, b in zip(dev.logp, host.logp)) < 1e-5
    assert dev.steps == host.steps
    L = host.cache.length
    # (not bit-equal: the device round attends over a width bucket, the host step over exactly L)
    assert (dev.cache.k[:, :, :, :L] - host.cache.k[:, :, :, :L]).abs().max() < 1e-5
    # accept the most probable fed grandchild's path; its fed subtree survives the re-root
    best = max((i for i in range(1, len(host)) if host.row[i] >= 0 and host.depth[i] == 2),
               key=lambda i: host.logp[i])
    verified = [host.tokens[host.parents[best]], host.tokens[best]]
    assert host.reroot(verified) == dev.reroot(verified)
    for _ in range(2):
        host.expand()
    assert dev.expand_rounds(2) == 2
    _assert_matches_recompute(dev)
    assert (dev.tokens, dev.parents, dev.row) == (host.tokens, host.parents, host.row)
    # the row cap: 40 rows hold 13 rounds of 3; what is left goes through the host path
    assert dev.expand_rounds(100) >= 1
    while dev.expand_rounds(1):
        pass
    assert dev.cache.tree_len == 40
    _assert_matches_recompute(dev)


def test_grow_with_deferred_root_children_matches_the_host_path():
    """grow() leaves the root's children to the device rounds (no host read of the root's
    logits); the trees, selections and re-roots still match the host path's."""
    trees = [EvolvingTree(ModelRunner(MODEL, CAP, use_graphs="emulate"), width=2, max_rows=30, device_rounds=d)
             for d in (False, True)]
    for t in trees:
        t.start([4, 8, 15, 16])
    for verified in ([None], [None, 3], [7]):
        sent = []
        for t in trees:
            t.grow(nodes=10, fed=8)
            _assert_matches_recompute(t)
            sent.append(t.select(10))
        host, dev = trees
        assert (dev.tokens, dev.parents, dev.row) == (host.tokens, host.parents, host.row)
        assert sent[0].tokens == sent[1].tokens and sent[0].parents == sent[1].parents
        # accept the best child of the root (then a bonus in or out of the tree)
        best = max(host.children()[0], key=lambda c: host.logp[c])
        v = [host.tokens[best] if x is None else x for x in verified]
        assert host.reroot(v) == dev.reroot(v)


def test_device_rounds_outlive_a_tree_on_the_same_runner():
    """One DeviceRounds per runner (its graphs are captured once), reloaded for every new tree:
    a second request's tree must not see the first one's state."""
    runner = ModelRunner(MODEL, CAP, use_graphs="emulate")
    seen = []
    for prompt in ([4, 8, 15], [16, 23, 30, 7]):
        dev = EvolvingTree(runner, width=2, max_rows=30)
        host = EvolvingTree(ModelRunner(MODEL, CAP, use_graphs=False), width=2, max_rows=30, device_rounds=False)
        for t in (dev, host):
            t.start(prompt)
            t.grow(nodes=8, fed=6)
        assert (dev.tokens, dev.parents, dev.row) == (host.tokens, host.parents, host.row)
        _assert_matches_recompute(dev)
        seen.append(dev._dev)
    assert seen[0] is seen[1]


def test_device_rounds_with_zero_probability_children():
    """A draft that gives every token but one probability 0: the rounds keep those children as
    -inf nodes, never feed an empty node slot, and never send a -inf node."""
    model = _model(seed=2)
    model.lm_head.register_forward_hook(lambda mod, inp, out: out.index_fill(-1, torch.arange(1, V), float("-inf")))
    tree = EvolvingTree(ModelRunner(model, CAP, use_graphs="emulate"), width=2, max_rows=20)
    tree.start([3, 4, 5])
    tree.grow(nodes=6, fed=8)
    tree.check()  # fed rows are exactly rows 0 .. tree_len-1: no empty slot was fed
    assert tree.cache.tree_len == 8
    assert any(lp == float("-inf") for lp in tree.logp)
    sent = tree.select(6)
    assert all(lp > float("-inf") for lp in sent.logp) and set(sent.tokens[1:]) == {0}
