"""Logit parity of our Transformer against Hugging Face transformers, per supported family.

Reference: the same checkpoint directory loaded with `AutoModelForCausalLM.from_pretrained`.
Covers a full forward, incremental decoding through `KVCache`, sibling tokens under a tree
mask (plus committing one of them), and a bfloat16 load.
"""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_FAMILIES
from tandem.kv.cache import KVCache
from tandem.models.layers import rope_inv_freq
from tandem.models.loader import load_model

FAMILIES = list(TINY_FAMILIES)
EXPECTED_FAMILY = {"llama": "llama", "llama_untied": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
SEQ, PREFILL, TOL = 40, 30, 1e-4

_refs: dict[str, tuple] = {}


@pytest.fixture
def setup(shared_tiny_checkpoint):
    """family -> (checkpoint dir, our fp32 model, HF model, ids [2, SEQ], HF logits [2, SEQ, V]); cached."""

    def get(family: str):
        if family not in _refs:
            from transformers import AutoModelForCausalLM

            path = shared_tiny_checkpoint(family)
            ours = load_model(path, dtype="float32")
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            g = torch.Generator().manual_seed(1234)
            ids = torch.randint(0, ours.config.vocab_size, (2, SEQ), generator=g)
            with torch.no_grad():
                ref = hf(ids).logits.float()
            _refs[family] = (path, ours, hf, ids, ref)
        return _refs[family]

    return get


def _slots(cache: KVCache, n: int) -> torch.Tensor:
    """Cache slots [1, n] for n new rows, reserved in the tree region as ModelRunner.step does
    (rows become verified prefix rows by `commit`, as ModelRunner.prefill does)."""
    start = cache.reserve_rows(n)
    return torch.arange(start, start + n)[None]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_matches_transformers(setup, family):
    path, ours, hf, ids, ref = setup(family)
    assert ours.config.family == EXPECTED_FAMILY[family]
    assert ours.dtype == torch.float32
    # the reference must be non-trivial, or a parity check proves nothing
    assert ref.std() > 0.5
    with torch.no_grad():
        out = ours(ids)
    assert out.shape == (2, SEQ, ours.config.vocab_size)
    assert _max_diff(out, ref) < TOL


def test_family_features_are_exercised(setup):
    """The configs really exercise what the families differ in."""
    _, llama, llama_hf, _, _ = setup("llama")
    c = llama.config
    assert c.tie_word_embeddings and c.num_key_value_heads < c.num_attention_heads
    assert llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()
    # llama3 rope scaling changes the frequencies, and ours equal transformers'
    assert c.rope_scaling is not None and dict(c.rope_scaling)["rope_type"] == "llama3"
    unscaled = rope_inv_freq(type(c)(**{**c.__dict__, "rope_scaling": None}))
    assert (llama.inv_freq - unscaled).abs().max() > 1e-3
    assert torch.allclose(llama.inv_freq, llama_hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)

    _, untied, _, _, _ = setup("llama_untied")
    assert not untied.config.tie_word_embeddings
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)

    _, qwen2, qwen2_hf, _, _ = setup("qwen2")
    assert qwen2.config.attention_bias and qwen2.model.layers[0].self_attn.q_proj.bias is not None
    assert torch.equal(qwen2.model.layers[1].self_attn.k_proj.bias, qwen2_hf.model.layers[1].self_attn.k_proj.bias)
    assert qwen2.model.layers[0].self_attn.k_proj.bias.abs().max() > 0.1  # random, not the zero init

    _, qwen3, qwen3_hf, _, _ = setup("qwen3")
    c3 = qwen3.config
    assert c3.qk_norm and c3.head_dim != c3.hidden_size // c3.num_attention_heads
    assert torch.equal(qwen3.model.layers[0].self_attn.q_norm.weight, qwen3_hf.model.layers[0].self_attn.q_norm.weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_matches_full_forward(setup, family):
    _, ours, _, ids, ref = setup(family)
    with torch.no_grad():
        full = ours(ids)
    for b in range(ids.shape[0]):
        cache = KVCache.for_model(ours, capacity=64)
        row = ids[b : b + 1]
        slots = _slots(cache, PREFILL)
        mask = torch.ones(PREFILL, PREFILL, dtype=torch.bool).tril()[None, None]
        with torch.no_grad():
            pre = ours(row[:, :PREFILL], torch.arange(PREFILL)[None], cache, slots, mask)
        cache.commit(list(range(PREFILL)))
        steps = [pre]
        for t in range(PREFILL, SEQ):
            slots = _slots(cache, 1)
            mask = torch.ones(1, 1, 1, cache.length, dtype=torch.bool)
            with torch.no_grad():
                steps.append(ours(row[:, t : t + 1], torch.tensor([[t]]), cache, slots, mask))
            cache.commit([0])
        inc = torch.cat(steps, dim=1)
        assert cache.prefix_len == SEQ and cache.tree_len == 0
        assert _max_diff(inc, full[b : b + 1]) < TOL
        assert _max_diff(inc, ref[b : b + 1]) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_mask_siblings_match_separate_forwards(setup, family):
    """3 sibling tokens after a prefix, each seeing only the prefix and itself, then commit one."""
    _, ours, hf, ids, _ = setup(family)
    P = PREFILL
    prefix = ids[:1, :P]
    siblings = torch.tensor([[5, 77, 301]])
    cache = KVCache.for_model(ours, capacity=64)
    with torch.no_grad():
        causal = torch.ones(P, P, dtype=torch.bool).tril()[None, None]
        ours(prefix, torch.arange(P)[None], cache, _slots(cache, P), causal)
        cache.commit(list(range(P)))
        slots = _slots(cache, 3)
        mask = torch.zeros(1, 1, 3, P + 3, dtype=torch.bool)
        mask[..., :P] = True
        mask[0, 0, torch.arange(3), P + torch.arange(3)] = True
        tree_logits = ours(siblings, torch.full((1, 3), P), cache, slots, mask)  # [1, 3, V]
        for i in range(3):
            seq = torch.cat([prefix, siblings[:, i : i + 1]], dim=1)
            expect = hf(seq).logits[:, -1]
            assert _max_diff(tree_logits[:, i], expect) < TOL, f"sibling {i}"
        # siblings really differ (otherwise the mask test is vacuous)
        assert _max_diff(tree_logits[:, 0], tree_logits[:, 2]) > 1e-2

        # accept sibling 1, then decode one more token: equals the full forward of that path
        cache.commit([1])
        assert cache.prefix_len == P + 1 and cache.tree_len == 0
        nxt = torch.tensor([[42]])
        out = ours(nxt, torch.tensor([[P + 1]]), cache, _slots(cache, 1), torch.ones(1, 1, 1, P + 2, dtype=torch.bool))
        expect = hf(torch.cat([prefix, siblings[:, 1:2], nxt], dim=1)).logits[:, -1]
        assert _max_diff(out[:, 0], expect) < TOL


def _check_bf16(path, ours, ids, dtype) -> None:
    low = load_model(path, dtype=dtype)
    assert low.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in low.parameters())
    assert low.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32
    with torch.no_grad():
        a, b = low(ids).float(), ours(ids)
    assert torch.isfinite(a).all()
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 5e-2, rel
    assert rel > 1e-5  # the load really cast the weights


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_load_close_to_fp32(setup, family):
    path, ours, _, ids, _ = setup(family)
    _check_bf16(path, ours, ids, torch.bfloat16)


