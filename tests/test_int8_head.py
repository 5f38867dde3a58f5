"""The certified INT8 LM head: its argmax equals the full-precision head's on every row (random
heads, the bundled target's hidden states, and adversarial near-ties), while rescoring only a small
fraction of the vocabulary."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.quant.int8_head import Int8Head, _gamma
from tandem.runtime.pair import load_pair
from triton_interpreter import NEEDS_TRITON, run_checks

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
PROMPTS = ["def fib(n):", "import os\n\n\ndef list_python_files(root):\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):\n    print(", 'with open("data.txt") as f:\n    for line in f:\n']


def _check(head: Int8Head, h: torch.Tensor) -> float:
    """Certified argmax == full head's argmax on every row; survivors' logits are the full head's
    up to the GEMM's own rounding (two orders of one fp32 sum, each then rounded to the dtype: the
    BLAS picks its order by the matrix's shape, so a subset of rows is not bitwise the full head
    on every CPU). Returns the mean fraction of the vocabulary rescored."""
    full = F.linear(h, head.weight)  # [B, V]
    got = head.argmax(h)
    assert torch.equal(got.token, full.argmax(dim=-1))
    gamma = _gamma(head.weight.shape[1])
    dot = h.double().norm(dim=-1, keepdim=True) * head.weight.double().norm(dim=-1)  # [B, V] |h| |w_v|
    tol = 2 * (gamma * dot + head.u_dt * full.double().abs() * 1.01)  # [B, V]
    diff = (got.logits.double() - full.double()).abs()
    assert bool((diff[got.survivors] <= tol[got.survivors]).all())
    assert bool(got.survivors.gather(1, got.token[:, None]).all())
    return got.rescored_fraction


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("crowd", [0.0, 0.02, 0.002])  # rows from independent to nearly identical
def test_random_heads(dtype, crowd):
    g = torch.Generator().manual_seed(int(crowd * 1000))
    rows = torch.randn(4096, 256, generator=g) * (0.5 + torch.rand(4096, 1, generator=g))  # [V, H]
    if crowd:  # one shared direction plus a small spread: many logits within the int8 error of the top
        rows = torch.randn(1, 256, generator=g) + crowd * rows
    w = (rows * 0.05).to(dtype)
    h = torch.randn(96, 256, generator=g).to(dtype)
    frac = _check(Int8Head(w), h)
    if not crowd:
        assert frac < 0.01, frac  # well separated logits: nearly everything is pruned
    elif crowd < 0.01:
        assert frac > 0.05, frac  # the crowded case really exercises the rescoring


@pytest.mark.parametrize("dtype", DTYPES)
def test_bundled_target_hidden_states(dtype):
    pair = load_pair(dtype="float32" if dtype == torch.float32 else "bfloat16", need_draft=False)
    model = pair.target
    with torch.no_grad():
        h = torch.cat([model.hidden_states(torch.tensor([pair.tokenizer.encode(p).ids]))[0] for p in PROMPTS])
    assert h.shape[0] > 40 and h.dtype == dtype  # [rows, hidden]
    frac = _check(Int8Head(model.lm_head.weight), h)
    print(f"bundled target ({dtype}): mean fraction of the vocabulary rescored {frac:.2e} "
          f"({frac * model.lm_head.weight.shape[0]:.2f} of {model.lm_head.weight.shape[0]} tokens per row)")
    assert frac < 0.01, frac


@pytest.mark.parametrize("dtype", DTYPES)
def test_adversarial_near_ties(dtype):
    hidden, vocab = 64, 512
    g = torch.Generator().manual_seed(7)
    h = torch.randn(1, hidden, generator=g)
    h[0, 0] = 0.0  # column 0 carries a large weight that h ignores: it only coarsens a row's int8 scale
    sgn = torch.sign(h[0])
    w = torch.randn(vocab, hidden, generator=g) * 0.01
    # row 3: int8 scale s = 2^-6 (its column-0 element is 127 s); every other element is 9.5625 s, which
    # rounds up to 10 s. Row 11 is 9.75 s everywhere: really larger than row 3, but its int8 logit is
    # smaller. Every value here is exact in bf16.
    s_b = 2.0**-6
    w[3] = sgn * s_b * 9.5625
    w[3, 0] = 127 * s_b
    w[11] = sgn * s_b * 9.75
    w[11, 0] = 0.0
    w[20] = w[11]  # an exact tie with row 11: the first index wins
    w[30] = w[11]
    w[30, 1] += 1e-7 * sgn[1]  # a one-ulp-scale nudge: larger or equal depending on rounding
    for r in range(40, 80):  # a crowd just below the top
        w[r] = w[11] * (1 - 1e-3 * (r - 39))
    w, h = w.to(dtype), h.to(dtype)
    head = Int8Head(w)
    full = F.linear(h, w)[0]
    approx = head.approx_logits(h)[0]
    assert int(approx.argmax()) == 3 and int(full.argmax()) != 3  # the plain int8 head picks the wrong token
    _check(head, h)
    rows = torch.cat([h, h * 1.0001, -h, h * 1e-3]).to(dtype)  # the same ties at other scales
    _check(head, rows)


def test_non_finite_hidden_state_falls_back_to_the_full_head():
    w = torch.randn(100, 16)
    h = torch.randn(2, 16)
    h[1, 3] = float("nan")
    got = Int8Head(w).argmax(h)
    assert bool(got.survivors[1].all()) and int(got.token[0]) == int(F.linear(h[:1], w).argmax())


@pytest.mark.parametrize("dtype", DTYPES)
def test_certified_head_greedy_decoding_equals_ar_on_the_bundled_target(dtype):
    """The opt-in transform (use_certified_head): greedy decoding through the certified head gives the
    full head's tokens, token for token: `ar` equals `ar`, and `tree` equals `tree` (in bf16 the bundled
    pair's `tree` and `ar` themselves part at a near-tie on one prompt, which the head does not change).
    certified_argmax equals the full head's argmax on every row of the run."""
    from tandem.config import GenerationConfig, SpecConfig
    from tandem.quant.int8_head import CertifiedHead, certified_argmax, use_certified_head
    from tandem.runtime.generate import Generator

    name = "float32" if dtype == torch.float32 else "bfloat16"
    plain, certified = load_pair(dtype=name), load_pair(dtype=name)
    assert use_certified_head(certified.target) is certified.target
    use_certified_head(certified.target)  # idempotent
    assert isinstance(certified.target.lm_head, CertifiedHead)
    gen = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    with torch.no_grad():
        for prompt in PROMPTS[:3]:
            ids = plain.tokenizer.encode(prompt).ids
            want = {m: Generator(plain.target, plain.draft, plain.tokenizer).generate(
                ids, m, spec=SpecConfig(nodes=16), gen=gen).token_ids for m in ("ar", "tree")}
            engine = Generator(certified.target, certified.draft, certified.tokenizer)
            for method in ("ar", "tree"):
                got = engine.generate(ids, method, spec=SpecConfig(nodes=16), gen=gen).token_ids
                assert got == want[method] and len(got) == 32, (prompt, method)
            if dtype == torch.float32:
                assert want["tree"] == want["ar"]
            want = want["ar"]
            h = plain.target.hidden_states(torch.tensor([ids + want]))[0]  # [T, H]
            assert torch.equal(certified_argmax(plain.target, h), F.linear(h, plain.target.lm_head.weight).argmax(-1))


@NEEDS_TRITON
def test_certified_head_kernels_under_the_triton_interpreter():
    """The GPU kernels (tandem.kernels.certified_head) give the reference's token on random heads,
    adversarial near-ties, exact ties (the first token) and a zero hidden row (every token
    rescored), through the FMA and the tl.dot paths (tests/certified_head_checks.py)."""
    run_checks("certified_head_checks.py", 4)
