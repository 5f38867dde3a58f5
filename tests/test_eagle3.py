"""EAGLE-3 heads: the public checkpoint layout, the layer's math, exact decoding, lossless sampling,
and the tiny training recipe."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models_for_tests import tiny_model
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.drafting.eagle_drafter import select_tree
from tandem.models.eagle3 import load_eagle3
from tandem.runtime.generate import Generator
from tandem.runtime.pair import draft_kind
from tandem.runtime.runner import ModelRunner
from tandem.verify.sampling import probs_from_logits

H, HEADS, KV, D, INTER = 64, 4, 2, 16, 96


def write_head(d: Path, target, draft_vocab: int | None = None, bin_file: bool = False, seed: int = 0,
               arch: str = "LlamaForCausalLMEagle3", scale: float = 0.3, lm_head_from_target: bool = False) -> dict:
    """A random head in the public layout (names and shapes as vLLM / SGLang load them)."""
    V = target.config.vocab_size
    Vd = draft_vocab or V
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale

    state = {
        "fc.weight": rnd(H, 3 * target.config.hidden_size),
        "midlayer.input_layernorm.weight": 1 + rnd(H) * 0.3,
        "midlayer.hidden_norm.weight": 1 + rnd(H) * 0.3,
        "midlayer.post_attention_layernorm.weight": 1 + rnd(H) * 0.3,
        "midlayer.self_attn.q_proj.weight": rnd(HEADS * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(KV * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(KV * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, HEADS * D),
        "midlayer.mlp.gate_proj.weight": rnd(INTER, H),
        "midlayer.mlp.up_proj.weight": rnd(INTER, H),
        "midlayer.mlp.down_proj.weight": rnd(H, INTER),
        "norm.weight": 1 + rnd(H) * 0.3,
        "lm_head.weight": rnd(Vd, H) * 10,
    }
    if Vd < V:  # a reduced vocabulary: draft id i is target id kept[i]
        kept = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
        state["d2t"] = kept - torch.arange(Vd)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[kept] = True
        state["t2d"] = t2d
        if lm_head_from_target:
            state["lm_head.weight"] = target.lm_head.weight[kept].clone()
    elif lm_head_from_target:
        state["lm_head.weight"] = target.lm_head.weight.clone()
    if target.config.hidden_size != H:  # the head cannot share the target's embeddings: it ships its own
        state["embed_tokens.weight"] = rnd(V, H)
    cfg = {"architectures": [arch], "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
           "target_hidden_size": target.config.hidden_size,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": V, "draft_vocab_size": Vd,
           "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if bin_file:
        torch.save(state, d / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(state, str(d / "model.safetensors"))
    return state


def rms(x, w, eps=1e-5):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_logits(state: dict, embed: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The layer written out: ids [T], hidden [T, H] at positions 0..T-1, causal -> target-vocab
    logits [T, V] (-inf outside the draft vocabulary)."""
    T = ids.shape[0]
    s = {k.removeprefix("midlayer."): v for k, v in state.items()}
    x = torch.cat([rms(embed[ids], s["input_layernorm.weight"]), rms(hidden, s["hidden_norm.weight"])], -1)
    q = (x @ s["self_attn.q_proj.weight"].T).view(T, HEADS, D)
    k = (x @ s["self_attn.k_proj.weight"].T).view(T, KV, D)
    v = (x @ s["self_attn.v_proj.weight"].T).view(T, KV, D)
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).double() / D)
    ang = torch.arange(T).double()[:, None] * inv  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]

    def rot(t):
        return t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = torch.einsum("hts,shd->thd", att, v).reshape(T, HEADS * D) @ s["self_attn.o_proj.weight"].T
    r = hidden + o
    m = rms(r, s["post_attention_layernorm.weight"])
    out = r + (torch.nn.functional.silu(m @ s["mlp.gate_proj.weight"].T) * (m @ s["mlp.up_proj.weight"].T)) \
        @ s["mlp.down_proj.weight"].T
    dl = rms(out, s["norm.weight"]) @ s["lm_head.weight"].T  # [T, Vd]
    V = embed.shape[0]
    full = torch.full((T, V), float("-inf"))
    d2t = state.get("d2t", torch.zeros(dl.shape[1], dtype=torch.long))
    full[:, torch.arange(dl.shape[1]) + d2t] = dl
    return full


