"""Qwen3.5 (hybrid: Gated DeltaNet + gated attention) against transformers, the GDN path walk
against per-node snapshots, and greedy ar / chain / tree equality on hybrid targets."""
from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from models_for_tests import tiny_model
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.kernels.gdn import (conv_tree, conv_windows, gdn_chain_chunked, gdn_replay, gdn_snapshots_ref, gdn_tree_walk,
                                gdn_tree_wy, gdn_wy_commit)
from tandem.models.loader import load_model
from tandem.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen35Config
from tandem.runtime.hybrid import HybridTarget, generate_hybrid
from tandem.tree.draft_tree import DraftTree, ancestor_mask

TOL = 1e-4
VOCAB = 96
CONFIGS = {
    # 3 GDN : 1 attention, grouped GDN heads (2 q/k heads for 4 value heads)
    "default": dict(num_hidden_layers=4),
    # attention first and last, biased attention, kernel 3, half-rotary heads
    "mixed": dict(num_hidden_layers=4, layer_types=["full_attention", "linear_attention", "linear_attention",
                                                    "full_attention"],
                  attention_bias=True, linear_conv_kernel_dim=3, linear_num_key_heads=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    # the head tied to the embedding (parity only: a random tied model decodes a repetition)
    "tied": dict(num_hidden_layers=4, tie_word_embeddings=True),
}
DECODING = ["default", "mixed"]


def build_hf(name: str, seed: int = 0, vocab: int = VOCAB):
    from transformers import Qwen3_5ForCausalLM as HF
    from transformers import Qwen3_5TextConfig

    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, max_position_embeddings=256, eos_token_id=vocab - 1)
    cfg = Qwen3_5TextConfig(**{**kw, **CONFIGS[name]})
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(seed)
    model = HF(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "A_log" in n:
                p.copy_(torch.rand(p.shape, generator=g).mul(15).add(0.01).log())  # transformers' init range
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.mul_(2.0)  # peakier logits: greedy argmaxes far from ties
    return model


_cache: dict[str, tuple] = {}


@pytest.fixture
def pair(tmp_path_factory):
    """name -> (checkpoint dir, HF model, our fp32 model), built once per session."""

    def get(name: str):
        if name not in _cache:
            d = tmp_path_factory.mktemp(f"qwen3_5-{name}")
            hf = build_hf(name)
            hf.save_pretrained(d)
            _cache[name] = (d, hf, load_model(d))
        return _cache[name]

    return get


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ---- parity with transformers ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_forward_matches_transformers(pair, name):
    _, hf, ours = pair(name)
    assert isinstance(ours, Qwen3_5ForCausalLM) and ours.config.layer_types == tuple(hf.config.layer_types)
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert _diff(ours(ids), ref) < TOL


@pytest.mark.parametrize("name", DECODING)
def test_decode_with_state_matches_transformers(pair, name):
    """Prefill 20 tokens, then decode one token at a time and then a 3-token chunk, through the
    KV cache and the committed recurrent state; every row's logits equal the full forward's."""
    _, hf, ours = pair(name)
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _hf_logits(hf, ids)
    target = HybridTarget(ours, capacity=64)
    target.prefill(ids[:20])
    assert target.cache.prefix_len == 20
    rows = []
    for t in ids[20:27]:
        logits, rec = target.logits(DraftTree.chain([t]))
        target.commit(rec, [0])
        rows.append(logits)
    logits, rec = target.logits(DraftTree.chain(ids[27:30]))
    target.commit(rec, [0, 1, 2])
    rows.append(logits)
    assert _diff(torch.cat(rows), ref[20:]) < TOL
    assert target.cache.prefix_len == 30


@pytest.mark.parametrize("name", DECODING)
def test_tree_pass_matches_each_root_path(pair, name):
    """Every node of a random tree gets the logits transformers gives its root path, and
    committing one branch leaves the state transformers' decoding of that branch would."""
    _, hf, ours = pair(name)
    rng = random.Random(3)
    prefix = [rng.randrange(VOCAB) for _ in range(12)]
    parents = [-1] + [rng.randrange(i) for i in range(1, 14)]
    tokens = [rng.randrange(VOCAB) for _ in parents]
    target = HybridTarget(ours, capacity=64)
    target.prefill(prefix)
    logits, rec = target.logits(DraftTree(tokens, parents, [0.0] * len(tokens)))
    path_of = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        path_of.append(path[::-1])
        ref = _hf_logits(hf, prefix + [tokens[j] for j in path_of[i]])[-1]
        assert _diff(logits[i], ref) < TOL, i
    deepest = max(range(len(tokens)), key=lambda i: len(path_of[i]))
    target.commit(rec, path_of[deepest])
    nxt = rng.randrange(VOCAB)
    after, _ = target.logits(DraftTree.chain([nxt]))
    ref = _hf_logits(hf, prefix + [tokens[j] for j in path_of[deepest]] + [nxt])[-1]
    assert _diff(after[0], ref) < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load(pair, dtype):
    d, _, ours32 = pair("default")
    ours = load_model(d, dtype=dtype)
    assert ours.dtype == dtype and ours.new_state().conv[0].dtype == dtype
    assert ours.new_state().delta[0].dtype == torch.float32  # the delta state stays fp32
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
    out, ref = ours(ids), ours32(ids)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _diff(out, ref) < 0.1 * ref.abs().max().item()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_multimodal_checkpoint_layout_loads_the_text_model(pair, tmp_path):
    """Published Qwen3.5 checkpoints are `Qwen3_5ForConditionalGeneration`: the text model under
    `model.language_model.`, a vision tower and an MTP head beside it, the config nested."""
    d, _, ours = pair("tied")  # the tie flag sits at the top level of the wrapper's config
    hf_cfg = json.loads((d / "config.json").read_text())
    wrapped = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "tie_word_embeddings": hf_cfg.pop("tie_word_embeddings"), "text_config": hf_cfg}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(d / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_model(tmp_path)
    ids = torch.arange(20)[None]
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded(ids), ours(ids))


