"""Checks of the fused decoder-layer kernels (tandem.kernels.fused_layer), shared by
tests/test_fused_layer.py.

They run the kernels on the CPU through Triton's interpreter (which reads TRITON_INTERPRET when
Triton is imported, so in a process of its own: `TRITON_INTERPRET=1 python tests/fused_layer_checks.py`,
what the test starts), in fp32 (the interpreter's bf16 is not the GPU's), against the unfused
references: row counts across the 16-row blocks, K not a power of two, with and without the
residual delta and the q/k/v bias, K/V rows at scattered cache slots with every other row left
as it was. Each check raises AssertionError on failure; the script prints one line per passed check.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import fused_layer as fl

def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of fp32 sums: a relative (norm) error under 4e-6 (a model's passes sum in another
    order in every projection of every layer; a wrong row, column or mask gives errors of 1e-3 and more)."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert err < 4e-6, (name, err)


def check_norm_qkv() -> None:
    g = torch.Generator().manual_seed(0)
    n_q, n_kv, D, cap = 3, 1, 64, 70
    for M, K, delta, bias, norm in ((1, 96, True, False, True), (5, 96, False, True, True),
                                    (33, 160, True, True, True), (17, 96, False, False, False)):
        x = torch.randn(M, K, generator=g)
        d = torch.randn(M, K, generator=g) if delta else None
        ln_w = 1 + 0.1 * torch.randn(K, generator=g) if norm else None
        w = torch.randn((n_q + 2 * n_kv) * D, K, generator=g) / K ** 0.5
        b = torch.randn(w.shape[0], generator=g) if bias else None
        pos = torch.randint(0, 400, (M,), generator=g)
        slots = torch.randperm(cap, generator=g)[:M]
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D)).float()
        caches = [torch.randn(2, 1, n_kv, cap, D, generator=g) for _ in range(2)]  # (kernel's, reference's)
        caches[1].copy_(caches[0])
        s_ref, q_ref = fl.norm_qkv_rope_store_ref(x.clone(), d, ln_w, 1e-5, w, b, pos, inv, n_q, n_kv,
                                                  caches[1][0], caches[1][1], slots)
        feats = torch.zeros(M, 3 * K)  # the residual written into a strided slice (a target-feature buffer)
        s_out = feats[:, K:2 * K] if M != 5 else None
        # a loop of steps over K, one step; two programs a head, one; the first weight step before or after
        # the PDL wait
        for bk, cb, pre in ((32, 16, True), (256, 32, False)):
            kv = caches[0].clone()
            s, q = fl.launch_norm_qkv(x.clone(), d, ln_w, 1e-5, w, b, pos, inv, n_q, n_kv, kv[0], kv[1], slots,
                                      s_out, bk=bk, cb=cb, pre=pre)
            _close("residual", s, s_ref)
            if s_out is not None:
                assert s.data_ptr() == s_out.data_ptr() and not feats[:, :K].any() and not feats[:, 2 * K:].any()
            _close("q", q, q_ref)
            _close("k/v cache", kv, caches[1])  # the rows at `slots` written alike, every other row untouched
            untouched = torch.ones(cap, dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(kv[..., untouched, :], caches[1][..., untouched, :])
    # the paged pool's layout, [slots, n_kv, D]
    M, K = 9, 96
    x, d = torch.randn(M, K, generator=g), torch.randn(M, K, generator=g)
    ln_w = 1 + 0.1 * torch.randn(K, generator=g)
    w = torch.randn((n_q + 2 * n_kv) * D, K, generator=g) / K ** 0.5
    pos = torch.randint(0, 400, (M,), generator=g)
    slots = torch.randperm(cap, generator=g)[:M]
    pools = [torch.randn(2, cap, n_kv, D, generator=g) for _ in range(2)]
    pools[1].copy_(pools[0])
    s_ref, q_ref = fl.norm_qkv_rope_store_ref(x, d, ln_w, 1e-5, w, None, pos, inv, n_q, n_kv, pools[1][0], pools[1][1],
                                              slots)
    s, q = fl.launch_norm_qkv(x, d, ln_w, 1e-5, w, None, pos, inv, n_q, n_kv, pools[0][0], pools[0][1], slots)
    _close("paged residual", s, s_ref)
    _close("paged q", q, q_ref)
    _close("paged k/v", pools[0], pools[1])
    print("norm_qkv_rope_store: ok")


def check_norm_gate_up() -> None:
    g = torch.Generator().manual_seed(1)
    for M, K, inter, delta in ((1, 96, 80, True), (17, 160, 48, False), (40, 64, 1040, True)):
        x = torch.randn(M, K, generator=g)
        d = torch.randn(M, K, generator=g) if delta else None
        ln_w = 1 + 0.1 * torch.randn(K, generator=g)
        w = torch.randn(2 * inter, K, generator=g) / K ** 0.5
        s_ref, a_ref = fl.norm_gate_up_silu_ref(x, d, ln_w, 1e-5, w)
        for bk, pre in ((32, True), (256, False)):  # (pre: the first weight step before or after the PDL wait)
            s, a = fl.launch_norm_gate_up(x, d, ln_w, 1e-5, w, bk=bk, pre=pre)
            _close("residual", s, s_ref)
            _close("silu(gate) * up", a, a_ref)
    print("norm_gate_up_silu: ok")


def check_linear() -> None:
    """The o_proj / down_proj kernel equals F.linear over row blocks, widths that are not a multiple of its
    column block or of its loop step, and a strided row slice."""
    g = torch.Generator().manual_seed(4)
    for M, K, N in ((1, 96, 80), (17, 160, 48), (40, 1024, 384)):
        x = torch.randn(M + 3, K, generator=g)[3:]
        w = torch.randn(N, K, generator=g) / K ** 0.5
        for bk, bn, pre in ((32, 16, True), (256, 64, False)):
            _close(f"linear {M}x{K}x{N}", fl.launch_linear(x, w, bk=bk, bn=bn, pre=pre), F.linear(x, w))
    print("linear: ok")


def _passes(model) -> list[torch.Tensor]:
    """Logits of a 7-token prefill and a 4-node tree after it ([-1, 0, 0, 1]), through a KVCache,
    and the cache's K/V at the end."""
    from tandem.kv.cache import KVCache

    cache = KVCache.for_model(model, 32)
    g = torch.Generator().manual_seed(2)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (1, 7), generator=g)
    pos = torch.arange(7)[None]
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    out = [model(ids, pos, cache, pos.clone(), causal)[0]]
    if model.feature_layers:
        out.append(model.last_features.clone())
    tree = torch.randint(0, V, (1, 4), generator=g)
    tpos = torch.tensor([[7, 8, 8, 9]])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 7, dtype=torch.bool), anc], dim=1)[None, None]  # [1, 1, 4, 11]
    out.append(model(tree, tpos, cache, torch.arange(7, 11)[None], mask)[0])
    if model.feature_layers:
        out.append(model.last_features.clone())
    out.append(cache.kv[..., :11, :].clone())
    return out