def test_bf16_load_by_name(setup):
    path, ours, _, ids, _ = setup("llama")
    _check_bf16(path, ours, ids, "bfloat16")


@pytest.mark.parametrize("family,overrides", [
    ("mistral", dict(sliding_window=8)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
])
def test_sliding_window_models_equal_transformers_past_the_window(tiny_checkpoint, family, overrides):
    """Sliding-window layers (all of Mistral's; Qwen's from max_window_layers on): logits equal
    transformers' over 24 tokens with a window of 8, in one pass and token by token through the
    KV cache; greedy `ar`, `chain` and `tree` (host and device-resident loops) equal transformers'
    greedy decoding, the window crossing from the prompt into the drafted trees."""
    from transformers import AutoModelForCausalLM

    from tandem.config import GenerationConfig, SpecConfig
    from tandem.runtime.generate import Generator

    path = tiny_checkpoint(family, tokenizer=False, **overrides)
    ours = load_model(path)
    assert ours.config.sliding_window == 8 and ours.config.max_position_embeddings > 8
    assert ours.config.sliding_layers == ((0, 1) if family == "mistral" else (1,))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits
        assert _max_diff(ours(ids), want) < TOL
        cache = KVCache.for_model(ours, 32)
        for t in range(24):  # one row at a time over the cache: the window slides along the prefix
            mask = torch.ones(1, 1, 1, t + 1, dtype=torch.bool)
            got = ours(ids[:1, t:t + 1], torch.tensor([[t]]), cache, torch.tensor([[t]]), mask)
            cache.commit([0])
            assert _max_diff(got[0, 0], want[0, t]) < TOL, t
        prompt = ids[0, :12].tolist()
        ref = hf.generate(ids[:1, :12], max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, 12:].tolist()
    draft = load_model(path)
    g = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    for resident in (False, True):
        gen = Generator(ours, draft, use_graphs=False, resident=resident)
        for method, spec in (("ar", SpecConfig()), ("chain", SpecConfig(k=4)), ("tree", SpecConfig(nodes=8, width=2))):
            assert gen.generate(prompt, method, spec, gen=g).token_ids == ref, (method, resident)
    # async: the draft worker's evolving tree (re-rooted, its subtree's K/V kept) over windowed layers
    out = Generator(ours, draft, use_graphs=False).generate(prompt, "async", SpecConfig(nodes=8, width=2), gen=g,
                                                            transport="inline")
    assert out.token_ids == ref


def test_engine_with_a_sliding_window_target_equals_its_solo_ar_outputs(tiny_checkpoint):
    """The batched engine masks each sliding-window layer's rows to their window too."""
    from tandem.config import GenerationConfig, SpecConfig
    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.engine.request import SamplingParams
    from tandem.runtime.generate import Generator

    path = tiny_checkpoint("qwen2", tokenizer=False, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    target, draft = load_model(path), load_model(path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (3, 9, 15)]
    solo = [Generator(target, None).generate(p, "ar", gen=GenerationConfig(max_new_tokens=16, ignore_eos=True)).token_ids
            for p in prompts]
    for method in ("ar", "tree"):
        e = Engine(target, draft if method != "ar" else None,
                   config=EngineConfig(method=method, spec=SpecConfig(nodes=6, width=2), block_size=4, debug_check=True))
        reqs = [e.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
        done = {o.request_id: o for o in e.run()}
        assert [done[r.request_id].token_ids for r in reqs] == solo, method
