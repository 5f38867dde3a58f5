"""Parallel block drafter: the lattice, the best-first tree over it, and exact decoding with it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models_for_tests import check_best_first_trees, tiny_model
from triton_interpreter import NEEDS_TRITON, run_checks
from tandem.config import SamplingConfig, SpecConfig, GenerationConfig
from tandem.drafting.lattice import Lattice, best_first_tree, build_lattice
from tandem.models.block_drafter import BlockDrafter, BlockDrafterConfig, load_block_drafter, save_block_drafter
from tandem.runtime.generate import Generator


def make_drafter(target, block: int = 6, k: int = 4, markov: int = 8, seed: int = 0) -> BlockDrafter:
    tc = target.config
    cfg = BlockDrafterConfig(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=96,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=tc.hidden_size // 4, target_feature_layers=(0, 1, 1), block_size=block,
                             num_candidates=k, markov_rank=markov, max_position_embeddings=512)
    torch.manual_seed(seed)
    m = BlockDrafter(cfg, target.model.embed_tokens, target.lm_head)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    return m.eval().requires_grad_(False)


def test_lattice_shapes_and_markov_changes_scores_by_previous_token():
    target = tiny_model(seed=3)
    d = make_drafter(target, block=5, k=4)
    logits = torch.randn(5, target.config.vocab_size)
    lat = build_lattice(logits, 4, root=7, markov=d.markov)
    assert lat.tokens.shape == (5, 4) and lat.cond.shape == (5, 4, 4)
    # every position's candidates are its top-4 tokens by the drafter's own logits
    assert (np.sort(lat.tokens, 1) == np.sort(logits.topk(4).indices.numpy(), 1)).all()
    # the Markov head makes the score of a candidate depend on which parent candidate precedes it
    assert not np.allclose(lat.cond[2, 0], lat.cond[2, 1])
    # and with the root as parent, it depends on the root token
    other = build_lattice(logits, 4, root=8, markov=d.markov)
    assert not np.allclose(lat.cond[0, 0], other.cond[0, 0])
    # without the head, the parent does not matter: cond is the top-k log-probs
    plain = build_lattice(logits, 4, root=7)
    np.testing.assert_allclose(plain.cond[2, 0], plain.cond[2, 3])
    np.testing.assert_allclose(plain.cond[1, 0], logits[1].log_softmax(-1).topk(4).values.numpy(), rtol=1e-5)


def brute_force_best(lat: Lattice, root: int, n: int) -> list[float]:
    """Scores of every lattice node (path), best n: the best-first tree must hold exactly these."""
    B, K = lat.tokens.shape
    scores = []

    def walk(d, cand, score):
        if d == B:
            return
        for c in range(K):
            s = score + lat.cond[d, cand, c]
            scores.append(s)
            walk(d + 1, c, s)

    walk(0, 0, 0.0)
    return sorted(scores, reverse=True)[:n]


@pytest.mark.parametrize("n", [1, 5, 12, 30])
def test_best_first_tree_is_prefix_closed_best_first_and_exactly_n(n):
    torch.manual_seed(n)
    u, v = torch.randn(40, 3), torch.randn(40, 3)
    lat = build_lattice(torch.randn(4, 40) * 2, 3, root=5, markov=lambda a, b: (u[a] * v[b]).sum(-1))
    tree = best_first_tree(lat, 5, n)
    assert len(tree) == n + 1 and tree.tokens[0] == 5
    for i in range(1, len(tree)):
        p = tree.parents[i]
        assert 0 <= p < i  # topological, prefix-closed
        assert tree.logp[i] <= tree.logp[p] + 1e-12
    # best-first by parent-conditioned path score: the n best paths of the whole lattice
    np.testing.assert_allclose(sorted(tree.logp[1:], reverse=True), brute_force_best(lat, 5, n), rtol=1e-9)
    # siblings carry distinct tokens
    sib = {(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree))}
    assert len(sib) == n


@pytest.mark.parametrize("nodes", [1, 7, 32, 60])
def test_best_first_trees_of_a_batch_equal_each_lattices_own_tree(nodes):
    """The vectorised trees over a batch of lattices (ragged: 1 to 16 positions, so some hold
    fewer than `nodes` nodes) have each request's node set of the heap walk over its own
    lattice, in an order where every parent comes first."""
    check_best_first_trees(nodes, "cpu")



@pytest.mark.parametrize("method", ["chain", "tree"])
@pytest.mark.parametrize("use_graphs", [False, "emulate"])
def test_greedy_output_equals_ar(method, use_graphs):
    target = tiny_model(seed=3)
    draft = make_drafter(target)
    prompts = [[1, 5, 9, 2], [7], list(range(3, 30))]
    ar = Generator(target, None, use_graphs=use_graphs)
    gen = Generator(target, draft, use_graphs=use_graphs)
    spec = SpecConfig(k=4, nodes=12)
    g = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for p in prompts:
        want = ar.generate(p, "ar", gen=g).token_ids
        got = gen.generate(p, method, spec, gen=g)
        assert got.token_ids == want


def test_trained_copy_accepts_and_saves_and_loads(tmp_path):
    target = tiny_model(seed=3)
    draft = make_drafter(target)
    save_block_drafter(draft, tmp_path / "block", dtype=torch.float32)
    again = load_block_drafter(tmp_path / "block", target, "cpu", torch.float32)
    ids = torch.tensor([[1, 2, draft.mask_id]])
    feats = torch.randn(1, 3, draft.bconfig.feature_size)
    torch.testing.assert_close(again(ids, features=feats), draft(ids, features=feats))


@pytest.mark.parametrize("markov", [0, 8])
def test_in_graph_lattice_rows_equal_the_reference_lattice(markov):
    """LatticeHead's packed rows (what the runner's graph computes) unpack to build_lattice's."""
    from tandem.drafting.lattice import unpack_lattice

    target = tiny_model(seed=3)
    d = make_drafter(target, block=5, k=4, markov=markov)
    torch.manual_seed(1)
    logits = torch.randn(1, 7, target.config.vocab_size) * 3
    ids = torch.tensor([[3, 9, 4, d.mask_id, d.mask_id, d.mask_id, d.mask_id]])
    rows = d.lattice_rows(logits, ids)[0]  # [7, 3K + K*K]
    got = unpack_lattice(rows[2:], 4)  # the root (token 4) is row 2
    want = build_lattice(logits[0, 2:], 4, root=4, markov=d.markov if markov else None)
    assert (got.tokens == want.tokens).all()
    np.testing.assert_allclose(got.cond[0, 0], want.cond[0, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.cond[1:], want.cond[1:], rtol=1e-5, atol=1e-5)


def test_training_rows_equal_what_decoding_computes():
    """The training pass (all anchors' blocks at once under one mask) gives each block row the
    logits the drafter computes at decoding time: context rows up to the root, then the mask rows,
    causal."""
    from tandem.train.drafters import block_logits

    target = tiny_model(seed=3)
    target.enable_features((0, 1, 1))
    d = make_drafter(target, block=5)
    torch.manual_seed(0)
    x = torch.randint(0, 90, (2, 20))
    target(x)
    feats = target.last_features  # [2, 20, F]
    anchors = torch.tensor([0, 6, 13])
    train = block_logits(d, x, feats, anchors)  # [2, 20 + 3 * 4, V]
    f_prev = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)
    for k, a in enumerate(anchors.tolist()):
        ids = torch.cat([x[:, :a + 1], torch.full((2, 4), d.mask_id)], dim=1)  # context to the root, masks
        fin = torch.cat([f_prev[:, :a + 1], torch.zeros(2, 4, f_prev.shape[-1])], dim=1)
        pos = torch.arange(a + 5).expand(2, -1)
        dec = d(ids, pos, features=fin)  # causal, no cache
        torch.testing.assert_close(train[:, a], dec[:, a], rtol=1e-4, atol=1e-4)  # the root's row
        torch.testing.assert_close(train[:, 20 + 4 * k:20 + 4 * (k + 1)], dec[:, a + 1:], rtol=1e-4, atol=1e-4)