def check_model() -> None:
    """A Transformer's passes through the fused layers (the interpreter standing in for CUDA: the
    dispatchers' device test lifted) equal its unfused passes: the glue (views, strides, cache
    layout, the bool mask kept for the attention kernel) is checked, not only the kernels."""
    from models_for_tests import tiny_model

    import tandem.kernels.attention as att
    import tandem.models.layers as layers
    import tandem.models.transformer as tr

    for family, feats in (("llama", None), ("qwen2", None), ("llama", (1, 1, 0)), ("llama", (2, 0, 1))):
        # (qwen2: q/k/v bias; feature layers: one named twice, layer 0 (no delta to add), out of order)
        model = tiny_model(seed=3, hidden=128, family=family, layers=3).fuse_projections()  # head_dim 32
        if feats:
            model.enable_features(feats)
        want = _passes(model)
        calls = []
        saved = fl.applies, att.triton_enabled, tr.triton_enabled, layers.fused_layer_forward

        def counted(*a, **k):
            calls.append(1)
            return saved[3](*a, **k)

        fl.applies = lambda x, w, k=None: x.shape[0] <= fl.MAX_M and w.shape[1] == (x.shape[-1] if k is None else k)
        att.triton_enabled = tr.triton_enabled = lambda t: True
        tr.fused_layer_forward = counted
        try:
            got = _passes(model)
        finally:
            fl.applies, att.triton_enabled, tr.triton_enabled, tr.fused_layer_forward = saved
        assert len(calls) == 2 * model.config.num_hidden_layers, calls  # every layer of both passes was fused
        assert len(got) == len(want) == (5 if feats else 3)
        for n, (a, b) in enumerate(zip(got, want)):
            _close(f"{family} {feats} output {n}", a, b)
    print("model through the fused layers: ok")


