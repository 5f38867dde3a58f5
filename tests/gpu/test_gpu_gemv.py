"""GPU lane: the one-row GEMV layer kernels (tandem.kernels.gemv) compiled, against their references at the
Llama-3-8B and Qwen2.5-7B (q/k/v bias) layer shapes, fp32 and bf16, every launch shape the bench sweeps
first; and a 4-layer model of the Llama-3-8B width decoded greedily through a CUDA-graph runner with the
kernels on and off (fp32: the same tokens).

Each test asserts that the kernels really apply (the dispatcher's `applies`).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gpu_lane import NEEDS_CUDA, no_grad, rel_err
from tandem.bench.presets import PRESETS
from tandem.kernels import gemv as gv
from tandem.models.layers import rope_inv_freq

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]

SHAPES = {"llama3-8b": PRESETS["llama3-8b"], "qwen2.5-7b": PRESETS["qwen2.5-7b"]}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative (norm) error
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
LAUNCHES = [(4, 512, 4), (8, 1024, 8), (16, 256, 4)]


def _randn(*shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).mul_(scale).to(dtype)


@pytest.mark.parametrize("launch", LAUNCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_and_gate_up(shape, dtype, launch):
    c = SHAPES[shape]
    K, inter = c.hidden_size, c.intermediate_size
    x, d = _randn(1, K, dtype=dtype, seed=0), _randn(1, K, dtype=dtype, seed=1)
    ln = 1 + _randn(K, dtype=dtype, seed=2, scale=0.1)
    w_down = _randn(K, inter, dtype=dtype, seed=3, scale=inter ** -0.5)
    h = _randn(1, inter, dtype=dtype, seed=4)
    assert gv.applies(h, w_down)
    assert rel_err(gv.gemv(h, w_down, launch), F.linear(h, w_down)) < TOL[dtype]
    w_gu = _randn(2 * inter, K, dtype=dtype, seed=5, scale=K ** -0.5)
    assert gv.applies(x, w_gu)
    s_ref, y_ref = gv.norm_gate_up_silu_ref(x, d, ln, c.rms_norm_eps, w_gu)
    s, y = gv.norm_gate_up_silu(x, d, ln, c.rms_norm_eps, w_gu, launch)
    assert torch.equal(s, s_ref)
    assert rel_err(y, y_ref) < TOL[dtype]


@pytest.mark.parametrize("launch", LAUNCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_norm_qkv_rope_store(shape, dtype, launch):
    c = SHAPES[shape]
    K, D, nq, nkv, cap = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, 300
    x, d = _randn(1, K, dtype=dtype, seed=0), _randn(1, K, dtype=dtype, seed=1)
    ln = 1 + _randn(K, dtype=dtype, seed=2, scale=0.1)
    w = _randn((nq + 2 * nkv) * D, K, dtype=dtype, seed=3, scale=K ** -0.5)
    b = _randn((nq + 2 * nkv) * D, dtype=dtype, seed=6) if c.attention_bias else None
    pos, slots = torch.tensor([4321], device="cuda"), torch.tensor([77], device="cuda")
    inv = rope_inv_freq(c).cuda()
    kv = [_randn(2, 1, nkv, cap, D, dtype=dtype, seed=4) for _ in range(2)]
    kv[1].copy_(kv[0])
    assert gv.applies(x, w)
    s_ref, q_ref = gv.norm_qkv_rope_store_ref(x, d, ln, 1e-5, w, b, pos, inv, nq, nkv, kv[1][0], kv[1][1], slots)
    s, q = gv.norm_qkv_rope_store(x, d, ln, 1e-5, w, b, pos, inv, nq, nkv, kv[0][0], kv[0][1], slots, launch=launch)
    assert torch.equal(s, s_ref)
    assert rel_err(q, q_ref) < TOL[dtype]
    assert rel_err(kv[0][:, :, :, slots], kv[1][:, :, :, slots]) < TOL[dtype]
    other = torch.ones(cap, dtype=torch.bool, device="cuda")
    other[slots] = False
    assert torch.equal(kv[0][:, :, :, other], kv[1][:, :, :, other])


def test_decode_with_and_without_the_kernels(monkeypatch):
    """fp32, 4 layers of the Llama-3-8B width (vocabulary cut to 4096), CUDA graphs: greedy tokens equal."""
    from tandem.bench.presets import random_model
    from tandem.config import GenerationConfig
    from tandem.runtime.generate import Generator

    torch.manual_seed(0)
    small = dataclasses.replace(PRESETS["llama3-8b"], num_hidden_layers=4, vocab_size=4096)
    model = random_model(small, "cuda", torch.float32).fuse_projections()
    prompt = torch.randint(0, 4096, (40,)).tolist()
    x = torch.zeros(1, 4096, device="cuda")
    layer = model.model.layers[0]
    assert gv.applies(x, layer.self_attn.qkv_weight) and gv.applies(x, layer.mlp.gate_up_weight)
    outs = []
    for on in ("1", "0"):
        monkeypatch.setenv("TANDEM_GEMV", on)
        r = Generator(model, None).generate(prompt, "ar", gen=GenerationConfig(max_new_tokens=24, ignore_eos=True))
        outs.append(r.token_ids)
    assert outs[0] == outs[1]
