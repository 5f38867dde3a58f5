"""The certified INT8 LM head on the GPU: the exact greedy token from the int8 copy, fixed shapes, no sync.

tandem.quant.int8_head holds the certificate and its torch reference (`Int8Head.argmax`), which
finds the survivors with a data-dependent nonzero and rescores them with F.linear. Here the same
argmax takes Triton kernels whose launch shapes depend only on (rows, vocab, hidden), so the
host never waits and a CUDA graph can hold them:

1. `_bounds_kernel` streams the int8 rows once (half the bf16 head's bytes) and, per (hidden row,
   token), writes the upper bound of the exact logit, and per (hidden row, block of tokens) the
   block's best lower bound. bf16 rows go through tl.dot on the int8 tile converted to bf16
   (exact: |q| <= 127); fp32 / fp16 rows multiply in fp32 FMAs on a [R, BV, BK] accumulator.
2. `_rescore_kernel`: `slices` programs per hidden row, each over its own slice of the
   vocabulary, compact the tokens whose upper bound reaches the row's best lower bound (the
   survivors: the argmax is always among them) and rescore each exactly from its bf16 row: an
   fp32 dot product rounded to the model dtype, the evaluation the certificate's "exact logit"
   term covers. `_merge_kernel` keeps the largest value, the smallest token on ties
   (torch.argmax's rule). A row whose best lower bound is NaN (a non-finite hidden state) keeps
   every token. Survivors spread over the vocabulary, so the slices share the rescoring evenly
   however many there are.

The bound arithmetic here is fp32, not the reference's float64, so it is widened (`gpu_coef`):
the accumulation terms are taken 4x (tensor cores may accumulate fp32 with truncation rather than
rounding), ||h|| is rounded up by 2^-11 (the fp32 norm's own error), and every bound adds
2^-20 |a| plus a 2^-16 relative margin for its own roundings. A wider bound only keeps more
survivors; it never changes the token.

NOTE: the rescoring is its own fp32 evaluation of the head. cuBLAS's full bf16 head sums in
another order, so at a tie within one bf16 rounding of two logits the two may name different
tokens, as two GEMM shapes of the same head may (the reference has the same caveat).
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

# bf16 rows go through tl.dot at every row count: on the H200 (CUDA-graph timing, 2026-12-03) the
# bounds kernel took 0.226 ms for one row in FMAs and 0.184 ms for 4-8 rows through tl.dot (4 rows in
# FMAs: 2x one row). fp32 / fp16 rows (tl.dot would read them in bf16) use FMAs, up to FMA_ROWS a program.
FMA_ROWS = 2
HN_UP = 1 + 2.0**-11  # ||h|| computed in fp32, rounded up by more than its error bound


def gpu_coef(resid: torch.Tensor, cheap: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """[V] fp32 bound per unit ||h|| for the kernels: the reference's terms (float64, Int8Head)
    with the accumulation terms 4x and a relative margin, rounded up into fp32."""
    c = (resid + 4 * (cheap + exact)) * (1 + 2.0**-16)  # float64
    c32 = c.float()
    return torch.where(c32.double() < c, torch.nextafter(c32, torch.full_like(c32, float("inf"))), c32)


if triton is not None:

    @triton.jit
    def _q_tile(ptrs, v_ok, k_ok, EVEN_K: tl.constexpr):
        # EVEN_K (BK divides H): no mask along the contiguous axis, so the int8 rows load in 16-byte
        # vectors (a column mask made them byte loads: 1.6 TB/s on the H200, 2026-12-03)
        if EVEN_K:
            q = tl.load(ptrs, mask=v_ok[:, None], other=0)
        else:
            q = tl.load(ptrs, mask=v_ok[:, None] & k_ok[None, :], other=0)
        return q

    @triton.jit
    def _bounds_kernel(h_ptr, hn_ptr, q_ptr, scale_ptr, coef_ptr, upper_ptr, blk_ptr, M, V, H, n_blk, u_dt,
                       R: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, USE_DOT: tl.constexpr,
                       DOT_BF16: tl.constexpr, EVEN_K: tl.constexpr):
        pid_v = tl.program_id(0)  # block of BV tokens
        pid_r = tl.program_id(1)  # group of R hidden rows
        offs_v = pid_v * BV + tl.arange(0, BV)  # [BV]
        offs_k = tl.arange(0, BK)  # [BK]
        offs_r = pid_r * R + tl.arange(0, R)  # [R]
        v_ok = offs_v < V
        r_ok = offs_r < M
        q_rows = q_ptr + offs_v.to(tl.int64)[:, None] * H  # [BV, 1]
        if USE_DOT:
            acc = tl.zeros((BV, R), dtype=tl.float32)  # [tokens, rows]
            for k in range(0, H, BK):
                k_ok = ((k + offs_k) < H) | EVEN_K
                q = _q_tile(q_rows + k + offs_k[None, :], v_ok, k_ok, EVEN_K)  # [BV, BK] int8
                hT = tl.load(h_ptr + offs_r[None, :].to(tl.int64) * H + k + offs_k[:, None],
                             mask=r_ok[None, :] & k_ok[:, None], other=0.0)  # [BK, R] bf16
                if DOT_BF16:  # (exact: |q| <= 127 and h is bf16)
                    acc = tl.dot(q.to(tl.bfloat16), hT.to(tl.bfloat16), acc=acc)
                else:  # (fp32 rows: full-precision products, not tf32)
                    acc = tl.dot(q.to(tl.float32), hT.to(tl.float32), acc=acc, input_precision="ieee")
            a = tl.trans(acc)  # [R, BV]
        else:
            acc3 = tl.zeros((R, BV, BK), dtype=tl.float32)
            for k in range(0, H, BK):
                k_ok = ((k + offs_k) < H) | EVEN_K
                q = _q_tile(q_rows + k + offs_k[None, :], v_ok, k_ok, EVEN_K)  # [BV, BK] int8
                hk = tl.load(h_ptr + offs_r[:, None].to(tl.int64) * H + k + offs_k[None, :],
                             mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [R, BK]
                acc3 += q.to(tl.float32)[None, :, :] * hk[:, None, :]
            a = tl.sum(acc3, axis=2)  # [R, BV]
        scale = tl.load(scale_ptr + offs_v, mask=v_ok, other=0.0)  # [BV]
        coef = tl.load(coef_ptr + offs_v, mask=v_ok, other=0.0)  # [BV]
        hn = tl.load(hn_ptr + offs_r, mask=r_ok, other=0.0)  # [R] ||h||, rounded up
        a = a * scale[None, :]  # [R, BV] cheap logits h . q(w)
        s1 = hn[:, None] * coef[None, :]
        s2 = s1 + u_dt * (tl.abs(a) + s1)  # the model dtype's rounding of the exact logit
        slack = s2 * (1 + 2.0**-16) + tl.abs(a) * 2.0**-20  # this arithmetic's own roundings
        upper = a + slack
        lower = tl.where(v_ok[None, :], a - slack, float("-inf"))
        ok = r_ok[:, None] & v_ok[None, :]
        tl.store(upper_ptr + offs_r[:, None].to(tl.int64) * V + offs_v[None, :], upper, mask=ok)
        tl.store(blk_ptr + offs_r * n_blk + pid_v, tl.max(lower, axis=1), mask=r_ok)

    @triton.jit
    def _rescore_kernel(h_ptr, w_ptr, upper_ptr, best_ptr, cand_ptr, pval_ptr, ptok_ptr, pcount_ptr, V, H, P, span,
                        ROUND_BF16: tl.constexpr, CH: tl.constexpr, G: tl.constexpr, BH: tl.constexpr):
        p = tl.program_id(0)  # slice of the vocabulary: tokens [p * span, (p + 1) * span)
        row = tl.program_id(1)
        best_lower = tl.load(best_ptr + row)
        # NaN: no certificate (a non-finite hidden state): every token is kept
        threshold = tl.where(best_lower == best_lower, best_lower, float("-inf"))
        offs_c = tl.arange(0, CH)
        up_row = upper_ptr + row.to(tl.int64) * V
        cand = cand_ptr + row.to(tl.int64) * V + p * span  # this program's own part of the scratch list
        lo = p * span
        hi = tl.minimum(lo + span, V)
        count = tl.zeros((), dtype=tl.int32)
        for c in range(lo, hi, CH):  # compact the slice's survivors, ascending
            ok = (c + offs_c) < hi
            u = tl.load(up_row + c + offs_c, mask=ok, other=float("-inf"))
            keep = ((u >= threshold) & ok).to(tl.int32)
            n = tl.sum(keep)
            if n > 0:
                pos = count + tl.cumsum(keep, axis=0) - 1
                tl.store(cand + pos, c + offs_c, mask=keep > 0)
                count += n
        tl.debug_barrier()  # the list is read back by other threads of this program
        offs_g = tl.arange(0, G)
        offs_h = tl.arange(0, BH)
        best_val = tl.full((), float("-inf"), dtype=tl.float32)
        best_tok = tl.zeros((), dtype=tl.int32) + V
        for g in range(0, count, G):
            valid = (g + offs_g) < count
            tok = tl.load(cand + g + offs_g, mask=valid, other=0)  # [G]
            acc = tl.zeros((G, BH), dtype=tl.float32)
            for k in range(0, H, BH):
                k_ok = (k + offs_h) < H
                w = tl.load(w_ptr + tok.to(tl.int64)[:, None] * H + k + offs_h[None, :],
                            mask=valid[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [G, BH]
                x = tl.load(h_ptr + row.to(tl.int64) * H + k + offs_h, mask=k_ok, other=0.0).to(tl.float32)  # [BH]
                acc += w * x[None, :]
            val = tl.sum(acc, axis=1)  # [G] fp32 exact logits
            if ROUND_BF16:
                val = val.to(tl.bfloat16).to(tl.float32)  # as the model dtype's head rounds them
            val = tl.where(valid, val, float("-inf"))
            g_best = tl.max(val)
            g_tok = tl.min(tl.where(valid & (val == g_best), tok, V))
            better = (g_best > best_val) | ((g_best == best_val) & (g_tok < best_tok))
            best_tok = tl.where(better, g_tok, best_tok)
            best_val = tl.where(better, g_best, best_val)
        tl.store(pval_ptr + row * P + p, best_val)
        tl.store(ptok_ptr + row * P + p, best_tok)
        tl.store(pcount_ptr + row * P + p, count)

    @triton.jit
    def _merge_kernel(pval_ptr, ptok_ptr, pcount_ptr, tok_ptr, val_ptr, count_ptr, V, P, PB: tl.constexpr):
        row = tl.program_id(0)  # the slices' winners: the largest value, the smallest token on ties
        offs = tl.arange(0, PB)
        ok = offs < P
        val = tl.load(pval_ptr + row * P + offs, mask=ok, other=float("-inf"))
        tok = tl.load(ptok_ptr + row * P + offs, mask=ok, other=V)
        top = tl.max(val)
        win = tl.min(tl.where(ok & (val == top) & (tok < V), tok, V))
        tl.store(tok_ptr + row, tl.minimum(win, V - 1).to(tl.int64))
        tl.store(val_ptr + row, top)
        tl.store(count_ptr + row, tl.sum(tl.load(pcount_ptr + row * P + offs, mask=ok, other=0)))


def certified_argmax_triton(h: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, coef: torch.Tensor,
                            weight: torch.Tensor, u_dt: float, bv: int | None = None, bk: int | None = None,
                            num_warps: int = 4, num_stages: int = 3, use_dot: bool | None = None,
                            slices: int = 128, bounds_only: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token [M] int64, its exact logit [M] fp32, survivors [M] int32) for hidden rows h [M, H]
    (the weight's dtype) against
    the int8 head q [V, H] with per-token scale [V] and GPU bound coefficients coef [V] (gpu_coef),
    rescoring survivors from weight [V, H]. `slices` programs per hidden row share the rescoring.
    Four launches (bounds, the rows' best lower bound, rescoring, merge), no host sync: graph-capturable."""
    if triton is None:
        raise RuntimeError("certified_argmax_triton needs Triton (a CUDA build of torch)")
    m, hdim = h.shape
    v = q.shape[0]
    h = h.contiguous()
    hn = h.float().norm(dim=-1) * HN_UP  # [M]
    if use_dot is None:  # (fp32 / fp16 heads: FMAs; the tests force tl.dot in fp32)
        use_dot = h.dtype == torch.bfloat16
    r = max(16, triton.next_power_of_2(min(m, 64))) if use_dot else triton.next_power_of_2(min(m, FMA_ROWS))
    if bv is None:
        bv = 64 if use_dot else (32 if r <= 2 else 16)
    if bk is None:
        bk = 128 if use_dot else 128
    n_blk = triton.cdiv(v, bv)
    upper = torch.empty(m, v, dtype=torch.float32, device=h.device)  # [M, V]
    blk = torch.empty(m, n_blk, dtype=torch.float32, device=h.device)  # [M, blocks]
    _bounds_kernel[(n_blk, triton.cdiv(m, r))](h, hn, q, scale, coef, upper, blk, m, v, hdim, n_blk, u_dt,
                                              R=r, BV=bv, BK=bk, USE_DOT=use_dot,
                                              DOT_BF16=h.dtype == torch.bfloat16, EVEN_K=hdim % bk == 0,
                                              num_warps=num_warps,
                                              num_stages=num_stages)
    if bounds_only:  # (benchmarks: the int8 read alone)
        return upper, blk, blk
    best = blk.amax(dim=-1)  # [M] the best lower bound of each row
    span = triton.cdiv(triton.cdiv(v, slices), 1024) * 1024  # tokens per slice
    p = triton.cdiv(v, span)
    cand = torch.empty(m, v, dtype=torch.int32, device=h.device)  # [M, V] survivors' tokens (scratch)
    pval = torch.empty(m, p, dtype=torch.float32, device=h.device)  # [M, P] each slice's winner
    ptok = torch.empty(m, p, dtype=torch.int32, device=h.device)
    pcount = torch.empty(m, p, dtype=torch.int32, device=h.device)
    _rescore_kernel[(p, m)](h, weight, upper, best, cand, pval, ptok, pcount, v, hdim, p, span,
                            ROUND_BF16=weight.dtype == torch.bfloat16, CH=1024, G=16, BH=256, num_warps=4)
    tok = torch.empty(m, dtype=torch.int64, device=h.device)
    val = torch.empty(m, dtype=torch.float32, device=h.device)
    count = torch.empty(m, dtype=torch.int32, device=h.device)
    _merge_kernel[(m,)](pval, ptok, pcount, tok, val, count, v, p, PB=triton.next_power_of_2(p), num_warps=1)
    return tok, val, count
