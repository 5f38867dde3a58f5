"""Fused elementwise kernels for the decode path, each beside its plain-torch reference.

At batch 1 a decoder layer is a handful of matrix-vector products and a dozen elementwise
ops; on a GPU with a slow host the elementwise ops cost more in launches than in bytes. These
kernels fold them: residual add + RMSNorm, RoPE on q and k, SiLU(gate) * up. The torch
versions are the semantics (and what runs on CPU); the Triton versions must match them.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): a Triton block's size for n elements."""
    return 1 << max(0, n - 1).bit_length()


_HOPPER: dict[int, bool] = {}


def hopper(t: torch.Tensor) -> bool:
    """Whether t lives on a CUDA GPU of compute capability 9 or later (Hopper on), cached per device."""
    if not t.is_cuda:
        return False
    i = t.device.index if t.device.index is not None else torch.cuda.current_device()
    ok = _HOPPER.get(i)
    if ok is None:
        ok = _HOPPER[i] = torch.cuda.get_device_capability(i)[0] >= 9
    return ok


def pdl(t: torch.Tensor) -> dict:
    """Launch options for a Triton kernel whose tensors live on t's device: programmatic dependent
    launch (PDL) on Hopper and later GPUs, unless TANDEM_PDL=0 (the A/B switch); {} elsewhere.

    Why: at this project's sizes a kernel's launch and ramp-up cost about as much as its work, and a
    decode step is tens of kernels in a row. With PDL the GPU starts the next kernel while this one
    runs; the next one waits in `_pdl_enter` (griddepcontrol.wait) until this one has finished and
    its writes are visible, so the results are the same and the gap between kernels shrinks. Each
    kernel launched with these options calls `_pdl_enter(PDL)` before it touches global memory that
    a kernel writes (only the weights, which none writes, may be read before it: fused_layer.preload)."""
    if triton is None or os.environ.get("TANDEM_PDL", "1") == "0" or not hopper(t):
        return {}
    return {"PDL": True, "launch_pdl": True}


def triton_enabled(t: torch.Tensor) -> bool:
    # NOTE: the kernels have no backward; training (grad enabled) takes the torch path.
    return (triton is not None and t.is_cuda and not torch.is_grad_enabled()
            and os.environ.get("TANDEM_TRITON", "1") != "0")


# ---- references -----------------------------------------------------------------------------
def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # NOTE: normalise in fp32 and cast back before the weight, as Hugging Face does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rmsnorm(x + delta)): the residual update and the next sublayer's input."""
    s = x + delta
    return s, rmsnorm_ref(s, weight, eps)


