"""GPU lane: the fused decoder-layer kernels (tandem.kernels.fused_layer) against their unfused
references at the bundled pair's widths (1 row = an AR step, 33 = a tree verify of N = 32, 128 the
most rows they take), fp32 and bf16, and the bundled target's passes with and without them.

Each test asserts that the kernels really ran (the dispatcher's `applies`).
"""
from __future__ import annotations

import pytest
import torch

from gpu_lane import NEEDS_CUDA, no_grad, rel_err
from tandem.kernels import fused_layer as fl
from tandem.models.layers import rope_inv_freq
from tandem.models.loader import read_config
from tandem.runtime.pair import BUNDLED_DRAFT, BUNDLED_TARGET

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]

SHAPES = {"bundled-target": read_config(BUNDLED_TARGET), "bundled-draft": read_config(BUNDLED_DRAFT)}
ROWS = (1, 33, 128)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative (norm) error
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _randn(*shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).mul_(scale).to(dtype)


@pytest.mark.parametrize("bk", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_norm_qkv_rope_store(shape, rows, dtype, bk, monkeypatch):
    monkeypatch.setattr(fl, "QKV_BK", bk)
    c = SHAPES[shape]
    K, D, nq, nkv, cap = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, 300
    x, d = _randn(rows, K, dtype=dtype, seed=0), _randn(rows, K, dtype=dtype, seed=1)
    ln = 1 + _randn(K, dtype=dtype, seed=2, scale=0.1)
    w = _randn((nq + 2 * nkv) * D, K, dtype=dtype, seed=3, scale=K ** -0.5)
    pos = torch.randint(0, 500, (rows,), device="cuda")
    slots = torch.randperm(cap, device="cuda")[:rows]
    inv = rope_inv_freq(c).cuda()
    kv = [_randn(2, 1, nkv, cap, D, dtype=dtype, seed=4) for _ in range(2)]
    kv[1].copy_(kv[0])
    assert fl.applies(x, w)
    s_ref, q_ref = fl.norm_qkv_rope_store_ref(x, d, ln, 1e-5, w, None, pos, inv, nq, nkv, kv[1][0], kv[1][1], slots)
    s, q = fl.norm_qkv_rope_store(x, d, ln, 1e-5, w, None, pos, inv, nq, nkv, kv[0][0], kv[0][1], slots)
    assert torch.equal(s, s_ref)  # the residual sum: one rounding, the same
    assert rel_err(q, q_ref) < TOL[dtype]
    assert rel_err(kv[0][:, :, :, slots], kv[1][:, :, :, slots]) < TOL[dtype]
    other = torch.ones(cap, dtype=torch.bool, device="cuda")
    other[slots] = False
    assert torch.equal(kv[0][:, :, :, other], kv[1][:, :, :, other])


@pytest.mark.parametrize("bk", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_norm_gate_up_silu(shape, rows, dtype, bk, monkeypatch):
    monkeypatch.setattr(fl, "GATE_UP_BK", bk)
    c = SHAPES[shape]
    K, inter = c.hidden_size, c.intermediate_size
    x, d = _randn(rows, K, dtype=dtype, seed=0), _randn(rows, K, dtype=dtype, seed=1)
    ln = 1 + _randn(K, dtype=dtype, seed=2, scale=0.1)
    w = _randn(2 * inter, K, dtype=dtype, seed=3, scale=K ** -0.5)
    assert fl.applies(x, w)
    s_ref, a_ref = fl.norm_gate_up_silu_ref(x, d, ln, 1e-5, w)
    s, a = fl.norm_gate_up_silu(x, d, ln, 1e-5, w)
    assert torch.equal(s, s_ref)
    assert rel_err(a, a_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_linear(shape, rows, dtype):
    """The o_proj / down_proj kernel against F.linear (cuBLAS), both projections of the shape."""
    c = SHAPES[shape]
    K, inter = c.hidden_size, c.intermediate_size
    for n, k in ((K, c.num_attention_heads * c.head_dim), (K, inter)):
        x, w = _randn(rows, k, dtype=dtype, seed=0), _randn(n, k, dtype=dtype, seed=1, scale=k ** -0.5)
        assert fl.applies(x, w)
        assert rel_err(fl.linear(x, w), torch.nn.functional.linear(x, w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_bundled_target_passes_with_and_without_the_fused_layers(dtype, monkeypatch):
    """The bundled target's logits for a prefill and a tree verify through the runner, fused and not:
    fp32 within 1e-5, bf16 within bf16 rounding; and the fused run really took the fused layers."""
    from tandem.models import layers
    from tandem.runtime.pair import load_pair
    from tandem.runtime.runner import ModelRunner

    target = load_pair(None, None, "cuda", str(dtype).removeprefix("torch.")).target
    calls = []
    real = layers.fused_layer_forward

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    def run(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setenv("TANDEM_FUSED_LAYER", "1" if fused else "0")
        r = ModelRunner(target, 256, use_graphs=False)
        ids = list(range(3, 40))
        out = [r.prefill(ids)]
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        out.append(r.step([5, 6, 7, 8], [37, 38, 38, 39], tree))
        return [t.float() for t in out]

    want = run(False)
    monkeypatch.setattr("tandem.models.transformer.fused_layer_forward", counted)
    got = run(True)
    assert calls, "the fused layers did not run"
    for a, b in zip(got, want):
        assert rel_err(a, b) < TOL[dtype] * (10 if dtype == torch.bfloat16 else 1)


def test_bundled_eagle3_layer_with_and_without_the_fused_kernels(monkeypatch):
    """The bundled EAGLE-3 head's layer over 5 rows (bf16): the fused kernels' logits and hidden within
    bf16 rounding of the unfused layer's, and they ran."""
    from tandem.kv.cache import KVCache
    from tandem.runtime.pair import load_pair

    head = load_pair(None, "eagle3", "cuda", "bfloat16").draft.fuse_projections()
    H = head.config.hidden_size
    ids = torch.arange(10, 15, device="cuda")[None]
    hidden = _randn(1, 5, H, dtype=torch.bfloat16, seed=9)
    pos = torch.arange(3, 8, device="cuda")[None]
    mask = torch.ones(5, 5, dtype=torch.bool, device="cuda").tril()[None, None]
    calls = []
    real = head._fused_layer
    monkeypatch.setattr(head, "_fused_layer", lambda *a: calls.append(1) or real(*a))

    def run(fused: bool):
        monkeypatch.setenv("TANDEM_FUSED_LAYER", "1" if fused else "0")
        cache = KVCache.for_model(head, 16)
        return head.layer(ids, hidden, pos, cache, torch.arange(5, device="cuda")[None], mask)

    want = run(False)
    assert not calls
    got = run(True)
    assert calls == [1]
    for a, b in zip(got, want):
        assert rel_err(a, b) < 2e-2
