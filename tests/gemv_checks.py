"""Checks of the one-row GEMV layer kernels (tandem.kernels.gemv), shared by tests/test_gemv.py.

They run the kernels on the CPU through Triton's interpreter (in a process of its own:
`TRITON_INTERPRET=1 python tests/gemv_checks.py`, what the test starts), in fp32, against the
torch references. Each check raises AssertionError on failure and prints one line when it passes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import fused_layer
from tandem.kernels import gemv as gv
from tandem.kernels.fused import add_rmsnorm_ref


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)
    assert err <= tol, (name, err)


class _Lifted:
    """The kernels' device test lifted (the interpreter stands in for CUDA), and every weight counted as
    large (so the small models' fused kernels never take them)."""

    def __enter__(self):
        self.saved = gv.triton_enabled, fused_layer.MAX_WEIGHT_BYTES
        gv.triton_enabled = lambda t: True
        fused_layer.MAX_WEIGHT_BYTES = 0

    def __exit__(self, *exc):
        gv.triton_enabled, fused_layer.MAX_WEIGHT_BYTES = self.saved


def check_gemv() -> None:
    """x @ W.T (and a final norm's x + delta, RMSNorm, then x @ W.T) over output widths that are not a multiple of the program's columns, inputs whose width
    is not a multiple of the loop's step (it halves until it divides), several launch shapes."""
    g = torch.Generator().manual_seed(0)
    with _Lifted():
        for N, K, launch in ((300, 128, (8, 64, 4)), (64, 192, (4, 128, 2)), (33, 256, (16, 512, 4)),
                             (512, 64, (8, 512, 4))):
            x, w = torch.randn(1, K, generator=g), torch.randn(N, K, generator=g)
            assert gv.applies(x, w)
            _close(f"gemv {N}x{K}", gv.gemv(x, w, launch), F.linear(x, w))
            d, ln = torch.randn(1, K, generator=g), 1 + 0.1 * torch.randn(K, generator=g)
            _close(f"norm_gemv {N}x{K}", gv.norm_gemv(x, d, ln, 1e-5, w, launch), gv.norm_gemv_ref(x, d, ln, 1e-5, w),
                   1e-4)
    print("gemv: ok")


def check_norm_gate_up() -> None:
    """(x + delta, SiLU(gate) * up of the normalised row) against the reference: the residual exact, the
    output to fp32 sums; with and without a delta."""
    g = torch.Generator().manual_seed(1)
    with _Lifted():
        for inter, K, launch in ((100, 128, (4, 64, 4)), (64, 256, (8, 128, 4))):
            for has_delta in (True, False):
                x = torch.randn(1, K, generator=g)
                d = torch.randn(1, K, generator=g) if has_delta else None
                ln = 1 + 0.1 * torch.randn(K, generator=g)
                w = torch.randn(2 * inter, K, generator=g) / K ** 0.5
                s_ref, y_ref = gv.norm_gate_up_silu_ref(x, d, ln, 1e-5, w)
                s, y = gv.norm_gate_up_silu(x, d, ln, 1e-5, w, launch)
                assert torch.equal(s, s_ref), (inter, K, has_delta)
                _close(f"gate/up {inter}x{K}", y, y_ref, 1e-4)
    print("norm_gate_up_silu: ok")


def check_norm_qkv() -> None:
    """q, and the K/V rows stored at the row's slot (rotated k), against the reference, for KVCache's
    layout and the paged pool's, with a bias, with a delta or an s_out; the residual written exactly;
    other cache rows untouched."""
    g = torch.Generator().manual_seed(2)
    with _Lifted():
        for nq, nkv, D, K, paged, bias, has_delta, s_out, cb in (
                (4, 2, 32, 128, False, False, True, False, 8), (4, 2, 64, 192, True, True, False, True, 16),
                (2, 1, 32, 64, False, True, True, True, 4), (4, 4, 32, 128, True, False, False, False, 16)):
            heads = nq + 2 * nkv
            x = torch.randn(1, K, generator=g)
            d = torch.randn(1, K, generator=g) if has_delta else None
            ln = 1 + 0.1 * torch.randn(K, generator=g)
            w = torch.randn(heads * D, K, generator=g) / K ** 0.5
            b = torch.randn(heads * D, generator=g) if bias else None
            pos, slot = torch.tensor([37]), torch.tensor([5])
            inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
            shape = (9, nkv, D) if paged else (1, nkv, 9, D)
            caches = [[torch.randn(*shape, generator=g) for _ in range(2)]]
            caches.append([c.clone() for c in caches[0]])
            outs = [None if not s_out else torch.zeros(1, K) for _ in range(2)]
            want = gv.norm_qkv_rope_store_ref(x, d, ln, 1e-5, w, b, pos, inv, nq, nkv, *caches[0], slot, outs[0])
            got = gv.norm_qkv_rope_store(x, d, ln, 1e-5, w, b, pos, inv, nq, nkv, *caches[1], slot, outs[1],
                                         launch=(cb, 64, 4))
            case = (nq, nkv, D, K, paged, bias, has_delta, s_out)
            assert torch.equal(got[0], want[0]), case
            if s_out:
                assert torch.equal(outs[1], outs[0]), case
            _close(f"q {case}", got[1], want[1], 1e-4)
            for c_got, c_want in zip(caches[1], caches[0]):
                _close(f"cache {case}", c_got, c_want, 1e-4)
                other = torch.ones(9, dtype=torch.bool)
                other[5] = False
                rows = (lambda c: c[other]) if paged else (lambda c: c[:, :, other])
                assert torch.equal(rows(c_got), rows(c_want)), case  # only the row's slot was written
    print("norm_qkv_rope_store: ok")


def _w12_matrix(N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """A bf16 [N, K] weight with what W12 has to escape: per-channel scales over a few decades and heavy
    tails (the realistic part), and in rows 0-3 and N/2 + 0-3 (both halves of a gate/up or q/k/v weight)
    zeros, a denormal, a channel mostly below one outlier's 16-binade window, and a channel of zeros."""
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g)) / K ** 0.5
    w = w * (1 + 20 * (torch.rand(N, K, generator=g) < 0.01))
    for r in (0, N // 2):
        w[r, :5] = 0.0
        w[r + 1, 3] = 1e-39  # (a bf16 denormal)
        w[r + 2] *= 1e-6
        w[r + 2, 0] = 100.0
        w[r + 3] = 0.0
    return w.bfloat16()


def check_w12() -> None:
    """Every kernel reading a W12 matrix (its records decoded in registers, its escape lists added after)
    gives what it gives with the decoded bf16 weight, to fp32 sums, the residuals exactly."""
    from tandem.quant.w12 import decode_w12, encode_w12, gemv_operand

    g = torch.Generator().manual_seed(4)

    def w12(N: int, K: int) -> tuple[torch.Tensor, object]:
        w = _w12_matrix(N, K, g)
        rec, esc = encode_w12(w)
        assert esc.index.numel() >= 8 and torch.equal(decode_w12(rec, esc), w)
        return w.float(), gemv_operand(rec, esc)

    def magnitudes(wf: torch.Tensor, op) -> torch.Tensor:
        """[N, K]: |w|, plus at each escaped slot the z_n = 2^(B_n - 127) that the record walk reads there and
        the escape takes away again (so a row's sum carries their cancellation too)."""
        z = torch.where(op.b7 > 0, torch.exp2((op.b7 >> 7).float() - 127), torch.zeros(()))
        mag = wf.abs()
        counts = (op.esc_off[1:] - op.esc_off[:-1]).long()
        rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
        mag[rows, op.esc_col[:len(rows)].long()] += z[rows]
        return mag

    with _Lifted():
        for N, K, launch in ((300, 128, (8, 64, 4)), (200, 256, (4, 128, 4)), (130, 192, (2, 128, 8))):
            wf, op = w12(N, K)
            x, d, ln = torch.randn(1, K, generator=g), torch.randn(1, K, generator=g), 1 + 0.1 * torch.randn(K, generator=g)
            x[0, 0] = d[0, 0] = 0.0  # (the outlier's column: rows 2 and N/2 + 2 are then sums of escapes alone)
            assert gv.applies(x, op)
            # each output to fp32 rounding of its own terms: |error| <= 1e-5 x sum |w| |input|, row by row
            mag = magnitudes(wf, op)
            got, want, scale = gv.gemv(x, op, launch), F.linear(x, wf), F.linear(x.abs(), mag)
            assert ((got - want).abs() <= 1e-5 * scale).all(), ((got - want).abs() / scale.clamp(min=1e-30)).max()
            h = add_rmsnorm_ref(x, d, ln, 1e-5)[1]
            got, want, scale = gv.norm_gemv(x, d, ln, 1e-5, op, launch), gv.norm_gemv_ref(x, d, ln, 1e-5, wf), \
                F.linear(h.abs(), mag)
            assert ((got - want).abs() <= 1e-5 * scale).all(), ((got - want).abs() / scale.clamp(min=1e-30)).max()
            inter = N // 2
            wf2, op2 = w12(2 * inter, K)
            s_ref, y_ref = gv.norm_gate_up_silu_ref(x, d, ln, 1e-5, wf2)
            s, y = gv.norm_gate_up_silu(x, d, ln, 1e-5, op2, launch)
            assert torch.equal(s, s_ref)
            _close(f"w12 gate/up {inter}x{K}", y, y_ref, 1e-5)
        nq, nkv, D, K = 4, 2, 32, 128
        wf, op = w12((nq + 2 * nkv) * D, K)
        x, d, ln = torch.randn(1, K, generator=g), torch.randn(1, K, generator=g), 1 + 0.1 * torch.randn(K, generator=g)
        pos, slot = torch.tensor([11]), torch.tensor([2])
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
        caches = [[torch.zeros(1, nkv, 4, D) for _ in range(2)] for _ in range(2)]
        want = gv.norm_qkv_rope_store_ref(x, d, ln, 1e-5, wf, None, pos, inv, nq, nkv, *caches[0], slot)
        got = gv.norm_qkv_rope_store(x, d, ln, 1e-5, op, None, pos, inv, nq, nkv, *caches[1], slot, launch=(8, 64, 4))
        assert torch.equal(got[0], want[0])
        _close("w12 q", got[1], want[1], 1e-5)
        for c_got, c_want in zip(caches[1], caches[0]):
            _close("w12 k/v cache", c_got, c_want, 1e-5)
    print("w12 gemv kernels: ok")


def check_decode() -> None:
    """A tiny model decoded greedily one row at a time through a runner (its layers' fused path, and the
    final norm with the LM head in one GEMV) with the GEMV kernels on gives the tokens, logits and target
    features of the same decode with them off."""
    from models_for_tests import tiny_model

    from tandem.runtime.runner import ModelRunner

    model = tiny_model(seed=3, hidden=128, layers=4).fuse_projections()
    model.enable_features()
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(3)).tolist()

    def decode() -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        runner = ModelRunner(model, capacity=64, use_graphs=False)
        with torch.no_grad():
            logits = runner.prefill(prompt)
            toks, rows, feats = [], [], []
            for i in range(10):
                toks.append(int(logits.argmax()))
                logits = runner.step(toks[-1:], [len(prompt) + i], torch.ones(1, 1, dtype=torch.bool))[0]
                runner.cache.commit([0])
                rows.append(logits.clone())
                feats.append(model.last_features.clone())
        return toks, rows, feats

    want = decode()
    with _Lifted():
        layer = model.model.layers[0]
        assert layer.fused(torch.zeros(1, 1, 128), ModelRunner(model, capacity=8, use_graphs=False).cache)
        got = decode()
    assert got[0] == want[0], (got[0], want[0])
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        _close(f"logits step {i}", a, b, 1e-4)
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        _close(f"features step {i}", a, b, 1e-5)
    print("one-row decode: ok")