def embed_norms_ref(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                    w_hidden: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-3 layer's input: ids [M], embed [V, H], hidden [M, H] -> (cat(rmsnorm(embed[ids]),
    rmsnorm(hidden)) [M, 2H], rmsnorm(hidden) [M, H])."""
    hn = rmsnorm_ref(hidden, w_hidden, eps)
    return torch.cat([rmsnorm_ref(embed[ids], w_embed, eps), hn], dim=-1), hn


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D]; positions: [B, T]; inv_freq: [D/2] (Hugging Face non-interleaved halves)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # [B, T, 1, D]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- Triton ---------------------------------------------------------------------------------
if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _pdl_enter(PDL: tl.constexpr):
        # a kernel launched with pdl()'s options: wait until the kernel before it has finished and
        # its writes are visible (before any global load or store: a read of its outputs, or a write
        # to what it reads), then let the kernel after it launch. Without PDL: nothing.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _rmsnorm_row(x, w_ptr, cols, m, n_cols, eps):
        # x [BLOCK] one row (masked columns 0) -> weight * rmsnorm(x) in x's dtype, the arithmetic
        # of rmsnorm_ref: normalise in fp32, round, then the weight
        x32 = x.to(tl.float32)
        y = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        return (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, n_cols, eps, HAS_DELTA: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * n_cols + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # round like `x + delta`
            tl.store(x_ptr + row * n_cols + cols, x, mask=m)  # residual updated in place
        tl.store(out_ptr + row * n_cols + cols, _rmsnorm_row(x, w_ptr, cols, m, n_cols, eps), mask=m)

    @triton.jit
    def _embed_norms_kernel(ids_ptr, e_ptr, h_ptr, we_ptr, wh_ptr, x_ptr, hn_ptr, n_cols, eps, BLOCK: tl.constexpr,
                            PDL: tl.constexpr = False):
        # one program per row: the embedding row and the hidden row, each through _rmsnorm_row
        _pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        e = tl.load(e_ptr + tl.load(ids_ptr + row) * n_cols + cols, mask=m, other=0.0)
        tl.store(x_ptr + row * 2 * n_cols + cols, _rmsnorm_row(e, we_ptr, cols, m, n_cols, eps), mask=m)
        h = tl.load(h_ptr + row * n_cols + cols, mask=m, other=0.0)
        o = _rmsnorm_row(h, wh_ptr, cols, m, n_cols, eps)
        tl.store(x_ptr + row * 2 * n_cols + n_cols + cols, o, mask=m)
        tl.store(hn_ptr + row * n_cols + cols, o, mask=m)

    @triton.jit
    def _rope_kernel(x_ptr, pos_ptr, inv_ptr, n_heads, tok_stride, HALF: tl.constexpr, PDL: tl.constexpr = False):
        # one program per (token, head) over heads [0, n_heads) of x [tokens, heads_total, 2 * HALF]
        _pdl_enter(PDL)
        pid = tl.program_id(0)
        tok = pid // n_heads
        head = pid % n_heads
        i = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + tok).to(tl.float32)
        f = pos * tl.load(inv_ptr + i)
        base = x_ptr + tok * tok_stride + head * 2 * HALF
        x1 = tl.load(base + i)
        x2 = tl.load(base + HALF + i)
        c = tl.cos(f).to(x1.dtype).to(tl.float32)
        s = tl.sin(f).to(x1.dtype).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base + i, (a * c - b * s).to(x1.dtype))
        tl.store(base + HALF + i, (b * c + a * s).to(x1.dtype))

    @triton.jit
    def _rope_store_kv_kernel(qkv_ptr, pos_ptr, slot_ptr, inv_ptr, k_ptr, v_ptr, T, n_q, n_kv, tok_stride,
                              cache_b_stride, cache_h_stride, HALF: tl.constexpr, PDL: tl.constexpr = False):
        # grid (B * T, n_q + 2 * n_kv): q heads rotated in place, k heads rotated into the
        # cache row `slot`, v heads copied into it. One launch replaces RoPE + two scatters.
        _pdl_enter(PDL)
        tok = tl.program_id(0)
        head = tl.program_id(1)
        b = tok // T
        i = tl.arange(0, HALF)
        base = qkv_ptr + tok * tok_stride + head * 2 * HALF
        x1 = tl.load(base + i)
        x2 = tl.load(base + HALF + i)
        slot = tl.load(slot_ptr + tok)
        if head < n_q + n_kv:
            pos = tl.load(pos_ptr + tok).to(tl.float32)
            f = pos * tl.load(inv_ptr + i)
            c = tl.cos(f).to(x1.dtype).to(tl.float32)
            s = tl.sin(f).to(x1.dtype).to(tl.float32)
            a, bb = x1.to(tl.float32), x2.to(tl.float32)
            y1 = (a * c - bb * s).to(x1.dtype)
            y2 = (bb * c + a * s).to(x1.dtype)
            if head < n_q:
                tl.store(base + i, y1)
                tl.store(base + HALF + i, y2)
            else:
                dst = k_ptr + b * cache_b_stride + (head - n_q) * cache_h_stride + slot * 2 * HALF
                tl.store(dst + i, y1)
                tl.store(dst + HALF + i, y2)
        else:
            dst = v_ptr + b * cache_b_stride + (head - n_q - n_kv) * cache_h_stride + slot * 2 * HALF
            tl.store(dst + i, x1)
            tl.store(dst + HALF + i, x2)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        row = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        m = cols < n_cols
        g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=m, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g))
        tl.store(out_ptr + row * n_cols + cols, (y.to(gu_ptr.dtype.element_ty).to(tl.float32) * u)
                 .to(gu_ptr.dtype.element_ty), mask=m)


# ---- dispatch -------------------------------------------------------------------------------
def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Returns (residual, normed). With a delta the residual is x + delta (x updated in place on GPU)."""
    if not triton_enabled(x):
        if delta is None:
            return x, rmsnorm_ref(x, weight, eps)
        return add_rmsnorm_ref(x, delta, weight, eps)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    assert x2.is_contiguous()
    out = torch.empty_like(x2)
    d2 = delta.reshape(-1, n).contiguous() if delta is not None else x2
    _add_rmsnorm_kernel[(x2.shape[0],)](x2, d2, weight, out, n, eps, HAS_DELTA=delta is not None,
                                         BLOCK=triton.next_power_of_2(n), **pdl(x2))
    return x, out.view_as(x)


