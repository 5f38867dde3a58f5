"""Tiny random models for end-to-end method tests (built in memory, fp32, seeded).

Logits are made peaky (scaled lm_head) so greedy argmaxes are far from ties, and a draft can be
a noisy copy of the target (high agreement) or an unrelated model (low agreement).
"""
from __future__ import annotations

import copy

import torch

from tandem.config import ModelConfig
from tandem.models.transformer import Transformer


def tiny_config(vocab: int = 96, hidden: int = 64, layers: int = 2, family: str = "llama", **kw) -> ModelConfig:
    return ModelConfig(family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=hidden // 4, max_position_embeddings=512, eos_token_ids=(vocab - 1,),
                       attention_bias=family == "qwen2", qk_norm=family == "qwen3", **kw)


def tiny_model(seed: int = 0, scale: float = 6.0, **kw) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(tiny_config(**kw)).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
        m.lm_head.weight.mul_(scale)
    return m


def random_eagle3_head(target: Transformer, seed: int = 5, scale: float = 1.0):
    """A random EAGLE-3 head over `target` (its embeddings shared; reads features of layers 0, 1, 1):
    norms near 1, other weights Gaussian / sqrt(fan-in) x scale; fp32, eval, projections fused."""
    import dataclasses

    from tandem.models.eagle3 import Eagle3Config, Eagle3Head

    tc = target.config
    cfg = Eagle3Config(llama=dataclasses.replace(tc, num_hidden_layers=1), draft_vocab_size=tc.vocab_size,
                       target_hidden_size=tc.hidden_size, feature_layers=(0, 1, 1))
    head = Eagle3Head(cfg, target.model.embed_tokens)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    head.materialize_buffers("cpu", torch.float32)
    return head.eval().requires_grad_(False).fuse_projections()


def noisy_copy(model: Transformer, noise: float, seed: int = 1) -> Transformer:
    """A draft that agrees with `model` often but not always."""
    g = torch.Generator().manual_seed(seed)
    d = copy.deepcopy(model)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return d


def unit_scaled_model(vocab: int = 96, seed: int = 0, head_scale: float = 4.0, max_positions: int = 256) -> Transformer:
    """A 2-layer, 32-wide Llama whose weights are N(0, 1/fan_in) (norm gains near 1), seeded;
    `head_scale` sharpens its logits. Used by the async and evolving-tree tests."""
    cfg = ModelConfig(family="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    m = Transformer(cfg).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        m.lm_head.weight.mul_(head_scale)
    return m


def token_path(tokens: list[int], parents: list[int], i: int) -> list[int]:
    """Node i of a tree as the token path from the root (the root excluded)."""
    out = []
    while i > 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


def token_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Every node as its token path from the root (a node's identity in a lattice tree)."""
    return {tuple(token_path(tokens, parents, i)) for i in range(1, len(tokens))}


def check_best_first_trees(nodes: int, device: str) -> None:
    """tandem.drafting.lattice.best_first_trees over random ragged lattices (on `device`) against
    the heap walk over each lattice alone: the same node sets (as token paths) and scores."""
    import numpy as np

    from tandem.drafting.lattice import best_first_tree, best_first_trees, unpack_lattice

    K, B = 16, 16
    rng = np.random.default_rng(nodes)
    positions = [16, 1, 5, 16, 2, 11]
    rows = np.zeros((len(positions), B, 3 * K + K * K), dtype=np.float32)
    for r in range(len(positions)):
        rows[r, :, :K] = np.stack([rng.choice(8000, K, replace=False) for _ in range(B)])  # candidates
        logits = rng.normal(size=(B, K + K * K)) * 2.0  # (own and parent-conditioned scores, log-softmaxed)
        rows[r, :, 2 * K:3 * K] = logits[:, :K] - np.log(np.exp(logits[:, :K]).sum(-1, keepdims=True) + 1.0)
        given = logits[:, K:].reshape(B, K, K)
        rows[r, :, 3 * K:] = (given - np.log(np.exp(given).sum(-1, keepdims=True) + 1.0)).reshape(B, K * K)
    roots = [100 + r for r in range(len(positions))]
    got = best_first_trees(torch.from_numpy(rows).to(device), positions, roots, K, nodes)

    for r, tree in enumerate(got):
        want = best_first_tree(unpack_lattice(torch.from_numpy(rows[r, :positions[r]]), K), roots[r], nodes)
        assert tree.tokens[0] == roots[r] and all(0 <= p < i for i, p in enumerate(tree.parents) if i > 0)
        same = token_paths(tree.tokens, tree.parents) == token_paths(want.tokens, want.parents)
        assert len(tree) == len(want) and same, r
        assert np.allclose(sorted(tree.logp), sorted(want.logp), atol=1e-9)



# ---- the batched engine's tests ---------------------------------------------------------------
def run_all(engine, prompts, params=None):
    """Every prompt added to the engine at once, run to the end -> their outputs in prompt order
    (params: 24 greedy tokens, EOS ignored, unless given)."""
    from tandem.engine.request import SamplingParams

    params = params or SamplingParams(max_tokens=24, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    done = {o.request_id: o for o in engine.run()}
    return [done[r.request_id] for r in reqs]


def assert_clean(engine) -> None:
    """Nothing left behind: a sound pool with every block free, no request, no batch membership."""
    assert engine.pool.check() == []
    assert engine.pool.num_free == engine.pool.num_blocks and engine.pool.seqs == {}
    assert not engine.has_unfinished() and engine.requests == {}
    assert engine.batches is None or engine.batches.batch_of == {}