def check_eagle3_layer() -> None:
    """An EAGLE-3 head's layer (q/k/v over [embedding, hidden], no norm in the projection's kernel)
    through the fused kernels equals its unfused layer: logits, output hidden and K/V."""
    from models_for_tests import random_eagle3_head, tiny_model

    import tandem.kernels.attention as att
    from tandem.kv.cache import KVCache

    target = tiny_model(seed=4, hidden=128)
    tc = target.config
    head = random_eagle3_head(target, seed=5)

    def passes() -> list[torch.Tensor]:
        cache = KVCache.for_model(head, 16)
        ids = torch.randint(0, tc.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
        hidden = torch.randn(1, 5, tc.hidden_size, generator=torch.Generator().manual_seed(7))
        pos = torch.arange(3, 8)[None]
        mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
        logits, out = head.layer(ids, hidden, pos, cache, torch.arange(5)[None], mask)
        return [logits, out, cache.kv[..., :5, :].clone()]

    want = passes()
    saved = fl.applies, att.triton_enabled
    fl.applies = lambda x, w, k=None: x.shape[0] <= fl.MAX_M and w.shape[1] == (x.shape[-1] if k is None else k)
    att.triton_enabled = lambda t: True
    calls = []
    real = head._fused_layer
    head._fused_layer = lambda *a: calls.append(1) or real(*a)
    try:
        got = passes()
    finally:
        fl.applies, att.triton_enabled = saved
    assert calls == [1]
    for name, a, b in zip(("logits", "hidden out", "K/V"), got, want):
        _close(f"EAGLE-3 {name}", a, b)
    print("EAGLE-3 layer through the fused kernels: ok")


def check_batched_model() -> None:
    """The batched engine's pass (BatchedModel over the paged pool: two requests' prefill chunks in one
    pass, then a tree beside a decode row) through the fused layers equals its unfused pass: logits,
    the features a feature drafter reads, and the pool's K/V."""
    from models_for_tests import tiny_model

    from tandem.engine.batched_model import BatchedModel, Segment
    from tandem.kv.paged import PagedKVPool

    model = tiny_model(seed=8, hidden=128, layers=3).fuse_projections()
    model.enable_features((2, 0, 1))
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 5))

    def passes() -> list[torch.Tensor]:
        pool = PagedKVPool.for_model(model, num_blocks=16, block_size=8)
        bm = BatchedModel(model, pool, features=True)
        out = []
        for segs in ([Segment.chunk(a, 0, [0, 1], logits=True), Segment.chunk(b, 0, [2], logits=True)],
                     [Segment.tree([3, 4, 5], [-1, 0, 0], 9, [0, 1]), Segment.chunk([7], 5, [2], logits=True)]):
            out.append(bm.forward(bm.rows(segs)).clone())
            out.append(bm.last_features.clone())
        return out + [pool.kv.clone()]

    want = passes()
    saved = fl.applies
    calls = []
    real = BatchedModel._fused_layer
    BatchedModel._fused_layer = lambda self, *a: calls.append(1) or real(self, *a)
    fl.applies = lambda x, w, k=None: x.shape[0] <= fl.MAX_M and w.shape[1] == (x.shape[-1] if k is None else k)
    try:
        got = passes()
    finally:
        fl.applies, BatchedModel._fused_layer = saved, real
    assert len(calls) == 6, calls  # 3 layers x 2 passes
    for n, (x, y) in enumerate(zip(got, want)):
        _close(f"batched output {n}", x, y)
    print("batched model through the fused layers: ok")


if __name__ == "__main__":
    check_norm_qkv()
    check_norm_gate_up()
    check_linear()
    check_model()
    check_eagle3_layer()
    check_batched_model()