def to_full(head, logits: torch.Tensor) -> torch.Tensor:
    full = torch.full((logits.shape[0], head.config.vocab_size), float("-inf"))
    full[:, head.to_target(torch.arange(logits.shape[1]))] = logits
    return full


@pytest.mark.parametrize("bin_file,draft_vocab,arch", [(False, None, "LlamaForCausalLMEagle3"),
                                                       (True, 40, "Eagle3LlamaForCausalLM")])
def test_public_layout_loads_and_its_logits_equal_the_layer_written_out(tmp_path, bin_file, draft_vocab, arch):
    target = tiny_model(seed=3)
    state = write_head(tmp_path / "head", target, draft_vocab, bin_file=bin_file, arch=arch)
    assert draft_kind(tmp_path / "head") == "eagle3"
    head = load_eagle3(tmp_path / "head", target, "cpu", torch.float32)
    assert head.econfig.feature_layers == (1, 1, 0)  # the default (2, L // 2, L - 3) clipped into 2 layers
    assert head.lm_head.weight.shape == (draft_vocab or 96, H)
    T = 7
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (T,))
    feats = torch.randn(T, 3 * target.config.hidden_size)
    hidden = feats @ state["fc.weight"].T
    want = reference_logits(state, target.model.embed_tokens.weight, ids, hidden)
    logits, _ = head.layer(ids[None], head.project(feats)[None], torch.arange(T)[None])
    torch.testing.assert_close(to_full(head, logits[0]), want, rtol=1e-4, atol=1e-4)
    # the same through the KV cache and the runner (static hidden buffer, fused projections)
    runner = ModelRunner(head, 32, use_graphs=False)
    head.set_hidden(head.project(feats))
    got = runner.step(ids.tolist(), list(range(T)), torch.ones(T, T, dtype=torch.bool).tril())
    torch.testing.assert_close(to_full(head, got), want, rtol=1e-4, atol=1e-4)
    if draft_vocab:  # d2t maps the reduced vocabulary: only the kept target ids are finite
        assert torch.isfinite(want).sum(-1).tolist() == [draft_vocab] * T
        assert head.to_target(torch.tensor([0, draft_vocab - 1])).tolist() == \
            [int(state["d2t"][0]), int(state["d2t"][-1]) + draft_vocab - 1]


def test_bad_checkpoints_are_one_line_config_errors(tmp_path):
    target = tiny_model(seed=3)
    write_head(tmp_path / "h", target)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 50}))
    with pytest.raises(ConfigError, match="vocab 50"):
        load_eagle3(tmp_path / "h", target, "cpu", torch.float32)
    (tmp_path / "h" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 12}))
    with pytest.raises(ConfigError, match="midlayer.mlp"):
        load_eagle3(tmp_path / "h", target, "cpu", torch.float32)
    (tmp_path / "h" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="neither model.safetensors nor pytorch_model.bin"):
        load_eagle3(tmp_path / "h", target, "cpu", torch.float32)


def test_selection_is_the_best_n_prefix_closed():
    # nodes: 0,1 children of the root; 2,3 children of 0; 4,5 children of 1 (lp: cumulative)
    host = np.array([[10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 1], [-0.5, -1.0, -0.5, -3.0, -1.2, -np.inf]])
    t = select_tree(host, 7, 4)
    assert t.tokens == [7, 10, 11, 12, 14] and t.parents == [-1, 0, 0, 1, 2]
    # a tie between a parent and its child (probability 1) keeps the parent first
    assert select_tree(host, 7, 1).tokens == [7, 10]
    assert select_tree(host, 7, 2).tokens == [7, 10, 12]
    assert len(select_tree(host, 7, 99)) == 6  # the -inf node is never drafted


@pytest.mark.parametrize("method,spec", [("chain", SpecConfig(k=4)), ("tree", SpecConfig(nodes=12, width=3)),
                                         ("tree", SpecConfig(nodes=5, width=2, depth=3))])
