"""Exact hand-built cases (SwiftSpec Figures 3 and 4) through the code decoding runs.

The masks checked here are the ones the model's forward receives (a forward pre-hook records
its `mask` argument), built by what `tree`, `async` and greedy `chain` call: `EvolvingTree.feed`
(host rounds) or `DeviceRounds._round` (device rounds) on the draft side, `Target.launch` on the
target side, and `ModelRunner.step` in between, eager (`use_graphs=False`) or on the CUDA-graph
path's static buffers (`"emulate"`: row and width buckets, padded rows). Token tK has id K.
"""
from __future__ import annotations

import pytest
import torch

from models_for_tests import unit_scaled_model
from tandem.config import SamplingConfig
from tandem.runtime.target import Target
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree, ancestor_mask
from tandem.drafting.evolving import EvolvingTree

V = 32
CAP = 160
RUNTIME_PATHS = [  # (use_graphs, device_rounds): every way a draft round reaches the model
    pytest.param(False, False, id="eager-host"), pytest.param("emulate", False, id="graphs-host"),
    pytest.param(False, True, id="eager-device"), pytest.param("emulate", True, id="graphs-device"),
]


class MaskRecorder:
    """The attention mask [rows, columns] of every forward call `model` receives, in call order."""

    def __init__(self, model: torch.nn.Module):
        self.masks: list[torch.Tensor] = []
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        mask = kwargs["mask"] if "mask" in kwargs else args[4]  # [B, 1, rows, columns] bool
        self.masks.append(mask[0, 0].clone())  # cloned: the graph path reuses one static buffer


@pytest.fixture
def recorded():
    """A fresh tiny model (its hook dies with it) and the recorder on it."""
    model = unit_scaled_model(V, seed=0, head_scale=1.0, max_positions=512)
    rec = MaskRecorder(model)
    yield model, rec
    rec.handle.remove()


def mask_of(rows: list[tuple[int, ...]], columns: list[int]) -> torch.Tensor:
    """[len(rows), len(columns)] bool: row r is True at the columns holding the tokens rows[r]
    (cache columns named by their tokens, in cache order)."""
    out = torch.zeros(len(rows), len(columns), dtype=torch.bool)
    for r, toks in enumerate(rows):
        out[r, [columns.index(t) for t in toks]] = True
    return out


