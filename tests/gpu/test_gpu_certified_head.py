"""GPU lane: the certified head's Triton kernels (tandem.kernels.certified_head) on a real GPU, bf16,
through the tl.dot path (bf16, 1-64 rows): the token is the head's argmax on
every row (its float64 logit is the maximum up to one bf16 rounding, and equal to the reference's
token wherever the top two differ by more than that), on random heads and adversarial near-ties,
also inside a CUDA graph (fixed shapes, no host sync). The CPU suite runs the same kernels through
Triton's interpreter (tests/certified_head_checks.py)."""
from __future__ import annotations

import pytest
import torch

from gpu_lane import NEEDS_CUDA, no_grad
from tandem.quant.int8_head import CertifiedHead, Int8Head

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]


def _head_and_rows(v: int, hdim: int, m: int, seed: int, near_ties: bool):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(v, hdim, generator=g, device="cuda") * torch.rand(v, 1, generator=g, device="cuda") * 0.05
    h = torch.randn(m, hdim, generator=g, device="cuda")
    if near_ties:  # rows 0..7 one row plus tiny perturbations; hidden rows aligned with it
        base = torch.randn(hdim, generator=g, device="cuda") * 0.05
        w[:8] = base + torch.randn(8, hdim, generator=g, device="cuda") * 1e-4
        h = base[None, :] * 40 + h * 0.01
    return w.to(torch.bfloat16), h.to(torch.bfloat16)


def _check(head: Int8Head, w: torch.Tensor, h: torch.Tensor, tok: torch.Tensor) -> None:
    exact = (h.double() @ w.double().T)  # [M, V]
    top2 = exact.topk(2, dim=-1).values
    ulp = top2[:, :1].abs() * 2.0**-7  # one bf16 rounding of the top logit
    got = exact.gather(1, tok[:, None])
    assert bool((got >= top2[:, :1] - ulp).all()), (got.squeeze(1), top2[:, 0])
    clear = (top2[:, 0] - top2[:, 1]) > 2 * ulp.squeeze(1)
    ref = head.argmax(h).token
    assert torch.equal(tok[clear], ref[clear])


@pytest.mark.parametrize("near_ties", [False, True], ids=["random", "near-ties"])
@pytest.mark.parametrize("m", [1, 3, 8, 33, 64])
def test_kernel_token_is_the_heads_argmax(m, near_ties):
    w, h = _head_and_rows(32000, 1024, m, seed=m, near_ties=near_ties)
    head = Int8Head(w)
    _check(head, w, h, head.token(h))


def test_certified_head_in_a_cuda_graph():
    """CertifiedHead.forward on CUDA (the kernels) captured in a graph and replayed on new rows."""
    w, h = _head_and_rows(50257, 768, 4, seed=3, near_ties=False)
    lin = torch.nn.Linear(768, 50257, bias=False, device="cuda", dtype=torch.bfloat16)
    lin.weight.copy_(w)
    head = CertifiedHead(lin)
    static = h.clone()
    head(static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head(static)
    for seed in (5, 6):
        _, h2 = _head_and_rows(50257, 768, 4, seed=seed, near_ties=False)
        static.copy_(h2)
        graph.replay()
        tok = out.argmax(-1)
        _check(head.int8, w, h2, tok)
        assert torch.equal(out.isfinite().sum(-1), torch.ones(4, dtype=torch.long, device="cuda"))
