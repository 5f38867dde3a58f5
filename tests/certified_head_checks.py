"""Checks of the certified head's Triton kernels (tandem.kernels.certified_head), shared by
tests/test_int8_head.py: run on the CPU through Triton's interpreter, which must be switched on
before Triton is imported, so they run in a process of their own:
`TRITON_INTERPRET=1 python tests/certified_head_checks.py`. Each check raises AssertionError on
failure; the script prints one line per passed check.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from tandem.kernels import certified_head as ck
from tandem.quant.int8_head import Int8Head


def _kernel_tokens(head: Int8Head, h: torch.Tensor, **knobs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ck.certified_argmax_triton(h, head.q, head.scale, head.gpu_coef, head.weight, head.u_dt, **knobs)


def _near_ties(v: int, hdim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose rows 0..7 are one row plus perturbations far below the INT8 error, and hidden
    states aligned with that row, so the top logits differ by less than the certificate's slack;
    row 8 duplicates row 3 (an exact tie: the smaller token must win)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, hdim, generator=g) * 0.05
    base = torch.randn(hdim, generator=g) * 0.05
    w[:8] = base + torch.randn(8, hdim, generator=g) * 1e-4
    w[8] = w[3]
    w = w.to(dtype)
    h = (base[None, :] * 40 + torch.randn(6, hdim, generator=g) * 0.01).to(dtype)
    return w, h


def check_tokens_equal_the_reference() -> None:
    """Random heads and hidden rows, 1-7 rows, fp32 (the interpreter's bf16 is not the GPU's):
    the kernels' token, survivors and exact logit are the reference's (Int8Head.argmax)."""
    for seed, (v, hdim, m) in enumerate([(3000, 96, 1), (2500, 200, 3), (4099, 64, 7)]):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(v, hdim, generator=g) * torch.rand(v, 1, generator=g)
        h = torch.randn(m, hdim, generator=g) * 3
        head = Int8Head(w)
        ref = head.argmax(h)
        tok, val, count = _kernel_tokens(head, h, bv=32, bk=64)
        assert torch.equal(tok, ref.token), (seed, tok, ref.token)
        assert torch.equal(tok, F.linear(h, w).argmax(-1)), seed
        # (its own fp32 order: the last bits may differ from F.linear's)
        torch.testing.assert_close(val, ref.logits.gather(1, ref.token[:, None]).squeeze(1), rtol=1e-5, atol=1e-5)
        # (its fp32 bounds are wider than the reference's float64 ones: never fewer survivors)
        assert bool((count.long() >= ref.survivors.sum(-1)).all()), (count, ref.survivors.sum(-1))


def check_the_dot_path_and_bf16_rows() -> None:
    """The tl.dot path (forced, fp32: the interpreter's int8 -> bf16 conversion is not the GPU's)
    with 1, 6 and 20 rows, and a bf16 head's rows through FMAs (forced): the tokens are the reference's."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1200, 64, generator=g) * 0.05
    h = torch.randn(20, 64, generator=g) * 4
    head = Int8Head(w)
    for m in (1, 6, 20):
        tok, _, count = _kernel_tokens(head, h[:m], bv=32, bk=32, use_dot=True)
        ref = head.argmax(h[:m])
        assert torch.equal(tok, ref.token), m
        assert bool((count.long() >= ref.survivors.sum(-1)).all()), m
    head16 = Int8Head(w.to(torch.bfloat16))
    tok, _, _ = _kernel_tokens(head16, h[:2].to(torch.bfloat16), bv=32, bk=32, use_dot=False)
    assert torch.equal(tok, head16.argmax(h[:2].to(torch.bfloat16)).token)


def check_near_ties_and_exact_ties() -> None:
    """Adversarial near-ties (top logits closer than the INT8 error) and an exact tie between two
    equal rows: the token is the full head's argmax (the first on ties), through both paths."""
    for seed in range(3):
        w, h = _near_ties(1500, 128, torch.float32, seed)
        head = Int8Head(w)
        full = F.linear(h, w)
        for m in (1, 6):
            tok, _, count = _kernel_tokens(head, h[:m], bv=16, bk=32)
            assert torch.equal(tok, full[:m].argmax(-1)), (seed, m, tok, full[:m].argmax(-1))
            assert int(count.min()) >= 2, count  # the near-ties survive: the rescoring decides
    w = torch.zeros(300, 64)
    w[5] = w[9] = 1.0
    tok, _, _ = _kernel_tokens(Int8Head(w), torch.ones(2, 64), bv=16, bk=32)
    assert tok.tolist() == [5, 5], tok


def check_a_zero_row_rescores_everything() -> None:
    """h = 0: every logit is 0 and every token survives; the first token wins."""
    w = torch.randn(700, 48)
    tok, _, count = _kernel_tokens(Int8Head(w), torch.zeros(1, 48), bv=16, bk=16)
    assert tok.tolist() == [0] and count.tolist() == [700], (tok, count)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (the kernels then run on the CPU)"
    for name, fn in list(globals().items()):
        if name.startswith("check_"):
            fn()
            print(f"{name}: ok", flush=True)
    sys.exit(0)
