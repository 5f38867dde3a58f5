"""GPU lane: the batched level tree's Triton glue (tandem.kernels.level_tree) equals its torch
reference bit for bit: the fed picks with ties and -inf log-probs (a stable sort's order), the
ancestor bits, the pass's row fields, and the children's tokens, parents and summed log-probs."""
from __future__ import annotations

import os

import pytest
import torch

from gpu_lane import NEEDS_CUDA
from tandem.kernels import level_tree

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # (the interpreter, for development)


def _nodes(R: int, n_all: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.randint(0, 6, (R, n_all), generator=g).float() / 4  # few distinct values: many ties
    lp[torch.rand(R, n_all, generator=g) < 0.1] = float("-inf")
    lp[0, :] = float("-inf")  # a request whose nodes are all -inf
    lp[1, :] = float("nan")  # one whose nodes are all NaN (a padding request's garbage)
    lp[2, torch.rand(n_all, generator=g) < 0.3] = float("nan")  # NaN among numbers: ranked last, as a sort does
    tok = torch.randint(0, 1000, (R, n_all), generator=g)
    return tok.to(DEVICE), lp.to(DEVICE)


@NEEDS_CUDA if DEVICE == "cuda" else (lambda f: f)
@pytest.mark.cuda
@pytest.mark.parametrize("w", [1, 3, 4, 8])
def test_level_feed_and_children_equal_the_reference(w):
    R, depth = 5, 4
    n_all = w + (depth - 1) * w * w
    tok, lp = _nodes(R, n_all, seed=w)
    par = torch.full((R, n_all), -1, dtype=torch.long, device=DEVICE)
    M, L = R * w, depth - 1
    positions = torch.randint(0, 500, (L, M), device=DEVICE)
    slots = torch.randint(0, 5000, (L, M), device=DEVICE)
    seq_len = torch.randint(0, 500, (L, R), device=DEVICE)
    d2t = torch.randint(0, 50, (1000,), device=DEVICE)
    ref_tok, ref_par, ref_lp = tok.clone(), par.clone(), lp.clone()
    ref_bits = torch.zeros(R, w, dtype=torch.long, device=DEVICE)
    bits, bits_next = ref_bits.clone(), torch.empty_like(ref_bits)
    fed, parent = (torch.empty(R, w, dtype=torch.long, device=DEVICE) for _ in range(2))
    W = 2  # mask words a row has (the kernel writes word 0)
    rows = torch.full((M * (3 + W) + R,), -7, dtype=torch.long, device=DEVICE)  # tokens, positions, slots, bits, seq_len
    rt, rp, rs = rows[:M], rows[M:2 * M], rows[2 * M:3 * M]
    rb, rq = rows[3 * M:3 * M + M * W].view(M, W), rows[3 * M + M * W:]
    g = torch.Generator().manual_seed(1)
    lo, hi = 0, w
    for d in range(1, depth):
        first = d == 1
        own = torch.bitwise_left_shift(torch.ones(w, dtype=torch.long, device=DEVICE), (d - 1) * w + torch.arange(w, device=DEVICE))
        r_fed, r_parent, ref_bits, r_toks = level_tree.level_feed_ref(ref_tok, ref_lp, lo, hi, w, ref_bits, own, first)
        level_tree.level_feed(tok, lp, lo, hi, w, bits, bits_next, (d - 1) * w, first, fed, parent, rt, rp, rs, rb, rq,
                              positions[d - 1], slots[d - 1], seq_len[d - 1])
        bits, bits_next = bits_next, bits
        assert torch.equal(fed, r_fed), (d, fed, r_fed)
        if not first:
            assert torch.equal(parent, r_parent)
        assert torch.equal(bits, ref_bits)
        assert torch.equal(rt, r_toks.flatten()) and torch.equal(rp, positions[d - 1]) and torch.equal(rs, slots[d - 1])
        assert torch.equal(rb[:, 0], ref_bits.flatten()) and torch.equal(rb[:, 1], torch.full_like(rb[:, 1], -7))
        assert torch.equal(rq, seq_len[d - 1])
        clp = (-torch.rand(M, w, generator=g)).sort(dim=1, descending=True).values.to(DEVICE)
        ctok = torch.randint(0, 1000, (M, w), generator=g).to(DEVICE)
        lo, hi = hi, hi + w * w
        level_tree.level_children_ref(ref_tok, ref_par, ref_lp, r_fed, ctok + d2t[ctok], clp, lo)
        level_tree.level_children(tok, par, lp, fed, ctok, clp, lo, d2t)
        assert torch.equal(tok, ref_tok) and torch.equal(par, ref_par)
        assert torch.equal(lp.nan_to_num(nan=7.0, neginf=-1e30), ref_lp.nan_to_num(nan=7.0, neginf=-1e30))