def test_tiny_recipe_trains_a_block_drafter_that_loads_and_decodes_like_ar(tmp_path):
    import json
    import math
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tandem.runtime.pair import BUNDLED_TARGET, draft_kind, load_pair

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    r = subprocess.run([sys.executable, "-m", "tandem", "train-drafters", "--tiny", "--kind", "block", "--out",
                        str(tmp_path / "d"), "--device", "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = json.loads((tmp_path / "d" / "drafters_metrics.json").read_text())
    assert metrics["block"]["steps"] == 12 and math.isfinite(metrics["block"]["final_loss"])
    assert draft_kind(tmp_path / "d" / "block") == "block"
    pair = load_pair(None, str(tmp_path / "d" / "block"), device="cpu")
    gen = Generator(pair.target, pair.draft, use_graphs=False)
    prompt = pair.tokenizer.encode("def add(a, b):\n    return").ids
    g = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    want = Generator(pair.target, None, use_graphs=False).generate(prompt, "ar", gen=g).token_ids
    for method in ("chain", "tree"):
        assert gen.generate(prompt, method, SpecConfig(k=3, nodes=8), gen=g).token_ids == want


@pytest.mark.parametrize("method", ["tree", "chain"])
def test_sampling_two_tokens_follow_the_target(method):
    """Sampled decoding with the block drafter's (deterministic) lattice trees: the joint law of
    the first two tokens is the target's (total variation within sampling noise)."""
    from tandem.verify.sampling import probs_from_logits

    V, n, prompt = 8, 2000, [3, 7, 1]
    target = tiny_model(seed=0, vocab=V, scale=2.0)
    d = make_drafter(target, block=4, k=4, markov=4, seed=2)
    sampling = SamplingConfig(temperature=1.0)
    with torch.no_grad():
        p1 = probs_from_logits(target(torch.tensor([prompt]))[0, -1], sampling)  # [V]
        joint = torch.stack([p1[a] * probs_from_logits(target(torch.tensor([prompt + [a]]))[0, -1], sampling)
                             for a in range(V)])  # [V, V]
    gen, g = Generator(target, d), GenerationConfig(max_new_tokens=2, ignore_eos=True)
    spec = SpecConfig(nodes=6, k=3)
    c = torch.zeros(V, V)
    for seed in range(n):
        out = gen.generate(prompt, method, spec, sampling=SamplingConfig(1.0, 1.0, seed), gen=g).token_ids
        c[out[0], out[1]] += 1
    tv = 0.5 * float((c / n - joint).abs().sum())
    assert tv < 0.1, (method, tv)
    # drafts are really offered and accepted (the test exercises verification, not the bonus alone)
    greedy = gen.generate(prompt, method, spec, gen=GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert greedy.draft_steps > 0


def test_position_weights_decay_with_the_position_and_keep_the_mean():
    """The block loss's weights by lattice position (DFlash's decay): exp(-(j - 1) / decay) for
    the row j positions after the root, mean 1; decay 0 weighs every position alike."""
    from tandem.train.drafters import position_weights

    assert torch.equal(position_weights(6, 0.0), torch.ones(5))
    w = position_weights(16, 7.0)
    want = torch.exp(-torch.arange(15, dtype=torch.float32) / 7.0)
    assert w.shape == (15,) and torch.allclose(w, want / want.mean()) and abs(w.mean().item() - 1) < 1e-6
    assert all(a > b for a, b in zip(w, w[1:]))


def test_a_decayed_block_loss_weighs_the_early_positions_more():
    """block_loss_fn with a position decay: the mask rows' KL terms weighted by their position in
    their block (the context rows' term unchanged), equal to the uniform loss at decay 0."""
    from tandem.train.drafters import block_loss_fn, position_weights

    target = tiny_model(seed=0, vocab=16)
    target.enable_features()
    d = make_drafter(target, block=4, k=4, markov=0, seed=3)
    x = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = {}
    for decay in (0.0, 1.0):
        torch.manual_seed(5)  # (the same anchors in both)
        losses[decay] = block_loss_fn(d, target, anchors=3, device=torch.device("cpu"), position_decay=decay)(x, x)[0]
    assert torch.isfinite(losses[1.0]) and not torch.isclose(losses[0.0], losses[1.0])
    assert position_weights(4, 1.0)[0] > 1 > position_weights(4, 1.0)[-1]


@NEEDS_TRITON
def test_block_draft_kernels_under_the_triton_interpreter():
    """The draft pass's input rows in one kernel (embedding, feature norm, fc, mask rows) equal the
    reference in fp32 and fp16, the mask rows exactly; the lattice's parent-conditioned log-probs from
    each position's top K equal theirs, with and without the Markov head; the level beams' kernel equals
    its reference with the early stop and without, and the stopped levels give the full levels' tree
    (tests/block_draft_checks.py)."""
    run_checks("block_draft_checks.py", 3)


def test_input_rows_equal_the_drafters_own_embedding():
    """BlockDrafter.input_rows (what the resident loop's draft pass feeds) equals `embed` over the same
    context tokens and features followed by mask rows: the reference the kernel is checked against is
    the model's own input."""
    from tandem.kernels.block_input import block_input_ref

    d = make_drafter(tiny_model(seed=3), seed=3)
    with torch.no_grad():
        P, T = 5, 9
        tok = torch.randint(0, d.bconfig.vocab_size, (P,))
        feat = torch.randn(P, d.bconfig.feature_size)
        ids = torch.cat([tok, torch.full((T - P,), d.mask_id)])
        feats = torch.cat([feat, torch.randn(T - P, d.bconfig.feature_size)])  # (mask rows read none)
        want = d.embed(ids[None], feats[None])[0]
        assert torch.equal(d.input_rows(tok, feat, T), want)
        assert torch.equal(block_input_ref(tok, feat, d.shared["embed"].weight, d.mask_embedding,
                                           d.feature_norm.weight, d.feature_norm.eps, d.fc.weight, T), want)
