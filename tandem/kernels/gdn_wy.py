"""The GDN WY kernel: every root path of a tree solved at once on tensor cores (SpecPilot s4.2).

The path kernel (`tandem.kernels.gdn_path`) walks each node's root path one rank-one update at a
time: a node at depth d redoes d updates of a [dk, dv] state, with vector arithmetic. The WY form
(`tandem.kernels.gdn.gdn_tree_wy`, whose derivation this kernel follows) writes every node's state
as the decayed committed state plus a sum of rank-one terms over its path,

    S_i = exp(G_i) S0 + sum_{j on i's path} exp(G_i - G_j) k_j u_j^T,

and finds all the pseudo-values u from one unit lower-triangular system over the ancestor pairs,
so a tree pass is a few [n, dk] x [dk, n], [n, dk] x [dk, dv] and [n, n] x [n, dv] products:
tensor-core work.

Precision. Tensor cores multiply 16-bit inputs; the state is fp32 and a committed state is carried
for the rest of the request, so a product of fp32 operands here splits each into three bf16
pieces (x = x1 + x2 + x3: 8 + 8 + 8 significant bits, the whole fp32 mantissa, and bf16 keeps
fp32's exponent range) and sums the six piece products whose order is at most that of x1 y3.
What is left out is below fp32's own rounding, so the outputs stay within one bf16 ulp of the path
kernel's under Triton's interpreter (tested; two pieces miss it by 20-90x, one by thousands).
How the piece products are added matters on the GPU: chained through the tensor cores' accumulator
(`sep=False`) they were 48.8 bf16 ulps off at worst on an H100 (2026-12-07), that accumulator keeping
fewer bits than IEEE fp32; so by default (`sep=True`) each product goes into a zero accumulator of its
own and they are summed in fp32 (not yet run on a GPU). `PIECES` = 1 or 2 trades accuracy for fewer
products (the bench's A/B).

The triangular solve: `SOLVE="loop"` is forward substitution, row by row in registers (fp32
FMAs, n dependent steps); `SOLVE="doubling"` inverts I + L as (I - L)(I + L^2)(I + L^4)...,
log2(n) pairs of split products (L is strictly lower triangular, so L^n = 0).

Programs: one per (sequence, value head) and block of BV value columns. Each recomputes the
[n, n] products its block needs (they do not depend on the value columns) and loops over dk in
BK-column chunks so that no [n, dk] tile has to stay in registers.

Layout (the GDN layer's tensors): q, k [B, n, H, dk], v [B, n, H, dv], g (log decay), beta
[B, n, H], all fp32, contiguous; S0 [B, H, dk, dv] fp32; anc [n, n] uint8 ancestor-or-self mask
(one tree for every sequence of the call). A pass returns o [B, n, H, dv] and keeps U [B, H, n,
dv], G [B, H, n] for the commit, which writes the state after any root path in place.

Under Triton's interpreter (the CPU tests) a bf16 `tl.dot` is not computed correctly (Triton
3.6), so there `BF16_DOT=False` multiplies the same bf16 pieces as exact fp32 dots: a product of
two bf16 values is exact in fp32, so only the accumulation order can differ from a GPU's.
"""
from __future__ import annotations

import os

import torch

from tandem.kernels.gdn import gdn_tree_wy, gdn_wy_commit

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

BV = 64  # value columns per program
BK = 32  # key columns per chunk of the dk loop
MAX_NODES = 64  # larger trees take the torch WY form (their [n, n] tiles would not fit a program)
SOLVES = ("doubling", "loop")


def bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in bf16 ulps at ref's values (bf16's spacing, 8 significant bits, at |ref|): the unit of
    SpecPilot s4.2's bar for this kernel (within one of the path kernel's outputs)."""
    spacing = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0 ** -126))) - 7)
    return (got - ref).abs() / spacing


def _bf16_dot() -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1"


def _np(n: int) -> int:
    """The tile height for n nodes: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