def test_bad_layer_types_is_a_config_error():
    with pytest.raises(ConfigError, match="layer_types must list 2"):
        Qwen35Config.from_hf(dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                                  num_attention_heads=2, layer_types=["linear_attention", "sliding_attention"]))


# ---- the GDN path walk ------------------------------------------------------------------------
def test_conv_windows_hand_built():
    # tree 0 -> {1, 2}, 1 -> 3; K = 4: ext columns 0..2 are the committed conv state, node i is 3 + i
    w = conv_windows([-1, 0, 0, 1], 4)
    assert w.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5], [2, 3, 4, 6]]


def _gdn_inputs(n: int, seed: int, B: int = 1, H: int = 3, dk: int = 4, dv: int = 5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, H, dk, generator=g)
    k = F.normalize(torch.randn(B, n, H, dk, generator=g), dim=-1)
    v = torch.randn(B, n, H, dv, generator=g)
    decay = -torch.rand(B, n, H, generator=g)
    beta = torch.rand(B, n, H, generator=g)
    S0 = torch.randn(B, H, dk, dv, generator=g)
    return S0, q, k, v, decay, beta


@st.composite
def trees(draw):
    n = draw(st.integers(1, 24))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@settings(max_examples=40, deadline=None)
@given(parents=trees(), seed=st.integers(0, 2**16))
def test_path_walk_equals_per_node_snapshots(parents, seed):
    """The walk (no state per node) gives bitwise the outputs of keeping every node's state, and
    replaying any root path gives bitwise that node's snapshot."""
    S0, q, k, v, decay, beta = _gdn_inputs(len(parents), seed)
    S0_before = S0.clone()
    out = gdn_tree_walk(S0, q, k, v, decay, beta, parents)
    ref, snaps = gdn_snapshots_ref(S0, q, k, v, decay, beta, parents)
    assert torch.equal(out, ref)
    assert torch.equal(S0, S0_before)  # the committed state is read only
    node = random.Random(seed).randrange(len(parents))
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    assert torch.equal(gdn_replay(S0, k, v, decay, beta, path[::-1]), snaps[path[0]])


@settings(max_examples=25, deadline=None)
@given(parents=trees(), seed=st.integers(0, 2**16), kernel=st.integers(2, 5))
def test_conv_over_tree_equals_conv_of_each_path(parents, seed, kernel):
    """Each node's conv output equals F.conv1d over [committed conv state | its root path]."""
    g = torch.Generator().manual_seed(seed)
    C, n = 6, len(parents)
    state, x = torch.randn(1, kernel - 1, C, generator=g), torch.randn(1, n, C, generator=g)
    weight = torch.randn(C, kernel, generator=g)
    out = conv_tree(torch.cat([state, x], 1), weight, conv_windows(parents, kernel))  # [1, n, C]
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        seq = torch.cat([state[0], x[0, path[::-1]]]).t()[None]  # [1, C, K - 1 + len(path)]
        ref = F.silu(F.conv1d(seq, weight[:, None], groups=C))[0, :, -1]
        assert torch.allclose(out[0, i], ref, atol=1e-5), i


