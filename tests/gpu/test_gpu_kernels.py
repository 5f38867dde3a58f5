"""GPU lane: each Triton kernel of tandem.kernels.fused against its torch reference, at the
shapes decoding runs (the bundled pair's and the presets' widths; 1 row = an AR step, 33 rows =
a tree verify of N = 32, 128 rows = the largest row bucket), in fp32 and bf16.

On the CPU the dispatchers run the references themselves, so there is nothing to compare:
these tests are CUDA-only, and each asserts that the Triton path really ran.
"""
from __future__ import annotations

import pytest
import torch

from gpu_lane import NEEDS_CUDA, no_grad, rel_err
from tandem.bench.presets import PRESETS
from tandem.kernels import fused
from tandem.models.layers import rope_inv_freq
from tandem.models.loader import read_config
from tandem.runtime.pair import BUNDLED_DRAFT, BUNDLED_TARGET

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]

SHAPES = {"bundled-target": read_config(BUNDLED_TARGET), "bundled-draft": read_config(BUNDLED_DRAFT),
          "llama3-8b": PRESETS["llama3-8b"], "llama3.2-1b": PRESETS["llama3.2-1b"]}
ROWS = (1, 33, 128)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative (norm) error
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _randn(*shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=dtype)




@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rmsnorm(shape, rows, dtype):
    n = SHAPES[shape].hidden_size
    x, d = _randn(rows, n, dtype=dtype, seed=0), _randn(rows, n, dtype=dtype, seed=1)
    w = _randn(n, dtype=dtype, seed=2)
    assert fused.triton_enabled(x)
    want_sum, want_norm = fused.add_rmsnorm_ref(x, d, w, 1e-5)
    got_sum, got_norm = fused.add_rmsnorm(x.clone(), d, w, 1e-5)
    assert rel_err(got_sum, want_sum) < TOL[dtype] and rel_err(got_norm, want_norm) < TOL[dtype]
    _, got_plain = fused.add_rmsnorm(x.clone(), None, w, 1e-5)  # the first layer's: no delta to add
    assert rel_err(got_plain, fused.rmsnorm_ref(x, w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_embed_norms(shape, rows, dtype):
    """An EAGLE-3 layer's input in one kernel: the same bits as the two RMSNorm kernels it replaces."""
    n = SHAPES[shape].hidden_size
    embed, hidden = _randn(1000, n, dtype=dtype, seed=0), _randn(rows, n, dtype=dtype, seed=1)
    we, wh = _randn(n, dtype=dtype, seed=2), _randn(n, dtype=dtype, seed=3)
    ids = torch.randint(0, 1000, (rows,), device="cuda")
    x, hn = fused.embed_norms(ids, embed, hidden, we, wh, 1e-5)
    e_norm = fused.add_rmsnorm(embed[ids], None, we, 1e-5)[1]
    h_norm = fused.add_rmsnorm(hidden, None, wh, 1e-5)[1]
    assert torch.equal(x, torch.cat([e_norm, h_norm], dim=-1)) and torch.equal(hn, h_norm)
    want_x, want_hn = fused.embed_norms_ref(ids, embed, hidden, we, wh, 1e-5)
    assert rel_err(x, want_x) < TOL[dtype] and rel_err(hn, want_hn) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_mul(shape, rows, dtype):
    gu = _randn(rows, 2 * SHAPES[shape].intermediate_size, dtype=dtype, seed=3)  # [rows, gate | up]
    assert fused.triton_enabled(gu)
    assert rel_err(fused.silu_mul(gu), fused.silu_mul_ref(gu)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_store_kv(shape, rows, dtype, monkeypatch):
    """q rotated in place, k rotated into the cache rows `slots`, v copied there; no other row touched."""
    cfg = SHAPES[shape]
    H, Hk, D, cap = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 512
    qkv = _randn(1, rows, H + 2 * Hk, D, dtype=dtype, seed=4)  # [B, T, q | k | v heads, D]
    g = torch.Generator(device="cuda").manual_seed(5)
    positions = torch.randint(0, 4096, (1, rows), generator=g, device="cuda")
    slots = torch.randperm(cap, generator=g, device="cuda")[:rows][None]  # [1, T] distinct cache rows
    inv = rope_inv_freq(cfg).cuda()
    k0, v0 = _randn(1, Hk, cap, D, dtype=dtype, seed=6), _randn(1, Hk, cap, D, dtype=dtype, seed=7)
    got = (qkv.clone(), k0.clone(), v0.clone())
    want = (qkv.clone(), k0.clone(), v0.clone())
    assert fused.triton_enabled(qkv)
    fused.rope_store_kv(got[0], positions, inv, H, Hk, got[1], got[2], slots)
    monkeypatch.setenv("TANDEM_TRITON", "0")  # the same call on the torch path: the reference
    assert not fused.triton_enabled(qkv)
    fused.rope_store_kv(want[0], positions, inv, H, Hk, want[1], want[2], slots)
    assert rel_err(got[0][:, :, :H], want[0][:, :, :H]) < TOL[dtype]  # q heads
    for g_, w_ in zip(got[1:], want[1:]):  # k and v caches
        assert rel_err(g_, w_) < TOL[dtype]
    other = torch.ones(cap, dtype=torch.bool, device="cuda")
    other[slots[0]] = False
    assert torch.equal(got[1][:, :, other], k0[:, :, other]) and torch.equal(got[2][:, :, other], v0[:, :, other])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_in_place(shape, rows, dtype):
    """The uncached forward's RoPE (q and k heads in place, v heads untouched)."""
    cfg = SHAPES[shape]
    H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = _randn(1, rows, H + 2 * Hk, D, dtype=dtype, seed=8)
    positions = torch.randint(0, 4096, (1, rows), generator=torch.Generator(device="cuda").manual_seed(9),
                              device="cuda")
    inv = rope_inv_freq(cfg).cuda()
    got = qkv.clone()
    assert fused.triton_enabled(got)
    fused.rope_(got, positions, inv, H + Hk)
    assert rel_err(got[:, :, :H + Hk], fused.rope_ref(qkv[:, :, :H + Hk], positions, inv)) < TOL[dtype]
    assert torch.equal(got[:, :, H + Hk:], qkv[:, :, H + Hk:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_cached_attention(shape, rows, dtype):
    """tandem.kernels.attention: new rows over W cache columns under a boolean mask (a random
    tree-like mask, and the broadcast [1, 1, 1, W] prefix mask of an AR step), GQA heads, with
    the columns in one program and split across programs (flash-decoding)."""
    from tandem.kernels import attention

    cfg = SHAPES[shape]
    H, Hkv, D, W = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 300
    qkv = _randn(1, rows, H + 2 * Hkv, D, dtype=dtype, seed=1)
    q = qkv[:, :, :H]  # strided, as the layer passes it
    k = _randn(1, Hkv, W + 20, D, dtype=dtype, seed=2)[:, :, :W]
    v = _randn(1, Hkv, W + 20, D, dtype=dtype, seed=3)[:, :, :W]
    tree = torch.rand(1, 1, rows, W, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)) < 0.5
    tree[..., 0] = True
    for mask in (tree, torch.arange(W, device="cuda")[None, None, None] < 200):
        assert attention.applies(q, k, mask) == (rows <= attention.MAX_ROWS)
        want = attention.cached_attention_ref(q, k, v, mask)
        for splits in (1, 3, None):  # one program over the columns, three splits merged, the default
            got = attention.cached_attention(q, k, v, mask, splits=splits)
            assert got.shape == want.shape == (1, rows, H, D)
            assert rel_err(got, want) < TOL[dtype], (shape, rows, splits)


def _paged_segments(g: torch.Generator, free: list[int], block: int):
    """A pass of every kind of row: AR steps, trees, a prefill chunk and a batched-draft level
    (rows that see their ancestors among earlier reserved rows)."""
    from tandem.engine.batched_model import Segment

    def blocks_for(n):
        return [free.pop() for _ in range(-(-n // block))]

    def rint(lo, hi):
        return int(torch.randint(lo, hi, (), generator=g))

    segs = []
    for _ in range(5):  # AR steps over 1..300 columns
        L = rint(0, 300)
        segs.append(Segment.tree([1], [-1], L, blocks_for(L + 1)))
    for T in (33, 17):  # trees
        L = rint(1, 300)
        parents = [-1] + [rint(0, i) for i in range(1, T)]
        segs.append(Segment.tree([1] * T, parents, L, blocks_for(L + T)))
    L = rint(0, 100)  # a prefill chunk of 70 rows
    segs.append(Segment.chunk([1] * 70, L, blocks_for(L + 70), logits=True))
    L, base = rint(1, 200), 12  # a draft level: 4 rows after 12 earlier reserved rows
    bits = [(1 << rint(0, 4)) | (1 << rint(4, 8)) | 1 << (base + i) for i in range(4)]
    segs.append(Segment([1] * 4, [L + 3] * 4, blocks_for(L + base + 4), L + base + 4, True, L, bits))
    return segs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["every-kind", "one-ar-step", "one-tree", "one-level"])
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_attention(shape, which, dtype):
    """tandem.kernels.paged_attention over a paged pool with scattered blocks, against the SDPA
    reference over the padded per-request view (tandem.engine.batched_model.paged_attention_ref):
    a pass of every kind of row, and passes of one request each."""
    from tandem.engine.batched_model import BatchRows, paged_attention_ref
    from tandem.kernels import paged_attention as pk

    cfg = SHAPES[shape]
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    block, num_blocks = 16, 256
    g = torch.Generator().manual_seed(7)
    free = torch.randperm(num_blocks, generator=g).tolist()
    segs = _paged_segments(g, free, block)
    segs = {"every-kind": segs, "one-ar-step": segs[4:5], "one-tree": segs[5:6], "one-level": segs[-1:]}[which]
    rows = BatchRows.build(segs, torch.device("cuda"), dtype, block, tile_rows=pk.tile_rows(H, Hkv))
    M = rows.num_rows
    k = _randn(num_blocks * block, Hkv, D, dtype=dtype, seed=2)
    v = _randn(num_blocks * block, Hkv, D, dtype=dtype, seed=3)
    q = _randn(M, H + 2 * Hkv, D, dtype=dtype, seed=1)[:, :H]  # strided, as the layer passes it
    assert pk.applies(q, k, rows.words)
    got = pk.paged_attention(q, k, v, rows)
    want = paged_attention_ref(q, k, v, rows)
    assert got.shape == want.shape == (M, H, D)
    assert rel_err(got, want) < TOL[dtype], shape