if triton is not None:

    @triton.jit
    def _pieces(x, PIECES: tl.constexpr):
        # x = a + b + c, each bf16 (b, c zero when fewer pieces are asked for); every residual is
        # exact in fp32, whichever way the conversion rounds
        a = x.to(tl.bfloat16)
        r = x - a.to(tl.float32)
        b = r.to(tl.bfloat16)
        c = (r - b.to(tl.float32)).to(tl.bfloat16)
        if PIECES < 2:
            b = tl.zeros_like(b)
        if PIECES < 3:
            c = tl.zeros_like(c)
        return a, b, c

    @triton.jit
    def _mma(x, y, acc, BF16_DOT: tl.constexpr):
        if BF16_DOT:
            return tl.dot(x, y, acc)
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")

    @triton.jit
    def _dot(x, y, acc, PIECES: tl.constexpr, BF16_DOT: tl.constexpr, SEP: tl.constexpr):
        """acc + x @ y for fp32 x, y through bf16 tensor-core products of their pieces. SEP: each piece
        product into a zero accumulator of its own, summed after in fp32 (a tensor core's accumulator keeps
        fewer bits than IEEE fp32, so the small products are not added into the large ones there);
        else chained through the tensor cores' accumulator, smallest first."""
        x1, x2, x3 = _pieces(x, PIECES)
        y1, y2, y3 = _pieces(y, PIECES)
        if SEP:
            zero = tl.zeros_like(acc)
            lo = zero
            if PIECES >= 3:
                lo = _mma(x1, y3, zero, BF16_DOT) + _mma(x3, y1, zero, BF16_DOT) + _mma(x2, y2, zero, BF16_DOT)
            if PIECES >= 2:
                lo = lo + (_mma(x1, y2, zero, BF16_DOT) + _mma(x2, y1, zero, BF16_DOT))
            return acc + (lo + _mma(x1, y1, zero, BF16_DOT))
        if PIECES >= 3:  # the products of order x1 y3, smallest first
            acc = _mma(x1, y3, acc, BF16_DOT)
            acc = _mma(x3, y1, acc, BF16_DOT)
            acc = _mma(x2, y2, acc, BF16_DOT)
        if PIECES >= 2:
            acc = _mma(x1, y2, acc, BF16_DOT)
            acc = _mma(x2, y1, acc, BF16_DOT)
        return _mma(x1, y1, acc, BF16_DOT)

    @triton.jit
    def _wy_tree_kernel(s0_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, o_ptr, u_ptr, gg_ptr,
                        n, H, DK, DV, NP: tl.constexpr, LOG2NP: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, PIECES: tl.constexpr, SOLVE: tl.constexpr, BF16_DOT: tl.constexpr,
                        SEP: tl.constexpr):
        bh, vb = tl.program_id(0), tl.program_id(1)  # (sequence b, head h), value block
        b, h = bh // H, bh % H
        r = tl.arange(0, NP)  # nodes
        rm = r < n
        ov = vb * BV + tl.arange(0, BV)
        mv = ov < DV
        row = (b * n + r) * H + h  # [NP]: each node's (sequence b, head h) row of q, k, v, g, beta
        g = tl.load(g_ptr + row, mask=rm, other=0.0)
        beta = tl.load(beta_ptr + row, mask=rm, other=0.0)
        anc = tl.load(anc_ptr + r[:, None] * n + r[None, :], mask=rm[:, None] & rm[None, :], other=0) != 0
        G = tl.sum(tl.where(anc, g[None, :], 0.0), axis=1)  # [NP]: log decay summed over the root path
        # exp(G_i - G_j) on ancestor-or-self pairs, else 0 (masked before the exp: off the path the
        # difference may be large and positive)
        decay = tl.where(anc, tl.exp(tl.where(anc, G[:, None] - G[None, :], 0.0)), 0.0)  # [NP, NP]

        kk = tl.zeros((NP, NP), dtype=tl.float32)  # K K^T
        qk = tl.zeros((NP, NP), dtype=tl.float32)  # Q K^T
        ks = tl.zeros((NP, BV), dtype=tl.float32)  # K S0
        qs = tl.zeros((NP, BV), dtype=tl.float32)  # Q S0
        for k0 in range(0, DK, BK):
            ok = k0 + tl.arange(0, BK)
            mk = ok < DK
            m2 = rm[:, None] & mk[None, :]
            kc = tl.load(k_ptr + row[:, None] * DK + ok[None, :], mask=m2, other=0.0)  # [NP, BK]
            qc = tl.load(q_ptr + row[:, None] * DK + ok[None, :], mask=m2, other=0.0)
            sc = tl.load(s0_ptr + bh * DK * DV + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :],
                         other=0.0)  # [BK, BV]
            kt = tl.trans(kc)
            kk = _dot(kc, kt, kk, PIECES, BF16_DOT, SEP)
            qk = _dot(qc, kt, qk, PIECES, BF16_DOT, SEP)
            ks = _dot(kc, sc, ks, PIECES, BF16_DOT, SEP)
            qs = _dot(qc, sc, qs, PIECES, BF16_DOT, SEP)

        eg = tl.exp(G)
        v = tl.load(v_ptr + row[:, None] * DV + ov[None, :], mask=rm[:, None] & mv[None, :], other=0.0)  # [NP, BV]
        strict = anc & (r[:, None] != r[None, :])
        lo = tl.where(strict, beta[:, None] * kk * decay, 0.0)  # [NP, NP] strictly lower (topological order)
        rhs = beta[:, None] * (v - eg[:, None] * ks)  # [NP, BV]
        if SOLVE == "loop":  # forward substitution: u_i = rhs_i - sum_{j < i} L_ij u_j
            u = rhs
            for i in range(0, n):
                sel = r == i
                li = tl.sum(tl.where(sel[:, None], lo, 0.0), axis=0)  # [NP]: row i of L
                u = tl.where(sel[:, None], u - tl.sum(li[:, None] * u, axis=0)[None, :], u)
        else:  # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...: L is nilpotent, L^NP = 0
            eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
            p = -lo
            inv = eye + p
            for _ in tl.static_range(LOG2NP - 1):
                p = _dot(p, p, tl.zeros((NP, NP), dtype=tl.float32), PIECES, BF16_DOT, SEP)
                inv = _dot(inv, p, inv, PIECES, BF16_DOT, SEP)
            u = _dot(inv, rhs, tl.zeros((NP, BV), dtype=tl.float32), PIECES, BF16_DOT, SEP)
        o = _dot(qk * decay, u, eg[:, None] * qs, PIECES, BF16_DOT, SEP)  # [NP, BV]
        m2 = rm[:, None] & mv[None, :]
        tl.store(o_ptr + row[:, None] * DV + ov[None, :], o, mask=m2)
        tl.store(u_ptr + (bh * n + r)[:, None] * DV + ov[None, :], u, mask=m2)
        if vb == 0:
            tl.store(gg_ptr + bh * n + r, G, mask=rm)

    @triton.jit
    def _wy_commit_kernel(s_ptr, k_ptr, u_ptr, gg_ptr, on_ptr, n, H, DK, DV, last, NP: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, PIECES: tl.constexpr, BF16_DOT: tl.constexpr,
                          SEP: tl.constexpr):
        # S <- exp(G_last) S + sum over the path of exp(G_last - G_j) k_j u_j^T, in place: each
        # program reads a chunk of its block of S before it writes that chunk
        bh, vb = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        r = tl.arange(0, NP)
        rm = r < n
        ov = vb * BV + tl.arange(0, BV)
        mv = ov < DV
        G = tl.load(gg_ptr + bh * n + r, mask=rm, other=0.0)
        g_last = tl.load(gg_ptr + bh * n + last)
        on = tl.load(on_ptr + r, mask=rm, other=0) != 0
        w = tl.where(on, tl.exp(tl.where(on, g_last - G, 0.0)), 0.0)  # [NP]
        wu = w[:, None] * tl.load(u_ptr + (bh * n + r)[:, None] * DV + ov[None, :], mask=rm[:, None] & mv[None, :],
                                  other=0.0)  # [NP, BV]
        row = (b * n + r) * H + h
        for k0 in range(0, DK, BK):
            ok = k0 + tl.arange(0, BK)
            mk = ok < DK
            kc = tl.load(k_ptr + row[:, None] * DK + ok[None, :], mask=rm[:, None] & mk[None, :], other=0.0)
            s_at = s_ptr + bh * DK * DV + ok[:, None] * DV + ov[None, :]
            ms = mk[:, None] & mv[None, :]
            s = tl.load(s_at, mask=ms, other=0.0)  # [BK, BV]
            tl.store(s_at, _dot(tl.trans(kc), wu, tl.exp(g_last) * s, PIECES, BF16_DOT, SEP), mask=ms)


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dtype == torch.float32 and t.is_contiguous(), "the WY kernel takes contiguous fp32 tensors"


