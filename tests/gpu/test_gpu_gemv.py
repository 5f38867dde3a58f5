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


def _w12(w: torch.Tensor):
    from tandem.quant.w12 import encode_w12, gemv_operand, verify_w12

    rec, esc = encode_w12(w)
    verify_w12(w, rec, esc)
    return gemv_operand(rec, esc)


@pytest.mark.parametrize("launch", LAUNCHES + [(2, 2048, 8)], ids=str)
def test_w12_operands_equal_the_bf16_weights(launch):
    """Each one-row kernel reading a W12 matrix (realistic weights: Student-t, per-channel scales, outlier
    columns, a channel of zeros, one of denormals, one mostly under its window) gives the bf16 weight's
    result, bf16 x, at the Llama-3-8B shapes."""
    sys_path_tests_gpu()
    from test_gpu_w12 import realistic_weights

    c = PRESETS["llama3-8b"]
    K, inter, D, nq, nkv, cap = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads, \
        c.num_key_value_heads, 64
    x, d = _randn(1, K, dtype=torch.bfloat16, seed=0), _randn(1, K, dtype=torch.bfloat16, seed=1)
    ln = 1 + _randn(K, dtype=torch.bfloat16, seed=2, scale=0.1)
    h = _randn(1, inter, dtype=torch.bfloat16, seed=4)
    w_down = realistic_weights(K, inter, seed=3)
    op = _w12(w_down)
    assert gv.applies(h, op)
    assert rel_err(gv.gemv(h, op, launch), gv.gemv(h, w_down, launch)) < 1e-2
    w_gu = realistic_weights(2 * inter, K, seed=5)
    s_ref, y_ref = gv.norm_gate_up_silu(x, d, ln, 1e-5, w_gu, launch)
    s, y = gv.norm_gate_up_silu(x, d, ln, 1e-5, _w12(w_gu), launch)
    assert torch.equal(s, s_ref) and rel_err(y, y_ref) < 1e-2
    w = realistic_weights((nq + 2 * nkv) * D, K, seed=6)
    pos, slots = torch.tensor([21], device="cuda"), torch.tensor([7], device="cuda")
    inv = rope_inv_freq(c).cuda()
    kv = [torch.zeros(2, 1, nkv, cap, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    s_ref, q_ref = gv.norm_qkv_rope_store(x, d, ln, 1e-5, w, None, pos, inv, nq, nkv, kv[1][0], kv[1][1], slots,
                                          launch=launch)
    s, q = gv.norm_qkv_rope_store(x, d, ln, 1e-5, _w12(w), None, pos, inv, nq, nkv, kv[0][0], kv[0][1], slots,
                                  launch=launch)
    assert torch.equal(s, s_ref) and rel_err(q, q_ref) < 1e-2 and rel_err(kv[0], kv[1]) < 1e-2
    head = realistic_weights(c.vocab_size // 8, K, seed=7)
    assert rel_err(gv.norm_gemv(x, d, ln, 1e-5, _w12(head), launch), gv.norm_gemv(x, d, ln, 1e-5, head, launch)) < 1e-2


def sys_path_tests_gpu() -> None:
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)


def test_decode_through_w12_copies():
    """bf16, 4 layers of the Llama-3-8B width (vocabulary cut to 4096), a CUDA-graph runner: one-row steps
    through W12 copies of every projection and the LM head (Transformer.use_w12_gemv), fed the same tokens,
    stay as close to the same model's fp32 steps as the bf16 weights' steps do (both round the residual
    stream to bf16 after every kernel; only the weights' read and the sums' order differ: 1.2% relative
    between the two on an H100, 2026-12-07). Greedy tokens are not compared: random weights put bf16 logits
    close together, so a near-tie could flip either way."""
    import copy

    from tandem.bench.presets import random_model
    from tandem.runtime.runner import ModelRunner

    small = dataclasses.replace(PRESETS["llama3-8b"], num_hidden_layers=4, vocab_size=4096)
    model = random_model(small, "cuda", torch.bfloat16).fuse_projections()
    exact = copy.deepcopy(model).float()
    prompt = torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    feed = torch.randint(0, 4096, (12,), generator=torch.Generator().manual_seed(1)).tolist()

    def steps(m) -> list[torch.Tensor]:
        runner = ModelRunner(m, capacity=96)
        runner.prefill(prompt)
        rows = []
        for i, t in enumerate(feed):
            rows.append(runner.step([t], [len(prompt) + i], torch.ones(1, 1, dtype=torch.bool))[0].float().clone())
            runner.cache.commit([0])
        return rows

    ref = steps(exact)
    bf16 = max(rel_err(a, b) for a, b in zip(steps(model), ref))
    stats = model.use_w12_gemv()
    assert stats["bits_per_weight"] < 12.1, stats
    w12 = max(rel_err(a, b) for a, b in zip(steps(model), ref))
    assert w12 <= 1.5 * bf16 + 1e-3, (w12, bf16)