def check_decode_w12() -> None:
    """A tiny bf16 model decoded greedily one row at a time, its one-row passes reading W12 copies of
    every projection and the LM head (Transformer.use_w12_gemv), gives the tokens and logits of the same
    decode reading the bf16 weights (the same kernels; only the weights' read differs)."""
    from models_for_tests import tiny_model

    from tandem.runtime.runner import ModelRunner

    model = tiny_model(seed=5, hidden=128, layers=3).to(torch.bfloat16).fuse_projections()
    prompt = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(5)).tolist()

    def decode() -> tuple[list[int], list[torch.Tensor]]:
        runner = ModelRunner(model, capacity=48, use_graphs=False)
        with torch.no_grad():
            logits = runner.prefill(prompt)
            toks, rows = [], []
            for i in range(8):
                toks.append(int(logits.float().argmax()))
                logits = runner.step(toks[-1:], [len(prompt) + i], torch.ones(1, 1, dtype=torch.bool))[0]
                runner.cache.commit([0])
                rows.append(logits.float().clone())
        return toks, rows

    with _Lifted():
        want = decode()
        stats = model.use_w12_gemv()
        assert model.head_w12 is not None and all(layer.mlp.w12 for layer in model.model.layers)
        got = decode()
    assert 0 <= stats["escape_rate"] < 0.01 and 12 < stats["bits_per_weight"] < 14, stats
    assert got[0] == want[0], (got[0], want[0])
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        _close(f"w12 logits step {i}", a, b, 1e-2)
    print("one-row decode through W12 copies: ok")


if __name__ == "__main__":
    check_gemv()
    check_norm_gate_up()
    check_norm_qkv()
    check_decode()
    check_w12()
    check_decode_w12()
