"""GPU lane: the W12 Triton GEMM against its torch reference (decode, then cuBLAS) and its own CPU
emulation at the bundled target's and Llama-3-8B's projection shapes, 1-64 rows (and 70: two row
groups), with escapes of every finite kind; its determinism (the same bits on every call) and its
batch independence (a row's bits are the same alone and among 64 rows), which lossless
verification relies on (a tree pass and an `ar` step must see the same logits for the same row).

The CPU suite runs the kernel's algorithm in torch (tests/test_w12.py: emulation, corrections).
"""
from __future__ import annotations

import functools

import pytest
import torch

from gpu_lane import NEEDS_CUDA, no_grad, rel_err
from tandem.bench.presets import PRESETS
from tandem.models.loader import read_config
from tandem.runtime.pair import BUNDLED_TARGET

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]


def _shapes(cfg) -> dict[str, tuple[int, int]]:
    """[N out, K in] of every projection of a model (and its head)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i), "head": (cfg.vocab_size, h)}


SHAPES = [(f"{m}-{p}", s) for m, cfg in (("bundled", read_config(BUNDLED_TARGET)), ("llama3-8b", PRESETS["llama3-8b"]))
          for p, s in _shapes(cfg).items()]
ROWS = (1, 8, 33, 64, 70)


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




@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name,shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_w12_gemm_matches_reference(name, shape, rows):
    from tandem.quant.w12_gemm import w12_linear, w12_linear_ref

    n, k = shape
    w, records, escapes, packed = _encoded(n, k)
    assert escapes.index.numel() > 0
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    got = w12_linear(x, packed)
    want = w12_linear_ref(x, records, escapes)
    assert got.shape == want.shape == (rows, n) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2, rel_err(got, want)
    exact = x.double() @ w.double().T  # [rows, n]
    scale = x.double().abs() @ w.double().abs().T
    assert bool(((got.double() - exact).abs() <= 1e-2 * scale + 1e-30).all())
    assert torch.equal(got, w12_linear(x, packed))  # fixed reduction order: the same bits every call


@pytest.mark.parametrize("name,shape", [SHAPES[1], SHAPES[6], SHAPES[8]], ids=[SHAPES[i][0] for i in (1, 6, 8)])
def test_w12_gemm_rows_do_not_depend_on_the_batch(name, shape):
    from tandem.quant.w12_gemm import w12_linear

    n, k = shape
    _, _, _, packed = _encoded(n, k)
    x = torch.randn(70, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).to(torch.bfloat16)
    # (each kernel on its own: the GEMV (few rows) and the tensor-core kernel sum in different orders)
    full = w12_linear(x, packed, gemv_max_rows=0)  # [70, n]: two row groups, four blocks of 16 in the first
    for rows in (slice(0, 1), slice(3, 4), slice(0, 8), slice(16, 33), slice(40, 64), slice(69, 70)):
        assert torch.equal(w12_linear(x[rows], packed, gemv_max_rows=0), full[rows]), rows
    few = w12_linear(x[:8], packed, gemv_max_rows=8)  # [8, n] the GEMV kernel
    for rows in (slice(0, 1), slice(3, 4), slice(2, 7)):
        assert torch.equal(w12_linear(x[rows], packed, gemv_max_rows=8), few[rows]), rows


def test_w12_gemm_matches_its_cpu_emulation_and_handles_no_escapes():
    from tandem.quant.w12 import W12Escapes, W12Records, encode_w12
    from tandem.quant.w12_gemm import pack_w12, w12_linear, w12_linear_emulated

    for w in (realistic_weights(300, 200, seed=1), (torch.rand(256, 256, device="cuda") + 1).to(torch.bfloat16)):
        records, escapes = encode_w12(w)
        x = torch.randn(20, w.shape[1], device="cuda").to(torch.bfloat16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        got = w12_linear(x, pack_w12(records, escapes, "cuda"))
        r_cpu = W12Records(records.data.cpu(), records.base.cpu(), records.shape)
        e_cpu = W12Escapes(escapes.offsets.cpu(), escapes.index.cpu(), escapes.bits.cpu())
        emu = w12_linear_emulated(x.cpu(), r_cpu, e_cpu, sms=sms)  # the same split as the GPU's
        assert rel_err(got.cpu(), emu) < 1e-2, rel_err(got.cpu(), emu)
    assert escapes.index.numel() == 0  # the second matrix: no corrections at all
