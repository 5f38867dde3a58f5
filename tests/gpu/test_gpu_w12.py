"""GPU lane: the W12 Triton GEMM against its torch reference (decode, then cuBLAS) at the bundled
target's and Llama-3-8B's projection shapes, 1-64 rows, with escapes of every finite kind; and
its determinism (the same bits on every call).

The CPU suite runs the kernel's algorithm in torch (tests/test_w12.py::test_kernel_emulation_equals_reference).
"""
from __future__ import annotations

import functools

import pytest
import torch

from gpu_lane import NEEDS_CUDA, rel_err
from tandem.bench.presets import PRESETS
from tandem.models.loader import read_config
from tandem.runtime.pair import BUNDLED_TARGET

pytestmark = [pytest.mark.cuda, NEEDS_CUDA]


def _shapes(cfg) -> dict[str, tuple[int, int]]:
    """[N out, K in] of every projection of a model (and its head)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i), "head": (cfg.vocab_size, h)}


SHAPES = [(f"{m}-{p}", s) for m, cfg in (("bundled", read_config(BUNDLED_TARGET)), ("llama3-8b", PRESETS["llama3-8b"]))
          for p, s in _shapes(cfg).items()]
ROWS = (1, 8, 33, 64)


def realistic_weights(n: int, k: int, seed: int, device: str = "cuda") -> torch.Tensor:
    """Student-t (3 dof) weights with per-channel scales over a decade and a few 8x outlier columns,
    plus zeros, denormals and a window-bottom value (bench/gpu_w12.py draws the same way)."""
    g = torch.Generator(device=device).manual_seed(seed)
    chi2 = torch.randn(3, n, k, generator=g, device=device).pow(2).sum(0) / 3
    w = torch.randn(n, k, generator=g, device=device) / chi2.sqrt()
    w = w * 10 ** (torch.rand(n, 1, generator=g, device=device) - 2.5)
    w[:, torch.randint(0, k, (max(k // 256, 1),), generator=g, device=device)] *= 8
    w = w.to(torch.bfloat16)
    w[0, :] = 0
    w[1, : k // 2] = torch.tensor(3, dtype=torch.int16).view(torch.bfloat16)  # denormals
    w[2, 0] = 100.0  # channel 2: most of it below its window
    return w


@functools.lru_cache(maxsize=None)
def _encoded(n: int, k: int):
    from tandem.quant.w12 import encode_w12
    from tandem.quant.w12_gemm import pack_w12

    w = realistic_weights(n, k, seed=n + k)
    records, escapes = encode_w12(w)  # on the GPU
    return w, records, escapes, pack_w12(records, escapes, "cuda")


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():
        yield


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name,shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_w12_gemm_matches_reference(name, shape, rows):
    from tandem.quant.w12_gemm import w12_linear, w12_linear_ref

    n, k = shape
    w, records, escapes, packed = _encoded(n, k)
    assert escapes.index.numel() > 0
    x = torch.randn(rows, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows)).to(torch.bfloat16)
    got = w12_linear(x, packed)
    want = w12_linear_ref(x, records, escapes)
    assert got.shape == want.shape == (rows, n) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2, rel_err(got, want)
    exact = x.double() @ w.double().T  # [rows, n]
    scale = x.double().abs() @ w.double().abs().T
    assert bool(((got.double() - exact).abs() <= 1e-2 * scale + 1e-30).all())
    assert torch.equal(got, w12_linear(x, packed))  # fixed reduction order: the same bits every call
