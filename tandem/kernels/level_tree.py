"""Triton kernels of the batched engine's level tree (tandem.engine.batched_draft), beside their references.

A level of the tree is one drafter pass over w fed rows per request, and around it the glue
that picks the fed nodes and files their children. In torch that glue is about 20 kernels a
level (a sort, gathers, five row-field copies, the children's three scatters), ~140 of the ~640
kernels of an EAGLE-3 step at one request on the H200 (2026-12-02, 2-3 us each with the gaps
between them). Here it is two programs per request and level:

- `level_feed`: the w best nodes of the newest level by cumulative log-prob (ties to the
  earlier node, as a stable sort), their ancestor bits, and the pass's row fields (token,
  position, slot, mask word; the requests' column counts);
- `level_children`: the pass's top-w children of every fed row filed as the next level's nodes
  (target-vocabulary token, parent, cumulative log-prob).

The references are the semantics and the CPU path; the GPU lane checks the kernels against them
bit for bit (the log-prob sums are the same single fp32 add).
"""
from __future__ import annotations

import torch

from tandem.kernels.fused import pdl, pow2, triton_enabled

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None


def level_feed_ref(node_tok: torch.Tensor, node_lp: torch.Tensor, lo: int, hi: int, w: int, fed_bits: torch.Tensor,
                   bits_out: torch.Tensor, base_bit: int, first: bool, fed: torch.Tensor, parent_row: torch.Tensor,
                   rows_tokens: torch.Tensor, rows_positions: torch.Tensor, rows_slots: torch.Tensor,
                   rows_bits: torch.Tensor, rows_seq_len: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   seq_len: torch.Tensor) -> None:
    """A level's fed nodes, written into its pass's rows. node_tok, node_lp: [R, n_all]; nodes
    lo:hi are the newest level -> fed [R, w] its w best nodes by cumulative log-prob (ties to the
    earlier node, NaN last: a stable sort's order); parent_row [R, w] the previous level's fed row
    each hangs from (left alone at the first level); bits_out [R, w] each fed row's ancestor bits
    (its parent's in fed_bits, another buffer, plus its own, base_bit + s); and the pass's rows:
    tokens, positions (from positions [R * w]), slots (from slots [R * w]), mask word (rows_bits
    [R * w, words], word 0) and the requests' column counts (rows_seq_len [R] from seq_len [R])."""
    R = node_lp.shape[0]
    M = R * w
    picked = lo + torch.sort(-node_lp[:, lo:hi], dim=1, stable=True).indices[:, :w]  # [R, w]
    fed.copy_(picked)
    own = torch.bitwise_left_shift(torch.ones(w, dtype=torch.long, device=fed.device),
                                   base_bit + torch.arange(w, device=fed.device))  # [w]
    if first:
        bits = own.expand(R, w)
    else:
        parent_row.copy_((picked - lo) // w)
        bits = fed_bits.gather(1, parent_row) | own
    bits_out.copy_(bits)
    rows_tokens[:M] = node_tok.gather(1, picked).flatten()
    rows_positions[:M] = positions
    rows_slots[:M] = slots
    rows_bits[:M, 0] = bits.flatten()
    rows_seq_len[:R] = seq_len


def level_children_ref(node_tok: torch.Tensor, node_par: torch.Tensor, node_lp: torch.Tensor, fed: torch.Tensor,
                       ctok: torch.Tensor, clp: torch.Tensor, lo: int, d2t: torch.Tensor | None = None) -> None:
    """ctok, clp: [R * w, w] the pass's top-w children of each fed row (drafter-vocabulary
    tokens, mapped to the target's by d2t when given: target = draft + d2t[draft]) -> nodes lo ..
    lo + w * w of every request (fed row s's child j at lo + s * w + j), in place."""
    R, w = fed.shape
    hi = lo + w * w
    node_tok[:, lo:hi] = (ctok if d2t is None else ctok + d2t[ctok]).view(R, w * w)
    node_par[:, lo:hi] = fed.repeat_interleave(w, dim=1)
    node_lp[:, lo:hi] = (node_lp.gather(1, fed)[:, :, None] + clp.view(R, w, w)).view(R, w * w)


def level_feed(node_tok: torch.Tensor, node_lp: torch.Tensor, lo: int, hi: int, w: int, fed_bits: torch.Tensor,
               bits_out: torch.Tensor, base_bit: int, first: bool, fed: torch.Tensor, parent_row: torch.Tensor,
               rows_tokens: torch.Tensor, rows_positions: torch.Tensor, rows_slots: torch.Tensor,
               rows_bits: torch.Tensor, rows_seq_len: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               seq_len: torch.Tensor) -> None:
    """level_feed_ref, on a GPU one program per request."""
    fn = level_feed_triton if triton_enabled(node_lp) else level_feed_ref
    fn(node_tok, node_lp, lo, hi, w, fed_bits, bits_out, base_bit, first, fed, parent_row, rows_tokens,
       rows_positions, rows_slots, rows_bits, rows_seq_len, positions, slots, seq_len)


def level_children(node_tok: torch.Tensor, node_par: torch.Tensor, node_lp: torch.Tensor, fed: torch.Tensor,
                   ctok: torch.Tensor, clp: torch.Tensor, lo: int, d2t: torch.Tensor | None = None) -> None:
    """level_children_ref, on a GPU one program per request."""
    fn = level_children_triton if triton_enabled(node_lp) else level_children_ref
    fn(node_tok, node_par, node_lp, fed, ctok, clp, lo, d2t)


def level_feed_triton(node_tok, node_lp, lo, hi, w, fed_bits, bits_out, base_bit, first, fed, parent_row, rows_tokens,
                      rows_positions, rows_slots, rows_bits, rows_seq_len, positions, slots, seq_len) -> None:
    R, n_all = node_lp.shape
    _feed_kernel[(R,)](node_tok, node_lp, fed_bits, bits_out, fed, parent_row, rows_tokens, rows_positions,
                       rows_slots, rows_bits, rows_bits.stride(0), rows_seq_len, positions, slots, seq_len,
                       n_all, lo, hi - lo, base_bit, W=w, WP=pow2(w), NP=pow2(hi - lo), FIRST=first, num_warps=4,
                       **pdl(node_tok))


def level_children_triton(node_tok, node_par, node_lp, fed, ctok, clp, lo, d2t=None) -> None:
    R, w = fed.shape
    _children_kernel[(R,)](node_tok, node_par, node_lp, fed, ctok, clp, d2t if d2t is not None else ctok,
                           node_lp.shape[1], lo, W=w, WP=pow2(w), HAS_D2T=d2t is not None, num_warps=4, **pdl(node_tok))


if triton is not None:
    from tandem.kernels.fused import _pdl_enter

    @triton.jit
    def _feed_kernel(tok_ptr, lp_ptr, bits_in_ptr, bits_out_ptr, fed_ptr, par_ptr, rtok_ptr, rpos_ptr, rslot_ptr,
                     rbits_ptr, rbits_stride, rseq_ptr, pos_ptr, slot_ptr, seq_ptr, n_all, lo, n, base_bit,
                     W: tl.constexpr, WP: tl.constexpr, NP: tl.constexpr, FIRST: tl.constexpr,
                     PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        r = tl.program_id(0)
        i = tl.arange(0, NP)
        valid = i < n
        lp = tl.load(lp_ptr + r * n_all + lo + i, mask=valid, other=float("-inf"))
        avail = valid
        s_idx = tl.arange(0, WP)
        picked = tl.zeros([WP], dtype=tl.int64)
        nan = lp != lp  # (a padding request's garbage: a stable sort of -lp puts NaN last)
        for s in range(W):  # the best remaining node, the earliest of equals (a stable sort's order)
            m = tl.max(tl.where(avail & ~nan, lp, float("-inf")), axis=0)
            hit = avail & ~nan & (lp == m)
            hit = hit | (avail & nan & (tl.max(hit.to(tl.int32), axis=0) == 0))  # only NaN left: the earliest
            j = tl.min(tl.where(hit, i, NP), axis=0)
            avail = avail & (i != j)
            picked = tl.where(s_idx == s, j.to(tl.int64), picked)
        ok = s_idx < W
        rows = r * W + s_idx
        own = tl.full([WP], 1, tl.int64) << (base_bit + s_idx).to(tl.int64)
        if FIRST:
            bits = own
        else:
            parent = picked // W
            bits = tl.load(bits_in_ptr + r * W + parent, mask=ok, other=0) | own
            tl.store(par_ptr + r * W + s_idx, parent, mask=ok)
        tl.store(bits_out_ptr + r * W + s_idx, bits, mask=ok)
        tl.store(fed_ptr + r * W + s_idx, lo + picked, mask=ok)
        tl.store(rtok_ptr + rows, tl.load(tok_ptr + r * n_all + lo + picked, mask=ok, other=0), mask=ok)
        tl.store(rpos_ptr + rows, tl.load(pos_ptr + rows, mask=ok, other=0), mask=ok)
        tl.store(rslot_ptr + rows, tl.load(slot_ptr + rows, mask=ok, other=0), mask=ok)
        tl.store(rbits_ptr + rows * rbits_stride, bits, mask=ok)
        tl.store(rseq_ptr + r, tl.load(seq_ptr + r))

    @triton.jit
    def _children_kernel(tok_ptr, par_ptr, lp_ptr, fed_ptr, ctok_ptr, clp_ptr, d2t_ptr, n_all, lo,
                         W: tl.constexpr, WP: tl.constexpr, HAS_D2T: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        r = tl.program_id(0)
        s = tl.arange(0, WP)[:, None]  # [WP, 1] fed row
        j = tl.arange(0, WP)[None, :]  # [1, WP] its child
        ok = (s < W) & (j < W)
        src = (r * W + s) * W + j  # [WP, WP] in the pass's [R * w, w] outputs
        ct = tl.load(ctok_ptr + src, mask=ok, other=0)
        if HAS_D2T:
            ct = ct + tl.load(d2t_ptr + ct, mask=ok, other=0)
        f = tl.load(fed_ptr + r * W + s, mask=s < W, other=0)  # [WP, 1] the fed node
        plp = tl.load(lp_ptr + r * n_all + f, mask=s < W, other=0.0)
        dst = r * n_all + lo + s * W + j
        tl.store(tok_ptr + dst, ct, mask=ok)
        tl.store(par_ptr + dst, f + tl.zeros([WP, WP], tl.int64), mask=ok)
        tl.store(lp_ptr + dst, plp + tl.load(clp_ptr + src, mask=ok, other=0.0), mask=ok)
