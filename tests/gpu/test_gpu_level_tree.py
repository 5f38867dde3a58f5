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
@torch.no_grad()  # (the engine runs without grad; with it, triton_enabled sends the dispatchers to torch)
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
    W = 2  # mask words a row has (both write word 0)

    def buffers():  # fed rows' bits (in, out), fed, parent; the pass's rows: tokens, positions, slots, bits, seq_len
        bits = torch.zeros(R, w, dtype=torch.long, device=DEVICE)
        fed, parent = (torch.full((R, w), -5, dtype=torch.long, device=DEVICE) for _ in range(2))
        rows = torch.full((M * (3 + W) + R,), -7, dtype=torch.long, device=DEVICE)
        return [bits, torch.empty_like(bits), fed, parent, rows]

    got, want = buffers(), buffers()
    if DEVICE == "cuda":
        assert level_tree.triton_enabled(lp)  # (the dispatchers take the kernels)
    g = torch.Generator().manual_seed(1)
    lo, hi = 0, w
    for d in range(1, depth):
        first = d == 1
        for fn, (t, l, b) in ((level_tree.level_feed_triton, (tok, lp, got)),
                              (level_tree.level_feed_ref, (ref_tok, ref_lp, want))):
            rows = b[4]
            fn(t, l, lo, hi, w, b[0], b[1], (d - 1) * w, first, b[2], b[3], rows[:M], rows[M:2 * M],
               rows[2 * M:3 * M], rows[3 * M:3 * M + M * W].view(M, W), rows[3 * M + M * W:],
               positions[d - 1], slots[d - 1], seq_len[d - 1])
            b[0], b[1] = b[1], b[0]
        assert torch.equal(got[2], want[2]), (d, got[2], want[2])  # fed
        assert torch.equal(got[3], want[3])  # parent rows (untouched at the first level)
        assert torch.equal(got[0], want[0])  # the new bits
        assert torch.equal(got[4], want[4])  # the pass's rows, word 1 of the masks untouched
        rows = got[4]
        assert torch.equal(rows[:M], tok.gather(1, got[2]).flatten())
        assert torch.equal(rows[M:2 * M], positions[d - 1]) and torch.equal(rows[2 * M:3 * M], slots[d - 1])
        assert torch.equal(rows[3 * M:3 * M + M * W].view(M, W)[:, 1], torch.full((M,), -7, device=DEVICE))
        assert torch.equal(rows[3 * M + M * W:], seq_len[d - 1])
        clp = (-torch.rand(M, w, generator=g)).sort(dim=1, descending=True).values.to(DEVICE)
        ctok = torch.randint(0, 1000, (M, w), generator=g).to(DEVICE)
        lo, hi = hi, hi + w * w
        level_tree.level_children_ref(ref_tok, ref_par, ref_lp, want[2], ctok, clp, lo, d2t)
        level_tree.level_children_triton(tok, par, lp, got[2], ctok, clp, lo, d2t)
        assert torch.equal(tok, ref_tok) and torch.equal(par, ref_par)
        assert torch.equal(lp.nan_to_num(nan=7.0, neginf=-1e30), ref_lp.nan_to_num(nan=7.0, neginf=-1e30))