@pytest.mark.parametrize("use_graphs", [False, "emulate"])
@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_greedy_output_equals_ar(tmp_path, method, spec, use_graphs, draft_vocab):
    target = tiny_model(seed=3)
    write_head(tmp_path / "head", target, draft_vocab, lm_head_from_target=True)
    head = load_eagle3(tmp_path / "head", target, "cpu", torch.float32)
    ar = Generator(target, None, use_graphs=use_graphs)
    gen = Generator(target, head, use_graphs=use_graphs)
    g = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for p in ([1, 5, 9, 2], [7], list(range(3, 30)), list(range(2, 90)) * 2):  # the last: > one context chunk
        want = ar.generate(p, "ar", gen=g).token_ids
        got = gen.generate(p, method, spec, gen=g)
        assert got.token_ids == want
        # the drafts had the requested shape: a chain of k every pass; a tree of depth 2 .. d
        offered = [o for o, _ in got.per_depth]
        if method == "chain":
            assert offered == [got.target_passes] * spec.k
        else:
            assert 2 <= len(offered) <= spec.resolved_depth() and offered[0] == got.target_passes


def test_sampling_first_token_follows_the_target(tmp_path):
    V, n, prompt = 12, 600, [3, 7, 1]
    target = tiny_model(seed=0, vocab=V, scale=2.0)
    write_head(tmp_path / "head", target, seed=5)
    head = load_eagle3(tmp_path / "head", target, "cpu", torch.float32)
    sampling = SamplingConfig(temperature=1.0)
    with torch.no_grad():
        p1 = probs_from_logits(target(torch.tensor([prompt]))[0, -1], sampling)
    gen, g = Generator(target, head), GenerationConfig(max_new_tokens=1, ignore_eos=True)
    for method, spec in (("tree", SpecConfig(nodes=6, width=3, depth=2)), ("chain", SpecConfig(k=3))):
        c = torch.zeros(V)
        for seed in range(n):
            out = gen.generate(prompt, method, spec, sampling=SamplingConfig(1.0, 1.0, seed), gen=g)
            c[out.token_ids[0]] += 1
        tv = 0.5 * float((c / n - p1).abs().sum())
        assert tv < 0.08, (method, tv, c / n, p1)
    # the head's own (deterministic) proposal is not what the target samples: the test can fail
    first = gen.generate(prompt, "chain", SpecConfig(k=1), gen=g).token_ids[0]
    assert float(p1[first]) < 0.9