def assert_mask(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The real rows of `got` equal `expected` and see nothing past its columns (width-bucket
    padding); rows past them (row-bucket padding, graph path only) see column 0 alone."""
    n, c = expected.shape
    assert got.shape[0] >= n and got.shape[1] >= c, got.shape
    assert torch.equal(got[:n, :c], expected), f"\n{got[:n, :c].int()}\n!=\n{expected.int()}"
    assert not got[:n, c:].any()
    pad = got[n:]
    assert pad[:, 0].all() and not pad[:, 1:].any()


@pytest.mark.parametrize("use_graphs,device_rounds", RUNTIME_PATHS)
def test_figure3_non_square_mask_of_an_expansion_round(recorded, use_graphs, device_rounds):
    # Existing tree t1..t6 (blue), new leaves t7..t10 (yellow). The figure's text fixes
    # t7 -> t1, t2, t4, t7; the rest of the shape is reconstructed: t2, t3 under t1; t4 under
    # t2; t5, t6 under t3; t7, t8 under t4; t9 under t5; t10 under t6. The root t1 is the prompt
    # (prefix row 0) and t2..t6 were fed in that order (tree rows 0..4), so the runtime's cache
    # columns 0..9 are t1..t10 and the round's mask is the figure's 4 x 10 matrix exactly.
    model, rec = recorded
    tree = EvolvingTree(ModelRunner(model, CAP, use_graphs=use_graphs), width=4, max_rows=20,
                        device_rounds=device_rounds)
    tree.start([1])
    tree.feed_pending(add_children=False)
    node = {1: 0}
    for tok, par in ((2, 1), (3, 1), (4, 2), (5, 3), (6, 3)):
        node[tok] = tree.add_node(node[par], tok, -0.1 * (tok - 1))
    tree.feed([node[t] for t in (2, 3, 4, 5, 6)], add_children=False)
    for tok, par in ((7, 4), (8, 4), (9, 5), (10, 6)):  # the candidates, best first: t7 .. t10
        node[tok] = tree.add_node(node[par], tok, -1.0 - 0.1 * (tok - 7))
    rec.masks.clear()

    assert tree.expand_rounds(1) == 1  # the round feeds the w = 4 best candidates

    assert len(rec.masks) == 1  # one draft step for the whole round
    figure3 = mask_of([(1, 2, 4, 7), (1, 2, 4, 8), (1, 3, 5, 9), (1, 3, 6, 10)], columns=list(range(1, 11)))
    assert_mask(rec.masks[0], figure3)
    assert [tree.row[node[t]] for t in (7, 8, 9, 10)] == [5, 6, 7, 8]
    tree.check()


# Figure 4 (s3.2): verified prefix t1, t3, t7, t10; tree t11..t18 hangs from t10 (t10 -> t11, t12;
# t11 -> t13, t14; t12 -> t15, t16; t15 -> t17, t18). The target accepts t12 and answers t15.
FIG4_PARENT = {11: 10, 12: 10, 13: 11, 14: 11, 15: 12, 16: 12, 17: 15, 18: 15}


def _fig4_ancestors(tok: int) -> tuple[int, ...]:
    out = [tok]
    while out[-1] in FIG4_PARENT:
        out.append(FIG4_PARENT[out[-1]])
    return tuple(out)


@pytest.mark.parametrize("use_graphs,device_rounds", RUNTIME_PATHS)
def test_figure4_draft_masks_before_and_after_the_reroot(recorded, use_graphs, device_rounds):
    """The draft feeds Figure 4's tree, re-roots at t15 (t17, t18 keep their rows), and the next
    round's leaves see the new prefix t1, t3, t7, t10, t12, t15 and their own kept ancestor."""
    model, rec = recorded
    tree = EvolvingTree(ModelRunner(model, CAP, use_graphs=use_graphs), width=2, max_rows=20,
                        device_rounds=device_rounds)
    tree.start([1, 3, 7, 10])
    tree.feed_pending(add_children=False)
    node = {10: 0}
    for tok, par in FIG4_PARENT.items():
        node[tok] = tree.add_node(node[par], tok, -0.1 * (tok - 10))
    rec.masks.clear()
    tree.feed([node[t] for t in FIG4_PARENT], add_children=False)
    prefix = (1, 3, 7)  # t10, the root, is the fourth prefix column
    want = mask_of([prefix + _fig4_ancestors(t) for t in FIG4_PARENT], columns=[1, 3, 7, 10, *FIG4_PARENT])
    assert_mask(rec.masks[-1], want)

    r = tree.reroot([12, 15])

    assert r.hit and (r.matched, r.reused, r.dropped) == (2, 2, 4)
    assert tree.tokens == [15, 17, 18] and tree.row == [-1, 0, 1]
    t19 = tree.add_node(1, 19, -1.0)  # one candidate under each kept node
    t20 = tree.add_node(2, 20, -1.1)
    rec.masks.clear()
    assert tree.expand_rounds(1) == 1
    assert len(rec.masks) == 1
    cols = [1, 3, 7, 10, 12, 15, 17, 18, 19, 20]  # the committed path, then the kept rows t17, t18
    assert_mask(rec.masks[0], mask_of([(1, 3, 7, 10, 12, 15, 17, 19), (1, 3, 7, 10, 12, 15, 18, 20)], cols))
    assert (tree.row[t19], tree.row[t20]) == (2, 3)
    tree.check()


@pytest.mark.parametrize("use_graphs", [False, "emulate"])
def test_figure4_target_pass_mask_and_commit(recorded, use_graphs):
    """The target verifies Figure 4's tree (root t10 first) over the prefix t1, t3, t7, then
    commits the accepted path t10, t12, t15 by gathering its K/V rows, bit for bit."""
    model, rec = recorded
    runner = ModelRunner(model, CAP, use_graphs=use_graphs)
    runner.prefill([1, 3, 7])
    toks = [10, *FIG4_PARENT]
    logp = {10: 0.0, 11: -0.5, 12: -0.1, 13: -0.6, 14: -0.7, 15: -0.2, 16: -0.4, 17: -0.3, 18: -0.35}
    tree = DraftTree(tokens=toks, parents=[-1] + [toks.index(FIG4_PARENT[t]) for t in toks[1:]],
                     logp=[logp[t] for t in toks])  # the best path: t10, t12, t15
    target = Target(runner, SamplingConfig(), torch.Generator().manual_seed(0))
    rec.masks.clear()
    launch = target.launch(tree, now=True, forced=2)  # replay: accept 2 along the best path
    assert len(rec.masks) == 1
    assert_mask(rec.masks[0], mask_of([(1, 3, 7) + _fig4_ancestors(t) for t in toks], columns=[1, 3, 7, *toks]))
    k0, v0 = runner.cache.k.clone(), runner.cache.v.clone()

    result = target.finish(launch)

    assert result.path == [0, 2, 5] and result.tokens[:2] == [12, 15]
    assert (runner.cache.prefix_len, runner.cache.tree_len) == (6, 0)
    rows = [0, 1, 2, 3 + 0, 3 + 2, 3 + 5]  # prefix t1, t3, t7, then t10, t12, t15's tree rows
    for now, before in ((runner.cache.k, k0), (runner.cache.v, v0)):
        assert torch.equal(now[:, :, :, :6], before[:, :, :, rows])


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


# an EAGLE-3 level tree of the bundled pair (depth 4, a power of two: pointer jumping's last round
# is the one that reaches the root)
EAGLE_TREE = [-1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 4, 4, 10, 6, 13, 14]


@pytest.mark.parametrize("trees,size", [(3, 9), (40, 17), (30, 9), (12, 64), (5, 70), (30, None)])
def test_tree_masks_of_many_trees_are_each_trees_ancestors_and_depths(trees, size):
    """tree_masks over trees side by side (python ints for few nodes or a tree wider than 64,
    uint64 pointer jumping for many) gives every node its ancestors-and-self bits and depth, as
    walking each tree's parents does (size None: the EAGLE-3 tree, 30 times); deepest_depths
    gives each tree's deepest."""
    from tandem.tree.draft_tree import deepest_depths, tree_masks

    g = torch.Generator().manual_seed(trees * (size or 1))
    parents, sizes, want_bits, want_depth = [], [], [], []
    for t in range(trees):
        n = 1 if t == 0 else size or len(EAGLE_TREE)  # (a root alone among them)
        reach = 3 if t % 2 else n  # deep trees and bushy ones (parents anywhere before)
        par = [-1] + [int(torch.randint(max(0, i - reach), i, (), generator=g)) for i in range(1, n)]
        if size is None and n > 1:
            par = EAGLE_TREE
        parents += par
        sizes.append(n)
        for i in range(n):
            bits, depth, j = 0, 0, i
            while j >= 0:
                bits |= 1 << j
                depth += j != i
                j = par[j]
            want_bits.append(bits)
            want_depth.append(depth)
    bits, depth, words = tree_masks(parents, sizes)
    assert [int(b) for b in bits] == want_bits and [int(d) for d in depth] == want_depth
    assert words == -(-max(sizes) // 64)
    # each tree's deepest depth (what the engine's emits read), from either kind of depths
    at, want_deepest = 0, []
    for n in sizes:
        want_deepest.append(max(want_depth[at:at + n]))
        at += n
    assert deepest_depths(depth, sizes) == want_deepest
    assert deepest_depths(want_depth, sizes) == want_deepest
    assert deepest_depths(*tree_masks([-1] * trees, [1] * trees)[1:2], [1] * trees) == [0] * trees  # roots alone


def test_emit_records_the_depths_a_tree_offers_with_or_without_its_deepest_given():
    """Emitter.emit's per-depth figures: each depth some draft node sits at counts as offered, and
    as accepted when the pass accepted at least that many; the same whether emit walks the tree
    or is handed its deepest depth (the engine's, from its packing), roots alone included."""
    import time

    from tandem.config import GenerationConfig
    from tandem.runtime.emit import Emitter
    from tandem.tree.draft_tree import DraftTree
    from tandem.verify.verifier import VerifyResult

    g = torch.Generator().manual_seed(5)
    ems = [Emitter(10 ** 6, set(), GenerationConfig(), None, None, time.perf_counter()) for _ in range(2)]
    want: dict[int, list[int]] = {}
    for step in range(40):
        n = 1 if step % 7 == 0 else int(torch.randint(2, 20, (), generator=g))
        reach = 2 if step % 2 else n
        parents = [-1] + [int(torch.randint(max(0, i - reach), i, (), generator=g)) for i in range(1, n)]
        tree = DraftTree(list(range(n)), parents, [0.0] * n)
        depth = tree.depth
        path = [0]
        while True:  # a random accepted path from the root
            kids = [i for i in range(n) if parents[i] == path[-1]]
            if not kids or int(torch.randint(0, 3, (), generator=g)) == 0:
                break
            path.append(kids[int(torch.randint(0, len(kids), (), generator=g))])
        result = VerifyResult(path, [tree.tokens[i] for i in path[1:]] + [99], n - 1)
        for k in {depth[i] for i in range(1, n)}:
            want.setdefault(k, [0, 0])[0] += 1
            want[k][1] += len(path) - 1 >= k
        ems[0].emit(tree, result)
        ems[1].emit(tree, result, max(depth))
    assert ems[0].per_depth == ems[1].per_depth == want
    assert ems[0].out == ems[1].out and ems[0].accept_lengths == ems[1].accept_lengths