def gdn_wy_tree(S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, anc: torch.Tensor, *, pieces: int = 3, solve: str = "doubling",
                bv: int = BV, bk: int = BK, sep: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-node outputs of the gated delta rule over a tree, every root path at once: what
    `gdn.gdn_tree_wy` computes (shapes and returns as there: o [B, n, H, dv], U [B, H, n, dv],
    G [B, H, n]); anc [n, n] bool or uint8 on k's device. S0 is only read. Over MAX_NODES nodes
    `gdn.gdn_tree_wy` itself runs."""
    B, n, H, dk = k.shape
    dv = v.shape[-1]
    _check(S0, q, k, v, g, beta)
    if solve not in SOLVES:
        raise ValueError(f"solve must be one of {SOLVES}, not {solve!r}")
    if n > MAX_NODES:
        return gdn_tree_wy(S0, q, k, v, g, beta, anc.bool())
    o = torch.empty(B, n, H, dv, dtype=torch.float32, device=k.device)
    U = torch.empty(B, H, n, dv, dtype=torch.float32, device=k.device)
    G = torch.empty(B, H, n, dtype=torch.float32, device=k.device)
    NP = _np(n)
    grid = (B * H, triton.cdiv(dv, bv))
    _wy_tree_kernel[grid](S0, q, k, v, g, beta, anc.to(torch.uint8).contiguous(), o, U, G, n, H, dk, dv,
                          NP=NP, LOG2NP=NP.bit_length() - 1, BK=bk, BV=bv, PIECES=pieces, SOLVE=solve,
                          BF16_DOT=_bf16_dot(), SEP=sep, num_warps=4 if NP <= 32 else 8)
    return o, U, G


def gdn_wy_commit_(S: torch.Tensor, k: torch.Tensor, U: torch.Tensor, G: torch.Tensor, on_path: torch.Tensor,
                   last: int, *, pieces: int = 3, bv: int = BV, bk: int = BK, sep: bool = True) -> torch.Tensor:
    """The state after the root path ending at node `last` of a `gdn_wy_tree` pass, written over
    S [B, H, dk, dv] (the pass's S0) and returned. on_path: [n] bool or uint8, the path's nodes
    (on k's device). What `gdn.gdn_wy_commit` computes, as one launch."""
    B, n, H, dk = k.shape
    dv = S.shape[-1]
    if n > MAX_NODES:  # (U, G from the torch form)
        return S.copy_(gdn_wy_commit(S, k, U, G, on_path.nonzero().flatten().tolist()))
    _check(S, k, U, G)
    NP = _np(n)
    _wy_commit_kernel[(B * H, triton.cdiv(dv, bv))](S, k, U, G, on_path.to(torch.uint8), n, H, dk, dv, last, NP=NP,
                                                   BK=bk, BV=bv, PIECES=pieces, BF16_DOT=_bf16_dot(), SEP=sep,
                                                   num_warps=4 if NP <= 32 else 8)
    return S
