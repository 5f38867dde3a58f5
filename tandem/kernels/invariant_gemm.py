"""A batch-invariant matrix product for deterministic mode: `y = x @ W.T (+ bias)`, one Triton kernel.

cuBLAS picks its algorithm (tile shape, split-K, a GEMV for one row) from M, the number of
rows, so row i of `F.linear(x, W)` is summed in an order that changes with the batch. Here the
tiling is a function of the weight only (`config`: N, K and the dtype), never of M:

- every program computes one BLOCK_M x BLOCK_N tile of y and walks K from 0 upwards in
  BLOCK_K steps, accumulating in fp32 (no split-K, so no cross-program reduction);
- rows past M are loaded as zeros and not stored;
- M is not a specialisation key of the kernel (`do_not_specialize`): one compiled kernel
  serves every M, where Triton would otherwise compile a variant for M == 1.

A row's dot products are then the same instructions on the same operands in the same order
whatever M is and whatever the other rows hold (an MMA's output element does not depend on
the other rows of its tile), so row i of y is bitwise the same for M = 1 and M = 2048.
`tandem.engine.invariant.rowwise` is the torch reference (and the CPU path); the GPU lane and
tests/test_invariant_kernels.py (Triton interpreter) check this kernel against F.linear.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.kernels.fused import triton_enabled

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def config(N: int, K: int, dtype: torch.dtype) -> TileConfig:
    """The tiling of a product with an [N, K] weight: a function of the weight alone, never of M.

    NOTE: BLOCK_M = 64 holds a whole decode batch (up to 64 rows) in one row tile, so the weight
    is streamed once per pass there, and is the smallest tile Hopper's wgmma takes. Without
    split-K the programs of a small-M pass are the N tiles only, so narrow weights get narrow N
    tiles (more programs to spread over the SMs). A starting point: not tuned on a GPU."""
    block_n = 32 if N <= 8192 else 64 if N <= 32768 else 128
    stages = 3 if dtype == torch.float32 else 4  # (fp32 tiles take twice the shared memory)
    return TileConfig(64, block_n, 64, 4, stages)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes this product on this device (else the torch reference path)."""
    return (triton_enabled(x) and x.dtype in DTYPES and weight.dtype == x.dtype and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K] (nn.Linear's layout, unit stride along K); bias: [N] or None.
    -> [..., N] in x's dtype, every row reduced in one fixed order whatever the number of rows.

    Runs the Triton kernel unconditionally (under TRITON_INTERPRET=1 that works on CPU
    tensors); dispatchers check `applies` first."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)  # [M, N]
    if M == 0:
        return y.view(*x.shape[:-1], N)
    cfg = config(N, K, weight.dtype)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n))
    _gemm_kernel[grid](x2, weight, bias if bias is not None else weight, y, M, N, K, x2.stride(0), weight.stride(0),
                       y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                       BLOCK_K=cfg.block_k, IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages)
    return y.view(*x.shape[:-1], N)


if triton is not None:

    # NOTE: M must not pick a compiled variant (Triton specialises an int argument equal to 1
    # or divisible by 16): one kernel for every M is what makes the rows invariant
    @triton.jit(do_not_specialize=["M"])
    def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sx_m, sw_n, sy_m, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W, columns of y
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K in one fixed order: no split, nothing depends on M
            k = k0 + rk
            k_ok = k < K
            x = tl.load(x_ptr + rm[:, None] * sx_m + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * sw_n + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:  # (fp32 models: no TF32, as torch's default matmul)
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