def test_chain_walk_equals_step_by_step():
    """A chain pass equals feeding the tokens one at a time with a commit after each: bitwise."""
    S0, q, k, v, decay, beta = _gdn_inputs(9, 7, B=2)
    chain = gdn_tree_walk(S0, q, k, v, decay, beta, list(range(-1, 8)))
    S, rows = S0, []
    for i in range(9):
        sl = slice(i, i + 1)
        rows.append(gdn_tree_walk(S, q[:, sl], k[:, sl], v[:, sl], decay[:, sl], beta[:, sl], [-1]))
        S = gdn_replay(S, k[:, sl], v[:, sl], decay[:, sl], beta[:, sl], [0])
    assert torch.equal(chain, torch.cat(rows, 1))
    assert torch.equal(S, gdn_replay(S0, k, v, decay, beta, list(range(9))))


@st.composite
def forests(draw):
    """Topologically ordered parents in which any node may hang from the committed state (-1)."""
    n = draw(st.integers(1, 40))
    return [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_ancestor_mask_of_a_forest():
    # 0 -> 1, and 2 a second root with child 3: no row sees the other tree
    assert ancestor_mask([-1, 0, -1, 2]).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


@settings(max_examples=40, deadline=None)
@given(parents=forests(), seed=st.integers(0, 2**16))
def test_wy_equals_the_walk_on_random_forests(parents, seed):
    """The WY form (one triangular solve for every root path) gives the walk's outputs, and its
    commit the walked state after any root path, to fp32 rounding; strong decays included."""
    S0, q, k, v, decay, beta = _gdn_inputs(len(parents), seed, B=2)
    decay = decay * 4  # per-token decays down to exp(-4): path products far below 1
    ref, snaps = gdn_snapshots_ref(S0, q, k, v, decay, beta, parents)
    o, U, G = gdn_tree_wy(S0, q, k, v, decay, beta, ancestor_mask(parents))
    assert torch.allclose(o, ref, atol=2e-5, rtol=1e-5), (o - ref).abs().max()
    node = random.Random(seed).randrange(len(parents))
    S = gdn_wy_commit(S0, k, U, G, _path(parents, node))
    assert torch.allclose(S, snaps[node], atol=2e-5, rtol=1e-5), (S - snaps[node]).abs().max()


@pytest.mark.parametrize("n,chunk", [(1, 64), (64, 64), (150, 64), (37, 8)])
def test_chunked_chain_equals_the_walk(n, chunk):
    """A prefill in WY chunks, the state carried between chunks, equals the walk's outputs and the
    state after every row (a chunk boundary inside the chain and a ragged last chunk)."""
    S0, q, k, v, decay, beta = _gdn_inputs(n, 11, B=2)
    chain = list(range(-1, n - 1))
    ref = gdn_tree_walk(S0, q, k, v, decay, beta, chain)
    o, S = gdn_chain_chunked(S0, q, k, v, decay, beta, chunk=chunk)
    assert torch.allclose(o, ref, atol=5e-5, rtol=1e-5), (o - ref).abs().max()
    walked = gdn_replay(S0, k, v, decay, beta, list(range(n)))
    assert torch.allclose(S, walked, atol=5e-5, rtol=1e-5), (S - walked).abs().max()


def test_long_prefill_matches_transformers(pair):
    """A 150-token prompt (three WY chunks) prefilled through the cache, then decoded a token at a
    time: every row within TOL of transformers' full forward."""
    _, hf, ours = pair("mixed")
    ids = torch.randint(0, VOCAB, (156,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = _hf_logits(hf, ids)
    target = HybridTarget(ours, capacity=200)
    target.prefill(ids[:150])
    rows = []
    for t in ids[150:]:
        logits, rec = target.logits(DraftTree.chain([t]))
        target.commit(rec, [0])
        rows.append(logits)
    assert _diff(torch.cat(rows), ref[150:]) < TOL


@pytest.mark.parametrize("name", DECODING)
def test_wy_tree_kernel_in_the_model(pair, name):
    """TANDEM_GDN_TREE=wy: a tree pass's logits and its committed state within TOL of the walk's;
    greedy tree decoding then still equals ar on this pair (built far from ties)."""
    _, _, ours = pair(name)
    rng = random.Random(8)
    prefix = [rng.randrange(VOCAB) for _ in range(10)]
    parents = [-1] + [rng.randrange(i) for i in range(1, 16)]
    tree = DraftTree([rng.randrange(VOCAB) for _ in parents], parents, [0.0] * len(parents))
    out = {}
    for kernel in ("walk", "wy"):
        ours.gdn_tree = kernel
        target = HybridTarget(ours, capacity=64)
        target.prefill(prefix)
        logits, rec = target.logits(tree)
        assert rec.kernel == kernel
        target.commit(rec, _path(parents, len(parents) - 1))
        out[kernel] = (logits, target.state.delta)
    ours.gdn_tree = "walk"
    assert _diff(out["wy"][0], out["walk"][0]) < TOL
    assert max(_diff(a, b) for a, b in zip(out["wy"][1], out["walk"][1])) < TOL
    prompt, gen = [5, 9, 1, 77, 30], GenerationConfig(max_new_tokens=32, ignore_eos=True)
    ar = generate_hybrid(ours, prompt, "ar", gen=gen)
    ours.gdn_tree = "wy"
    try:
        res = generate_hybrid(ours, prompt, "tree", spec=SpecConfig(nodes=12), gen=gen,
                              drafter=OracleTreeDrafter(ar.token_ids, nodes=12, seed=1))
    finally:
        ours.gdn_tree = "walk"
    assert res.token_ids == ar.token_ids


def test_unknown_gdn_tree_kernel_is_a_config_error(pair):
    _, _, ours = pair("default")
    ours.gdn_tree = "fast"
    try:
        with pytest.raises(ConfigError, match="unknown GDN tree kernel 'fast'.*walk, wy"):
            HybridTarget(ours, capacity=16).logits(DraftTree.chain([1, 2]))
    finally:
        ours.gdn_tree = "walk"


# ---- greedy decoding: ar, chain, tree ---------------------------------------------------------
class OracleTreeDrafter:
    """Random trees (random shapes, random tokens) with a spine that follows the target's own
    greedy continuation for a random length: the walk must find it and accept it."""

    def __init__(self, reference: list[int], nodes: int, seed: int):
        self.ref, self.nodes, self.rng = reference, nodes, random.Random(seed)
        self.steps, self.done = 0, 0

    def start(self, prompt: list[int]) -> None:
        self.root = prompt[-1]

    def propose(self) -> DraftTree:
        rng, spine_len = self.rng, self.rng.randrange(0, 7)
        tokens, parents, spine = [self.root], [-1], [0]
        while len(tokens) <= self.nodes:
            if len(spine) <= spine_len and rng.random() < 0.5:
                depth = len(spine)  # the spine's next node: the target's token `depth` steps ahead
                j = self.done + depth - 1
                tokens.append(self.ref[j] if j < len(self.ref) else rng.randrange(VOCAB))
                parents.append(spine[-1])
                spine.append(len(tokens) - 1)
            else:
                tokens.append(rng.randrange(VOCAB))
                parents.append(rng.randrange(len(tokens) - 1))
        return DraftTree(tokens, parents, [0.0] * len(tokens))

    def observe(self, result, tree) -> None:
        self.done += len(result.tokens)
        self.root = result.bonus


@pytest.mark.parametrize("name", DECODING)
def test_ar_matches_transformers_generate(pair, name):
    _, hf, ours = pair(name)
    prompt = [3, 17, 42, 8, 11, 60, 2]
    ar = generate_hybrid(ours, prompt, "ar", gen=GenerationConfig(max_new_tokens=40, ignore_eos=True))
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ar.token_ids == ref[0, len(prompt):].tolist()
    assert len(set(ar.token_ids)) > 5  # not a degenerate repetition


@pytest.mark.parametrize("name", DECODING)
def test_random_trees_with_the_target_path_equal_ar(pair, name):
    _, _, ours = pair(name)
    prompt = [5, 9, 1, 77, 30]
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    ar = generate_hybrid(ours, prompt, "ar", gen=gen)
    for seed in range(3):
        drafter = OracleTreeDrafter(ar.token_ids, nodes=12, seed=seed)
        res = generate_hybrid(ours, prompt, "tree", spec=SpecConfig(nodes=12), gen=gen, drafter=drafter)
        assert res.token_ids == ar.token_ids, seed
        assert max(res.accept_lengths) >= 4 and res.target_passes < 0.6 * ar.target_passes


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_small_draft_model_equals_ar(pair, method):
    """The usual drafters over an attention-only draft model (same vocabulary) with a hybrid target."""
    _, _, ours = pair("default")
    draft = tiny_model(vocab=VOCAB, seed=5)
    prompt = [7, 7, 21, 64, 3, 90]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    ar = generate_hybrid(ours, prompt, "ar", gen=gen)
    res = generate_hybrid(ours, prompt, method, draft_model=draft, spec=SpecConfig(nodes=8, width=2, k=3), gen=gen)
    assert res.token_ids == ar.token_ids
    assert res.draft_steps > 0 and res.target_passes <= ar.target_passes


def test_async_with_a_hybrid_target_equals_ar(pair):
    """SwiftSpec's async loop (the inline transport) over a hybrid target: the draft worker grows
    its evolving tree, the hybrid target verifies by path recomputation and commits; greedy output
    equals ar, through generate_async and through Generator."""
    from tandem.runtime.async_decode import generate_async
    from tandem.runtime.generate import Generator

    _, _, ours = pair("default")
    draft = tiny_model(vocab=VOCAB, seed=5)
    prompt = [7, 7, 21, 64, 3, 90]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    ar = generate_hybrid(ours, prompt, "ar", gen=gen)
    res = generate_async(ours, draft, prompt, SpecConfig(nodes=8, width=2), SamplingConfig(), gen, set(),
                         transport="inline", verbose=False)
    assert res.token_ids == ar.token_ids and res.target_passes <= ar.target_passes
    out = Generator(ours, draft).generate(prompt, "async", SpecConfig(nodes=8, width=2), gen=gen)
    assert out.token_ids == ar.token_ids
    with pytest.raises(ConfigError, match="runs the inline transport, not 'gloo'"):
        generate_async(ours, draft, prompt, SpecConfig(nodes=8, width=2), SamplingConfig(), gen, set(),
                       transport="gloo", verbose=False)


def test_eos_and_bad_method(pair):
    _, _, ours = pair("default")
    prompt = [4, 8, 15, 16, 23, 42]
    ar = generate_hybrid(ours, prompt, "ar", gen=GenerationConfig(max_new_tokens=20, ignore_eos=True))
    eos = ar.token_ids[5]
    cfg = ours.config
    ours.config = dataclasses.replace(cfg, eos_token_ids=(eos,))
    try:
        res = generate_hybrid(ours, prompt, "ar", gen=GenerationConfig(max_new_tokens=20))
    finally:
        ours.config = cfg
    assert res.finish_reason == "eos" and res.token_ids == ar.token_ids[: ar.token_ids.index(eos) + 1]
    with pytest.raises(ConfigError, match="method 'async' is not available for hybrid targets"):
        generate_hybrid(ours, prompt, "async")  # (async runs through generate_async / Generator)
    with pytest.raises(ConfigError, match="needs a draft model"):
        generate_hybrid(ours, prompt, "tree")


def test_generator_dispatches_a_hybrid_target(pair):
    """`Generator` (what `tandem generate` and bench drive) runs a hybrid target through the hybrid
    loop: tree and auto equal ar (auto's trial measured ar, chain and tree on the hybrid target),
    sampling runs (seeded), and a method the hybrid loop lacks is a one-line error."""
    from tandem.config import SamplingConfig
    from tandem.runtime.generate import Generator

    _, _, ours = pair("default")
    eng = Generator(ours, tiny_model(vocab=VOCAB, seed=5))
    prompt = [7, 7, 21, 64, 3, 90]
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    want = Generator(ours).generate(prompt, "ar", gen=gen).token_ids
    assert eng.generate(prompt, "tree", SpecConfig(nodes=8, width=2), gen=gen).token_ids == want
    assert eng.generate(prompt, "auto", SpecConfig(nodes=8, width=2), gen=gen).token_ids == want
    assert sorted(eng.auto.choice.rates) == ["ar", "chain", "tree"] and min(eng.auto.choice.rates.values()) > 0
    alone = Generator(ours)
    assert alone.generate(prompt, "auto", gen=gen).token_ids == want and alone.auto.choice.method == "ar"
    with pytest.raises(ConfigError, match="hybrid targets \\(Qwen3.5\\) run auto, ar, chain, tree and async, not 'tlv'"):
        eng.generate(prompt, "tlv", SpecConfig(nodes=8, width=2), gen=gen)
    a = eng.generate(prompt, "tree", sampling=SamplingConfig(temperature=0.7, seed=3), gen=gen)
    b = eng.generate(prompt, "tree", sampling=SamplingConfig(temperature=0.7, seed=3), gen=gen)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20  # sampled, and the seed reproduces it


@pytest.mark.parametrize("method,drafter", [("ar", None), ("tree", "model"), ("tree", "hybrid")])
def test_sampling_with_a_hybrid_target_follows_the_target(pair, method, drafter):
    """Recursive rejection sampling over a hybrid target's tree pass (GDN paths recomputed): the
    first two sampled tokens follow the target's own distributions (total variation over 500
    seeds), whatever the draft proposes: an attention-only draft or a Qwen3.5 one."""
    from tandem.config import SamplingConfig
    from tandem.verify.sampling import probs_from_logits

    _, _, ours = pair("default")
    draft = pair("mixed")[2] if drafter == "hybrid" else tiny_model(vocab=VOCAB, seed=5)
    prompt, n = [7, 7, 21, 64, 3, 90], 500
    sampling = SamplingConfig(temperature=1.0)
    with torch.no_grad():
        p1 = probs_from_logits(ours(torch.tensor([prompt]))[0, -1], sampling)  # [V]
    counts = torch.zeros(VOCAB)
    pairs: dict[int, torch.Tensor] = {}
    gen = GenerationConfig(max_new_tokens=2, ignore_eos=True)
    for seed in range(n):
        out = generate_hybrid(ours, prompt, method, draft_model=draft if method != "ar" else None,
                              spec=SpecConfig(nodes=6, width=2), gen=gen, sampling=SamplingConfig(1.0, 1.0, seed))
        counts[out.token_ids[0]] += 1
        pairs.setdefault(out.token_ids[0], torch.zeros(VOCAB))[out.token_ids[1]] += 1
    def noise(p: torch.Tensor, m: float) -> float:  # E[TV] of m exact draws from p (normal approximation)
        return 0.5 * float((2 / (math.pi * m) * p * (1 - p)).sqrt().sum())

    tv = 0.5 * float((counts / n - p1).abs().sum())
    assert tv < 1.3 * noise(p1, n) + 0.02, (method, tv, noise(p1, n))
    # the second token, given the most frequent first one, follows the target after it
    first = int(counts.argmax())
    with torch.no_grad():
        p2 = probs_from_logits(ours(torch.tensor([prompt + [first]]))[0, -1], sampling)
    c2 = pairs[first]
    tv2 = 0.5 * float((c2 / c2.sum() - p2).abs().sum())
    assert tv2 < 1.3 * noise(p2, float(c2.sum())) + 0.03, (method, tv2, int(c2.sum()))


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_feature_drafters_over_a_hybrid_target_equal_ar(pair, kind, tmp_path):
    """An EAGLE-3 head and a block drafter read a hybrid target's features (the residual stream
    entering three of its layers, kept on every tree pass): chain and tree equal ar, and the
    drafters' proposals were looked at (draft steps counted)."""
    _, _, ours = pair("default")
    if kind == "eagle3":
        from test_eagle3 import write_head
        from tandem.models.eagle3 import load_eagle3

        write_head(tmp_path / "head", ours)
        draft = load_eagle3(tmp_path / "head", ours, "cpu", torch.float32)
    else:
        from test_block_drafter import make_drafter

        draft = make_drafter(ours)
    prompt = [7, 7, 21, 64, 3, 90]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    try:
        ar = generate_hybrid(ours, prompt, "ar", gen=gen)
        for method in ("chain", "tree"):
            res = generate_hybrid(ours, prompt, method, draft_model=draft, spec=SpecConfig(nodes=8, width=2, k=3),
                                  gen=gen)
            assert res.token_ids == ar.token_ids, (kind, method)
            assert res.draft_steps > 0
        assert ours.last_features.shape[-1] == 3 * ours.config.hidden_size
    finally:
        ours.feature_layers, ours.last_features = None, None  # the shared model: back to no features


def test_acceptance_replay_with_a_hybrid_target(pair):
    """forced_accepts (the bench's simulated acceptance) reaches the hybrid loop through Generator:
    each pass accepts the recorded count along the draft's most probable path (the trees here are
    deep enough for every count), so the accept lengths are the recorded ones in order, cycled."""
    from tandem.runtime.generate import Generator

    _, _, ours = pair("default")
    draft = tiny_model(vocab=VOCAB, seed=5)
    forced = [3, 0, 2, 1]
    res = Generator(ours, draft).generate([7, 7, 21, 64, 3, 90], "chain", SpecConfig(k=4),
                                          gen=GenerationConfig(max_new_tokens=40, ignore_eos=True),
                                          forced_accepts=forced)
    n = len(res.accept_lengths)
    assert n >= 8 and res.accept_lengths[:-1] == (forced * n)[:n - 1]  # (the last pass may be cut by max_tokens)


# ---- a hybrid draft ---------------------------------------------------------------------------
def test_hybrid_draft_runner_rows_equal_a_forward_of_their_paths(pair):
    """The hybrid draft runner (GDN inputs kept per tree row, no state per node) through steps,
    commits with a kept subtree and commits without: every fed row's logits equal the full
    forward of prefix + its root path, and the committed state continues the sequence."""
    from tandem.runtime.async_workers import time_step
    from tandem.runtime.hybrid_runner import HybridDraftRunner

    _, _, ours = pair("mixed")
    runner = HybridDraftRunner(ours, capacity=64)
    prefix = [3, 17, 42, 8, 11, 60, 2]

    def want(seq):
        return ours(torch.tensor([seq]))[0, -1]

    assert _diff(runner.prefill(prefix), want(prefix)) < TOL
    P = len(prefix)
    # rows 0 (a), 1 (b) under the root; then 2 (c, under a), 3 (d, under b), 4 (e, under c) in one step
    out = runner.step([10, 20], [P, P], torch.eye(2, dtype=torch.bool))
    assert _diff(out[0], want(prefix + [10])) < TOL and _diff(out[1], want(prefix + [20])) < TOL
    time_step(runner, 2, repeats=1)  # async's profile: steps of its own, then tree_len lowered back
    assert runner.cache.tree_len == 2
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, [0, 2]] = mask[1, [1, 3]] = mask[2, [0, 2, 4]] = True
    out = runner.step([30, 40, 50], [P + 1, P + 1, P + 2], mask)
    for row, seq in zip(out, ([10, 30], [20, 40], [10, 30, 50])):
        assert _diff(row, want(prefix + seq)) < TOL, seq
    # the target accepts a: a joins the prefix, its subtree (c, e) stays with its K/V and GDN inputs
    runner.cache.commit([0], keep=[2, 4])
    assert runner.cache.prefix_len == P + 1 and runner.cache.tree_len == 2 and runner.cache.parents == [-1, 0]
    out = runner.step([60], [P + 3], torch.tensor([[True, True, True]]))  # f under e
    assert _diff(out[0], want(prefix + [10, 30, 50, 60])) < TOL
    # accept c, e, f: nothing kept; the next row hangs from f
    runner.cache.commit([0, 1, 2])
    assert runner.cache.prefix_len == P + 4 and runner.cache.tree_len == 0
    out = runner.step([70], [P + 4], torch.tensor([[True]]))
    assert _diff(out[0], want(prefix + [10, 30, 50, 60, 70])) < TOL
    with pytest.raises(ValueError, match="truncates to 0 or its prefix"):
        runner.cache.truncate(3)


@pytest.mark.parametrize("method", ["chain", "tree", "async"])
def test_hybrid_draft_equals_ar(pair, method):
    """A Qwen3.5 draft for a Qwen3.5 target through the evolving tree: greedy output equals ar; with
    the target itself as the draft every chain step accepts all k tokens (the draft's state across
    re-roots is the target's), and trees (serial and async) accept several."""
    from tandem.runtime.generate import Generator

    _, _, ours = pair("default")
    _, _, other = pair("mixed")
    prompt, gen = [5, 9, 1, 77, 30], GenerationConfig(max_new_tokens=40, ignore_eos=True)
    ar = generate_hybrid(ours, prompt, "ar", gen=gen)
    spec = SpecConfig(nodes=12, width=2, k=4)
    for draft in (other, ours):
        res = Generator(ours, draft).generate(prompt, method, spec, gen=gen)
        assert res.token_ids == ar.token_ids
    if method == "chain":
        assert res.accept_lengths[:-1] == [4] * (len(res.accept_lengths) - 1)
    elif method == "async":  # (SwiftSpec's loop, inline transport: the draft worker's evolving tree)
        assert res.target_passes <= ar.target_passes / 3
    else:
        assert min(res.accept_lengths[:-1]) >= 2 and res.target_passes <= ar.target_passes / 3


def test_hybrid_draft_errors(pair):
    from tandem.runtime.generate import Generator

    _, _, ours = pair("default")
    gen = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ConfigError, match="drafts for Qwen3.5 targets only"):
        Generator(tiny_model(vocab=VOCAB), ours).generate([1, 2, 3], "tree", SpecConfig(nodes=4), gen=gen)


def test_load_pair_takes_a_hybrid_draft(pair, tmp_path):
    """`load_pair` (what the CLI, bench and server load through) accepts a Qwen3.5 draft folder (it
    read an attention-only config from it before), and the pair decodes as ar does."""
    import shutil

    from tandem.runtime.generate import Generator
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    dirs = []
    for name in ("default", "mixed"):
        d = tmp_path / name
        shutil.copytree(pair(name)[0], d)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(BUNDLED_TARGET / f, d / f)
        dirs.append(d)
    p = load_pair(dirs[0], dirs[1])
    assert isinstance(p.draft, Qwen3_5ForCausalLM) and isinstance(p.target, Qwen3_5ForCausalLM)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    eng = Generator(p.target, p.draft)
    assert eng.generate([4, 8, 15, 16], "tree", SpecConfig(nodes=8), gen=gen).token_ids == \
        eng.generate([4, 8, 15, 16], "ar", gen=gen).token_ids


# ---- captured tree passes (runtime.hybrid_graphs), emulated on the CPU ------------------------
def _random_tree(rng: random.Random, n: int, root: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree([root] + [rng.randrange(VOCAB) for _ in range(n - 1)], parents, [0.0] * n)


def test_captured_tree_passes_equal_eager_ones(pair, monkeypatch):
    """A pass padded to its bucket (padding roots at the scratch row, static-width attention,
    the tree as static tensors) gives the eager pass's logits; committing the same paths leaves
    the same state and cache; the state's tensors stay the ones a graph would read."""
    _, _, ours = pair("default")
    monkeypatch.setattr(ours, "gdn_tree", "wy")
    prompt = [5, 9, 2, 77, 31, 8, 40]
    eager, graphed = HybridTarget(ours, 96, graphs=False), HybridTarget(ours, 96, graphs="emulate")
    held = [t.data_ptr() for t in graphed.state.conv + graphed.state.delta]
    for t in (eager, graphed):
        t.prefill(prompt[:-1])
    rng, root = random.Random(3), prompt[-1]
    for n in (1, 5, 3, 16, 9, 1, 30):
        tree = _random_tree(rng, n, root)
        (la, ra), (lb, rb) = eager.logits(tree), graphed.logits(tree)
        # (the padded pass solves WY's triangular system at the bucket's size, so its fp32
        # rounding differs from the eager pass's: 2e-5 on logits of ~3 on some CPUs; a wrong
        # mask or state is off by far more than 1e-4)
        assert lb.shape == la.shape and _diff(la, lb) < 1e-4, n
        path = [0]
        while any(p == path[-1] for p in tree.parents):  # the first child, down to a leaf
            path.append(tree.parents.index(path[-1]))
        eager.commit(ra, path)
        graphed.commit(rb, path)
        assert eager.cache.prefix_len == graphed.cache.prefix_len and graphed.cache.tree_len == 0
        for a, b in zip(eager.state.conv + eager.state.delta, graphed.state.conv + graphed.state.delta):
            assert _diff(a, b) < 1e-4
        root = tree.tokens[path[-1]]
    assert graphed.graphs.replays == 7 and sorted(graphed.graphs.buckets) == [1, 4, 8, 16, 32]
    assert [t.data_ptr() for t in graphed.state.conv + graphed.state.delta] == held


def test_greedy_decoding_with_captured_passes_equals_ar(pair, monkeypatch):
    """generate_hybrid with every tree pass replayed (emulated): ar, chain and tree over a small
    draft model and the oracle trees give the eager ar output."""
    from tandem.runtime import hybrid_graphs

    _, _, ours = pair("default")
    prompt = [7, 7, 21, 64, 3, 90]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    ref = generate_hybrid(ours, prompt, "ar", gen=gen).token_ids
    monkeypatch.setattr(ours, "gdn_tree", "wy")
    monkeypatch.setattr(hybrid_graphs, "graphs_apply", lambda model: "emulate")
    runs = []
    real_run = hybrid_graphs.HybridGraphs.run
    monkeypatch.setattr(hybrid_graphs.HybridGraphs, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    draft = tiny_model(vocab=VOCAB, seed=5)
    assert generate_hybrid(ours, prompt, "ar", gen=gen).token_ids == ref
    for method in ("chain", "tree"):
        res = generate_hybrid(ours, prompt, method, draft_model=draft, spec=SpecConfig(nodes=8, width=2, k=3), gen=gen)
        assert res.token_ids == ref, method
    res = generate_hybrid(ours, prompt, "tree", spec=SpecConfig(nodes=12), gen=gen,
                          drafter=OracleTreeDrafter(ref, nodes=12, seed=1))
    assert res.token_ids == ref and max(res.accept_lengths) >= 4
    assert len(runs) > 60


def test_w12_conversion_refuses_a_hybrid_checkpoint_in_one_line(pair, tmp_path):
    from tandem.quant.checkpoint import write_w12_checkpoint

    d = pair("default")[0]
    with pytest.raises(ConfigError, match="is a Qwen3.5 \\(hybrid\\) checkpoint; W12 conversion covers"):
        write_w12_checkpoint(d, tmp_path / "w12")
    assert not (tmp_path / "w12").exists()
