"""A block drafter's input rows in one launch (tandem.models.block_drafter.BlockDrafter.embed).

A draft pass of the device-resident loop feeds T rows: the pmax context rows (right-aligned, the
root last), each its token's embedding plus fc(rmsnorm(the target's features of the position
before)), then T - pmax mask rows, each the mask embedding. Done with torch ops that is about ten
launches (a concatenation of the ids, a copy of the features into the drafter's buffer, the mask
test, two masked fills, the embedding, a select, the norm, fc, the add): at the bundled size each
costs ~3-5 us whatever it does, as much as one of the drafter's layers. Here one program per block
of output columns and rows reads the context rows' features, normalises them in its prologue,
multiplies by its slice of fc, adds the embedding in the epilogue and writes the mask rows.

The arithmetic is the torch path's, rounding for rounding (the normalised rows, the weight
product, fc's output and the sum each rounded to the model's dtype), except the order of the
fp32 accumulation of fc, which cuBLAS does not fix either. `block_input_ref` is the semantics
and what runs off CUDA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.fused import pdl, rmsnorm_ref, triton_enabled

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

# rows, output columns a program; feature columns a step (the bundled drafter's 32 rows of 1,152 feature columns:
# 6.1 us at BK 256 against 8.1 at 128, one H100, bench/gpu_draft_kernels.py)
BM, BN, BK, WARPS = 16, 32, 256, 4


def block_input_ref(tok: torch.Tensor, feat: torch.Tensor, embed: torch.Tensor, mask_embedding: torch.Tensor,
                    norm_w: torch.Tensor, eps: float, fc_w: torch.Tensor, rows: int) -> torch.Tensor:
    """tok: [P] context tokens; feat: [P, F] their features (of the position before each);
    embed: [V, H]; mask_embedding: [H]; norm_w: [F]; fc_w: [H, F] -> x [rows, H]: the P context rows
    embed[tok] + fc(rmsnorm(feat)), then rows - P mask rows."""
    P, H = tok.shape[0], embed.shape[1]
    ctx = F.embedding(tok, embed) + F.linear(rmsnorm_ref(feat, norm_w, eps), fc_w)  # [P, H]
    return torch.cat([ctx, mask_embedding.to(ctx.dtype).expand(rows - P, H)])


def block_input(tok: torch.Tensor, feat: torch.Tensor, embed: torch.Tensor, mask_embedding: torch.Tensor,
                norm_w: torch.Tensor, eps: float, fc_w: torch.Tensor, rows: int) -> torch.Tensor:
    """block_input_ref in one launch on CUDA."""
    if not triton_enabled(feat) or feat.dtype != fc_w.dtype or not fc_w.is_contiguous():
        return block_input_ref(tok, feat, embed, mask_embedding, norm_w, eps, fc_w, rows)
    return launch_block_input(tok, feat, embed, mask_embedding, norm_w, eps, fc_w, rows)


def launch_block_input(tok, feat, embed, mask_embedding, norm_w, eps, fc_w, rows, bn: int = BN, bk: int = BK,
                       num_warps: int = WARPS) -> torch.Tensor:
    P, Fw = feat.shape
    H = fc_w.shape[0]
    assert feat.stride(-1) == 1 and embed.is_contiguous() and tok.shape[0] == P <= rows
    x = torch.empty(rows, H, dtype=feat.dtype, device=feat.device)
    _block_input_kernel[(triton.cdiv(H, bn), triton.cdiv(rows, BM))](
        tok, feat, embed, mask_embedding, norm_w, fc_w, x, rows, P, H, Fw, eps, feat.stride(0),
        BM=BM, BN=bn, BK=min(bk, triton.next_power_of_2(Fw)), IEEE=feat.dtype == torch.float32,
        num_warps=num_warps, **pdl(feat))
    return x


if triton is not None:
    from tandem.kernels.fused import _pdl_enter
    from tandem.kernels.fused_layer import _mm, _normed, _rstd

    @triton.jit
    def _block_input_kernel(tok_ptr, f_ptr, e_ptr, me_ptr, nw_ptr, w_ptr, x_ptr, T, P, H, Fw, eps, sf,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                            PDL: tl.constexpr = False):
        # grid (column blocks, row blocks): x[rows, cols]
        _pdl_enter(PDL)
        dt = f_ptr.dtype.element_ty
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        cm = cols < H
        ctx = rows < P  # context rows read features; mask rows none (their rstd is of zeros, unused)
        rstd = _rstd(f_ptr, f_ptr, rows, ctx, Fw, eps, sf, sf, False, BM, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, Fw, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < Fw
            v = tl.load(f_ptr + rows[:, None] * sf + kk[None, :], mask=ctx[:, None] & km[None, :], other=0.0)
            a = _normed(v, rstd, nw_ptr, kk, km)
            b = tl.load(w_ptr + cols[None, :] * Fw + kk[:, None], mask=km[:, None] & cm[None, :], other=0.0)  # [BK, BN]
            acc = acc + _mm(a, b, IEEE)
        fc = acc.to(dt).to(tl.float32)  # fc's output, rounded as the product in the model dtype is
        t = tl.load(tok_ptr + rows, mask=ctx, other=0)
        e = tl.load(e_ptr + t[:, None] * H + cols[None, :], mask=ctx[:, None] & cm[None, :], other=0.0)
        me = tl.load(me_ptr + cols, mask=cm, other=0.0).to(dt)
        x = tl.where(ctx[:, None], (e.to(tl.float32) + fc).to(dt), me[None, :])
        tl.store(x_ptr + rows[:, None] * H + cols[None, :], x, mask=(rows < T)[:, None] & cm[None, :])
