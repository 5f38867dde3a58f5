"""Tensor parallelism (tandem.parallel.tensor_parallel) on CPU.

Module level, no processes: the shards' attention and MLP outputs sum to the full layer's (that
is what the all-reduce computes), for splits that divide and splits that need zero padding.
End to end, over gloo: a 2-way sharded target in two processes gives the full model's logits,
and `async` with a tensor-parallel target (3 processes) equals `ar`.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.config import GenerationConfig, ModelConfig, SamplingConfig, SpecConfig
from tandem.models.transformer import Transformer
from tandem.parallel.tensor_parallel import shard_model


def model_with(heads: int, kv: int, inter: int, family: str = "llama", layers: int = 1, seed: int = 3,
               vocab: int = 96) -> Transformer:
    cfg = ModelConfig(family=family, vocab_size=vocab, hidden_size=32, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=8,
                      max_position_embeddings=256, eos_token_ids=(vocab - 1,), attention_bias=family == "qwen2",
                      qk_norm=family == "qwen3")
    torch.manual_seed(seed)
    m = Transformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.15)
        m.lm_head.weight.mul_(4.0)
    return m


CASES = [  # (heads, kv heads, intermediate, tp, family): even splits, padded groups, padded columns
    (4, 2, 64, 2, "llama"), (6, 3, 50, 2, "qwen2"), (6, 2, 48, 4, "llama"), (4, 4, 30, 3, "qwen3"),
    (2, 1, 32, 2, "llama"),
]


@pytest.mark.parametrize("heads,kv,inter,tp,family", CASES)
def test_shards_sum_to_the_full_layer(heads, kv, inter, tp, family):
    model = model_with(heads, kv, inter, family)
    shards = [shard_model(model, r, tp, group=None) for r in range(tp)]
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5)[None]
    full_attn = model.model.layers[0].self_attn(x, pos, model.inv_freq)
    full_mlp = model.model.layers[0].mlp(x)
    attn = sum(s.model.layers[0].self_attn(x, pos, s.inv_freq) for s in shards)
    mlp = sum(s.model.layers[0].mlp(x) for s in shards)
    assert (attn - full_attn).abs().max() < 1e-5
    assert (mlp - full_mlp).abs().max() < 1e-5
    per = shards[0].config
    assert per.num_key_value_heads == -(-kv // tp) and per.intermediate_size == -(-inter // tp)


def test_shard_refuses_bad_input():
    model = model_with(4, 2, 32)
    with pytest.raises(ValueError, match="outside"):
        shard_model(model, 2, 2, None)

def test_a_fused_model_shards_like_an_unfused_one():
    model = model_with(6, 3, 50)
    x = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(4)[None]
    want = [s.model.layers[0].self_attn(x, pos, s.inv_freq) + s.model.layers[0].mlp(x)
            for s in (shard_model(model, r, 2, None) for r in range(2))]
    model.fuse_projections()
    got = [s.model.layers[0].self_attn(x, pos, s.inv_freq) + s.model.layers[0].mlp(x)
           for s in (shard_model(model, r, 2, None) for r in range(2))]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---- end to end over gloo ------------------------------------------------------------------------
def _shard_logits(rank: int, tp: int, init: str, tokens: list[int], q) -> None:
    """One rank: shard, prefill through a ModelRunner (KV cache, tree masks), return the logits."""
    from tandem.runtime.runner import ModelRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=tp)
    try:
        shard = shard_model(model_with(6, 3, 50, "qwen2", layers=2), rank, tp, dist.group.WORLD)
        runner = ModelRunner(shard, 64)
        runner.prefill(tokens[:-3])
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, two children
        out = runner.step(tokens[-3:], [len(tokens) - 3, len(tokens) - 2, len(tokens) - 2], tree)
        q.put((rank, out.clone()))
    finally:
        dist.destroy_process_group()


def test_two_shards_over_gloo_give_the_full_models_logits():
    from tandem.runtime.runner import ModelRunner

    tokens = [5, 17, 3, 88, 41, 9, 60, 2]
    full = ModelRunner(model_with(6, 3, 50, "qwen2", layers=2), 64)
    full.prefill(tokens[:-3])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    want = full.step(tokens[-3:], [len(tokens) - 3, len(tokens) - 2, len(tokens) - 2], tree)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_shard_logits, args=(r, 2, init, tokens, q)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
    for r in range(2):
        assert (got[r] - want).abs().max() < 1e-4, r


def test_async_with_a_tensor_parallel_target_equals_ar():
    from tandem.runtime.async_decode import generate_async
    from tandem.runtime.generate import Generator

    target = model_with(6, 3, 50, "llama", layers=2)
    draft = model_with(6, 3, 50, "llama", layers=2)
    with torch.no_grad():  # a draft that mostly agrees: the target plus noise
        g = torch.Generator().manual_seed(9)
        for pd, pt in zip(draft.parameters(), target.parameters()):
            pd.copy_(pt + 0.02 * torch.randn(pt.shape, generator=g))
    prompt = [4, 8, 15, 16, 23]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    want = Generator(target).generate(prompt, "ar", gen=gen).token_ids
    for tp, dp in ((2, 1), (1, 2), (2, 2)):  # SwiftSpec's x : k-x splits of 3 and 4 processes
        r = generate_async(target, draft, prompt, SpecConfig(nodes=6, width=2), SamplingConfig(), gen, set(),
                           transport="gloo", verbose=False, tensor_parallel_size=tp, draft_tensor_parallel_size=dp,
                           timeout_s=120)
        assert r.token_ids == want, (tp, dp)
        assert (r.stats["tensor_parallel_size"], r.stats["draft_tensor_parallel_size"]) == (tp, dp)
        assert r.tau > 1.0 and r.stats["draft_steps"] > 0


def test_tensor_parallel_size_needs_async_over_processes():
    from tandem.config import ConfigError
    from tandem.runtime.generate import Generator

    m = model_with(4, 2, 32)
    g = Generator(m, model_with(4, 2, 32, seed=4))
    with pytest.raises(ConfigError, match="work with --method async"):
        g.generate([1, 2], "tree", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="use --transport gloo"):
        g.generate([1, 2], "async", transport="inline", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="use --transport gloo"):
        g.generate([1, 2], "async", transport="inline", draft_tensor_parallel_size=2)


@pytest.mark.parametrize("k,rates,want", [
    (4, {"1:3": 50.0, "2:2": 80.0, "3:1": 70.0}, (2, 2)),
    (4, {"1:3": 90.0, "2:2": 80.0, "3:1": 85.0}, (1, 3)),
    (5, {"1:4": 10.0, "2:3": 20.0, "3:2": 30.0, "4:1": 40.0}, (4, 1)),
    (3, {"1:2": 60.0, "2:1": 60.0}, (2, 1)),  # a tie: the larger target
])
def test_split_search_keeps_the_fastest_split_under_the_timings_it_saw(k, rates, want, capsys):
    from tandem.runtime.placement import Split, candidate_splits, search_split

    tried = []

    def trial(split: Split) -> float:  # the trial request's decode rate, from a table
        tried.append(split)
        return rates[str(split)]

    best, seen = search_split(None, None, [1, 2], SpecConfig(), "gloo", k, trial=trial)
    assert best == Split(*want)
    assert tried == candidate_splits(k) and seen == rates
    assert capsys.readouterr().err.rstrip().endswith(f"-> {Split(*want)} (target:draft)")


def test_split_search_over_gloo_uses_the_split_it_found(monkeypatch):
    from tandem.runtime import placement
    from tandem.runtime.generate import Generator
    from tandem.runtime.placement import Split, candidate_splits

    measured: dict[str, float] = {}
    real_trial = placement._trial_rate

    def recording_trial(*args) -> float:  # the real trial request; its rate is remembered
        measured[str(args[-1])] = rate = real_trial(*args)
        return rate

    monkeypatch.setattr(placement, "_trial_rate", recording_trial)
    assert candidate_splits(3) == [Split(1, 2), Split(2, 1)]
    target = model_with(6, 3, 50, "llama", layers=2)
    g = Generator(target, model_with(6, 3, 50, "llama", layers=2, seed=5))
    prompt, gen = [3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=12, ignore_eos=True)
    want = Generator(target).generate(prompt, "ar", gen=gen).token_ids
    r = g.generate(prompt, "async", gen=gen, transport="gloo", split_search=3)
    assert r.token_ids == want
    best = g._runners[("split", "gloo", 3, SpecConfig().nodes, SpecConfig().width)]
    assert set(measured) == {"1:2", "2:1"} and all(v > 0 for v in measured.values())
    assert measured[str(best)] == max(measured.values())  # the fastest of the trials it ran
    assert (r.stats["tensor_parallel_size"], r.stats["draft_tensor_parallel_size"]) == (best.target, best.draft)
    with pytest.raises(Exception, match="at least 2 workers"):
        candidate_splits(1)