def test_tiny_recipe_trains_a_head_that_loads_and_decodes_like_ar(tmp_path):
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    r = subprocess.run([sys.executable, "-m", "tandem", "train-drafters", "--tiny", "--kind", "eagle3", "--out",
                        str(tmp_path / "d"), "--device", "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = json.loads((tmp_path / "d" / "drafters_metrics.json").read_text())
    assert metrics["eagle3"]["steps"] > 0 and math.isfinite(metrics["eagle3"]["final_loss"])
    assert draft_kind(tmp_path / "d" / "eagle3") == "eagle3"
    pair = load_pair(None, str(tmp_path / "d" / "eagle3"), device="cpu")
    gen = Generator(pair.target, pair.draft, use_graphs=False)
    prompt = pair.tokenizer.encode("def add(a, b):\n    return").ids
    g = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    want = Generator(pair.target, None, use_graphs=False).generate(prompt, "ar", gen=g).token_ids
    for method in ("chain", "tree"):
        assert gen.generate(prompt, method, SpecConfig(k=3, nodes=8, width=2), gen=g).token_ids == want


def test_training_time_test_rows_equal_what_decoding_computes(tmp_path):
    """Step k of the unrolled training pass at row i is the depth-k node over root i - k: the
    same logits as the head fed through its KV cache (context rows <= i - k, then the path)."""
    from tandem.kv.cache import KVCache
    from tandem.train.eagle3 import unrolled

    target = tiny_model(seed=3)
    write_head(tmp_path / "head", target)
    head = load_eagle3(tmp_path / "head", target, "cpu", torch.float32)
    torch.manual_seed(1)
    L, K = 9, 3
    x = torch.randint(0, 96, (1, L))
    hidden0 = torch.randn(1, L, H)
    steps = unrolled(head, x, hidden0, K, torch.device("cpu"))
    for k in range(K):
        for i in range(k, L):
            r = i - k  # the root's row
            cache = KVCache.for_model(head, 32)
            n = r + 1
            logits, out = head.layer(x[:, :n], hidden0[:, :n], torch.arange(n)[None], cache, torch.arange(n)[None],
                                     torch.ones(n, n, dtype=torch.bool).tril()[None, None])
            h = out[:, -1:]
            for j in range(1, k + 1):  # the path below the root: a chain sees every earlier row
                p = r + j
                logits, h = head.layer(x[:, p:p + 1], h, torch.tensor([[p]]), cache, torch.tensor([[p]]),
                                       torch.ones(1, 1, 1, p + 1, dtype=torch.bool))
            torch.testing.assert_close(steps[k][0, i], logits[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method,spec", [("chain", SpecConfig(k=4)), ("tree", SpecConfig(nodes=12, width=3))])
def test_greedy_output_equals_ar_with_cuda_graphs(tmp_path, method, spec):
    """The context pass's bucket graphs and the levels' one graph (per attention width) on the GPU."""
    target = tiny_model(seed=3)
    write_head(tmp_path / "head", target, 40, lm_head_from_target=True)
    target = target.cuda()
    head = load_eagle3(tmp_path / "head", target, "cuda", torch.float32)
    ar, gen = Generator(target, None), Generator(target, head)
    g = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    for p in ([1, 5, 9, 2], [7], list(range(3, 90)), list(range(2, 300))):  # widths 256 and 512
        assert gen.generate(p, method, spec, gen=g).token_ids == ar.generate(p, "ar", gen=g).token_ids


@pytest.mark.parametrize("width,depth", [(2, 4), (3, 3), (1, 5)])
def test_levels_equal_eagle2_expanded_path_by_path_without_a_cache(tmp_path, width, depth):
    """HeadLevels (one batched pass per level through the KV cache, the glue of
    kernels.resident.level_step) against EAGLE-2's expansion written out plainly: each fed
    node's logits recomputed without a cache over the context rows and its own path, each row
    reading its parent's output hidden; children = top-w by log-prob; the w best new nodes fed."""
    from tandem.drafting.eagle_drafter import HeadLevels

    target = tiny_model(seed=3)
    write_head(tmp_path / "head", target, draft_vocab=64)
    head = load_eagle3(tmp_path / "head", target, "cpu", torch.float32)
    with torch.no_grad():
        head.lm_head.weight.mul_(8.0)  # peaked, like a trained head's (no near-ties)
    torch.manual_seed(2)
    T = 6
    ctx = torch.randint(0, 96, (T,))
    ctx_hidden = torch.randn(T, H)

    def plain(ids: list[int], hiddens: list[torch.Tensor]):  # the context, then a path; causal, no cache
        n = T + len(ids)
        x = torch.cat([ctx, torch.tensor(ids, dtype=torch.long)])
        h = torch.cat([ctx_hidden] + [t[None] for t in hiddens])
        logits, out = head.layer(x[None], h[None], torch.arange(n)[None])
        return torch.log_softmax(logits[0, -1].float(), -1), out[0, -1]

    # the plain expansion: node = (token, parent index, cumulative lp, output hidden, path ids, path hiddens)
    root_lp, root_out = plain([], [])
    nodes = []
    lp, d = root_lp.topk(width)
    for v, i in zip(lp.tolist(), d.tolist()):
        nodes.append((int(head.to_target(torch.tensor(i))), -1, v, None, [], []))
    new = list(range(width))
    for level in range(1, depth):
        fed = sorted(new, key=lambda n: (-nodes[n][2], n))[:width]
        new = []
        for n in fed:
            tok, _, lpn, _, path, hs = nodes[n]
            parent_out = root_out if not path else nodes[nodes[n][1]][3]
            ids, hid = path + [tok], hs + [parent_out]
            clp, out = plain(ids, hid)
            nodes[n] = (tok, nodes[n][1], lpn, out, path, hs)
            lp, d = clp.topk(width)
            for v, i in zip(lp.tolist(), d.tolist()):
                new.append(len(nodes))
                nodes.append((int(head.to_target(torch.tensor(i))), n, lpn + v, None, ids, hid))
    # HeadLevels through the runner: the context rows in the cache, then the levels
    runner = ModelRunner(head, 64, use_graphs=False)
    head.set_hidden(ctx_hidden)
    logits = runner.step(ctx.tolist(), list(range(T)), torch.ones(T, T, dtype=torch.bool).tril())
    runner.cache.commit(list(range(T)))
    levels = HeadLevels(runner, width, depth)
    host = levels.run(logits[T - 1], head.hidden_out[0, T - 1], T)
    assert host.shape[1] == len(nodes)
    assert host[0].astype(int).tolist() == [n[0] for n in nodes]
    assert host[1].astype(int).tolist() == [n[1] for n in nodes]
    np.testing.assert_allclose(host[2], [n[2] for n in nodes], rtol=1e-4, atol=1e-4)
