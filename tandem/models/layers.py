"""Building blocks shared by every Llama-family model: RMSNorm, RoPE, attention over a KV cache."""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.kernels import fused_layer, gemv
from tandem.kernels.attention import cached_attention
from tandem.kernels.fused import add_rmsnorm, rmsnorm_ref, rope_, silu_mul, triton_enabled
from tandem.kv.cache import KVCache

if TYPE_CHECKING:
    from tandem.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_enabled(x):  # one kernel instead of six (the EAGLE-3 head runs four per level)
            return add_rmsnorm(x.contiguous(), None, self.weight, self.eps)[1]
        return rmsnorm_ref(x, self.weight, self.eps)


def rope_inv_freq(cfg: "ModelConfig") -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with Llama-3 `rope_scaling` applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if cfg.rope_scaling is not None:
        s = dict(cfg.rope_scaling)
        factor = float(s["factor"])
        low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
        old_ctx = float(s.get("original_max_position_embeddings", cfg.max_position_embeddings))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class Attention(nn.Module):
    """GQA self-attention that writes its K/V into cache slots and reads the cache back.

    Without a cache it is plain causal attention (training, parity tests). With one, the new
    rows' K/V go to `slots` and the rows attend to cache columns [0, S) under `mask`, which
    may be any ancestor mask: rows = new nodes, columns = prefix + tree nodes.
    """

    def __init__(self, cfg: "ModelConfig", layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # sliding-window layer: a row attends to the `window` positions up to its own
        self.window = cfg.sliding_window if layer_idx in cfg.sliding_layers else None
        self.qkv_weight: torch.Tensor | None = None  # set by fuse()
        # W12 copies of q/k/v and o_proj for one-row passes ({"qkv": , "o": } W12Gemv; Transformer.use_w12_gemv)
        self.w12: dict | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.tp_group = None  # a process group when sharded (tandem.parallel.tensor_parallel)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, cache=None, slots=None,
                mask=None) -> torch.Tensor:
        # x: [B, T, hidden]; positions, slots: [B, T]; mask: [B, 1, T, S] bool (True = attend)
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        if self.qkv_weight is not None:  # fused projection: one GEMM instead of three
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(B, T, H + 2 * Hkv, D)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).view(B, T, H + 2 * Hkv, D)
        if self.q_norm is not None:
            qkv = torch.cat([self.q_norm(qkv[:, :, :H]), self.k_norm(qkv[:, :, H:H + Hkv]), qkv[:, :, H + Hkv:]], dim=2)
        if cache is None:
            rope_(qkv, positions, inv_freq, H + Hkv)  # q and k heads, in place
            q, k, v = (t.transpose(1, 2) for t in qkv.split([H, Hkv, Hkv], dim=2))  # [B, H(kv), T, D]
            if self.window is not None and T > self.window:  # causal within the window, as a mask
                mask = self._windowed(torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]
                                      if mask is None else mask, positions, positions)
            # a training mask (block drafters: blocks that see the context up to their anchor) or causal
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                 enable_gqa=Hkv != H)
        else:
            # mask: [B, 1, T, S] additive (0 / -inf) or bool; S = cache columns attended
            k_all, v_all = cache.store(self.layer_idx, qkv, positions, inv_freq, H, slots, mask.shape[-1])
            if self.window is not None:
                # NOTE: in the contiguous cache column j of the prefix holds position j, and tree
                # rows sit after the prefix, less than a window behind any row that sees them
                mask = self._windowed(mask, positions, torch.arange(mask.shape[-1], device=mask.device)[None])
            # q [B, T, H, D], rotated in place by store(); a few rows over the cache: one Triton
            # kernel on CUDA (tandem.kernels.attention), SDPA otherwise
            out = cached_attention(qkv[:, :, :H], k_all, v_all, mask).transpose(1, 2)  # [B, H, T, D]
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))
        if self.tp_group is not None:  # tensor parallel: each rank holds some heads (tandem.parallel)
            dist.all_reduce(out, group=self.tp_group)
        return out

    def _windowed(self, mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """mask [B, 1, T, S] (bool, or additive) limited to keys at positions > the row's - window
        (transformers' sliding_window_overlay): q_pos [B, T], k_pos [B | 1, S]."""
        keep = k_pos[:, None, None, :] > q_pos[:, None, :, None] - self.window  # [B, 1, T, S]
        if mask.dtype == torch.bool:
            return mask & keep
        return mask.masked_fill(~keep, float("-inf"))

    def fuse(self) -> None:
        """Concatenate q/k/v weights into one matrix; the three projections become views of it."""
        ws = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        self.qkv_weight = torch.cat([w.data for w in ws])
        splits = [w.shape[0] for w in ws]
        for proj, view in zip((self.q_proj, self.k_proj, self.v_proj), self.qkv_weight.split(splits)):
            proj.weight.data = view
        if self.q_proj.bias is not None:
            self.qkv_bias = torch.cat([self.q_proj.bias.data, self.k_proj.bias.data, self.v_proj.bias.data])


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse()
        self.tp_group = None  # a process group when sharded (tandem.parallel.tensor_parallel)
        self.w12: dict | None = None  # W12 copies of gate/up and down_proj for one-row passes ({"gate_up":, "down":})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            out = self.down_proj(silu_mul(F.linear(x, self.gate_up_weight)))
        if self.tp_group is not None:  # tensor parallel: each rank holds a slice of the columns
            dist.all_reduce(out, group=self.tp_group)
        return out

    def fuse(self) -> None:
        self.gate_up_weight = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])
        g, u = self.gate_up_weight.split([self.gate_proj.weight.shape[0], self.up_proj.weight.shape[0]])
        self.gate_proj.weight.data, self.up_proj.weight.data = g, u