def embed_norms(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                w_hidden: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """embed_norms_ref as one kernel (an embedding gather, two RMSNorms and a cat: four otherwise,
    in every pass of an EAGLE-3 head)."""
    if not triton_enabled(hidden):
        return embed_norms_ref(ids, embed, hidden, w_embed, w_hidden, eps)
    M, n = hidden.shape
    hidden = hidden.contiguous()
    x = torch.empty(M, 2 * n, device=hidden.device, dtype=hidden.dtype)
    hn = torch.empty(M, n, device=hidden.device, dtype=hidden.dtype)
    _embed_norms_kernel[(M,)](ids, embed, hidden, w_embed, w_hidden, x, hn, n, eps, BLOCK=triton.next_power_of_2(n),
                              **pdl(ids))
    return x, hn


def rope_(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, n_rot: int) -> None:
    """Rotary embedding, in place, on heads [0, n_rot) of x [B, T, H_total, D] (q heads then k heads)."""
    B, T, H, D = x.shape
    if not triton_enabled(x):
        x[:, :, :n_rot] = rope_ref(x[:, :, :n_rot], positions, inv_freq)
        return
    assert x.stride(-1) == 1 and x.stride(-2) == D and x.stride(0) == T * x.stride(1)
    _rope_kernel[(B * T * n_rot,)](x, positions.reshape(-1), inv_freq, n_rot, x.stride(1), HALF=D // 2, **pdl(x))


def rope_store_kv_ref(qkv, positions, inv_freq, n_q, n_kv, k_cache, v_cache, slots) -> None:
    """qkv [B, T, n_q + 2 n_kv, D]: RoPE on q (in place) and k; k and v stored at cache rows `slots` [B, T].

    k_cache, v_cache: one layer's [B, n_kv, capacity, D] buffers.
    """
    rope_(qkv, positions, inv_freq, n_q + n_kv)
    k = qkv[:, :, n_q:n_q + n_kv].transpose(1, 2)  # [B, n_kv, T, D]
    v = qkv[:, :, n_q + n_kv:].transpose(1, 2)
    idx = slots[:, None, :, None].expand(k.shape)
    k_cache.scatter_(2, idx, k)
    v_cache.scatter_(2, idx, v)


def rope_store_kv(qkv, positions, inv_freq, n_q, n_kv, k_cache, v_cache, slots) -> None:
    if not triton_enabled(qkv):
        return rope_store_kv_ref(qkv, positions, inv_freq, n_q, n_kv, k_cache, v_cache, slots)
    B, T, Ht, D = qkv.shape
    assert qkv.stride(-1) == 1 and qkv.stride(-2) == D and qkv.stride(0) == T * qkv.stride(1)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    _rope_store_kv_kernel[(B * T, Ht)](qkv, positions.reshape(-1), slots.reshape(-1), inv_freq, k_cache, v_cache,
                                       T, n_q, n_kv, qkv.stride(1), k_cache.stride(0), k_cache.stride(1), HALF=D // 2,
                                       **pdl(qkv))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not triton_enabled(gate_up):
        return silu_mul_ref(gate_up)
    n = gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * n)
    out = torch.empty(g2.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, BLOCK))](g2, out, n, BLOCK=BLOCK, **pdl(g2))
    return out.view(*gate_up.shape[:-1], n)