def fuse_decoder_layers(layers) -> None:
    """Fuse the q/k/v and gate/up weights of decoder layers (inference only: fewer, larger
    matrix products; idempotent). Every model that runs DecoderLayers calls it."""
    for layer in layers:
        if layer.self_attn.qkv_weight is None:
            layer.self_attn.fuse()
            layer.mlp.fuse()


def _plain(attn: Attention, mlp: MLP) -> bool:
    """A layer the fused kernels can run: fused q/k/v and gate/up weights, and no q/k norm, sliding
    window or tensor parallelism (those keep the unfused path)."""
    return (attn.qkv_weight is not None and mlp.gate_up_weight is not None and attn.q_norm is None
            and attn.window is None and attn.tp_group is None and mlp.tp_group is None
            and attn.head_dim in (32, 64, 128, 256)  # (two rotary halves of >= 16 columns: tl.dot's smallest)
            and os.environ.get("TANDEM_FUSED_LAYER", "1") != "0")


def fusable(attn: Attention, mlp: MLP, x: torch.Tensor, qkv_input: int | None = None) -> bool:
    """Whether a layer's rows x [M, hidden] can run as the fused kernels (tandem.kernels.fused_layer),
    whatever holds its K/V: CUDA, a small model and a `_plain` layer. `qkv_input`: the q/k/v
    projection's input width where it is not x's (an EAGLE-3 layer's 2 x hidden)."""
    return (_plain(attn, mlp) and fused_layer.applies(x, attn.qkv_weight, qkv_input)
            and fused_layer.applies(x, mlp.gate_up_weight))


def gemv_fusable(attn: Attention, mlp: MLP, x: torch.Tensor) -> bool:
    """Whether one row x [1, hidden] of a large model's `_plain` layer runs as tandem.kernels.gemv's
    kernels (every projection a streaming GEMV)."""
    h = mlp.down_proj.weight
    return (_plain(attn, mlp) and gemv.applies(x, attn.qkv_weight) and gemv.applies(x, attn.o_proj.weight)
            and gemv.applies(x, mlp.gate_up_weight) and gemv.applies(x, h, h.shape[1]))


def fused_layer_applies(attn: Attention, mlp: MLP, x: torch.Tensor, cache, qkv_input: int | None = None) -> bool:
    """`fusable` (or, without `qkv_input`, `gemv_fusable`), against the single-sequence KVCache (the
    runners'): x [1, T, hidden]."""
    if type(cache) is not KVCache or x.shape[0] != 1:
        return False
    return fusable(attn, mlp, x[0], qkv_input) or (qkv_input is None and gemv_fusable(attn, mlp, x[0]))


def fused_layer_forward(attn: Attention, mlp: MLP, ln1: RMSNorm, ln2: RMSNorm, x, delta, positions, inv_freq, cache,
                        slots, mask, resid_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward as five launches: (x + delta, norm, q/k/v, RoPE, K/V store), attention,
    o_proj, (residual add, norm, gate/up, SiLU * up), down_proj; a small model's through
    tandem.kernels.fused_layer, one row of a large model's through tandem.kernels.gemv. Returns (residual, MLP output); x may be a strided slice (rows [1, T,
    hidden] with a unit column stride); `resid_out` [T, hidden]: where x + delta goes."""
    _, T, hid = x.shape
    H, D = attn.n_heads, attn.head_dim
    # the small model's kernels, or one row of a large model's (the caller checked that one applies)
    ops, linear = (fused_layer, fused_layer.linear) if fusable(attn, mlp, x[0]) else (gemv, gemv.gemv)
    w_qkv, w_o, w_gate_up, w_down = attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight, mlp.down_proj.weight
    if ops is gemv and attn.w12 is not None and mlp.w12 is not None:  # (one row: 12 bits a weight read)
        w_qkv, w_o, w_gate_up, w_down = attn.w12["qkv"], attn.w12["o"], mlp.w12["gate_up"], mlp.w12["down"]
    k, v = cache.layer_kv(attn.layer_idx)  # [1, Hkv, capacity, D] each
    d = None if delta is None else delta.reshape(T, hid)
    s, q = ops.norm_qkv_rope_store(x[0], d, ln1.weight, ln1.eps, w_qkv, attn.qkv_bias, positions.reshape(T),
                                   inv_freq, H, attn.n_kv, k, v, slots.reshape(T), resid_out)
    width = mask.shape[-1]
    out = cached_attention(q[None], k[:, :, :width], v[:, :, :width], mask)  # [1, T, H, D]
    a = linear(out.reshape(T, H * D), w_o)  # [T, hidden]
    s, h = ops.norm_gate_up_silu(s, a, ln2.weight, ln2.eps, w_gate_up)
    return s[None], linear(h, w_down)[None]
