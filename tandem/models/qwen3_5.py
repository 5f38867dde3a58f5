"""Qwen3.5 text models (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`): a hybrid target.

Three of every four layers are Gated DeltaNet (GDN) layers, "linear_attention" in
`layer_types`: a causal depthwise conv1d over the q/k/v projections, then the gated delta
rule over a fixed-size state per head, an RMSNorm gated by SiLU(z), and an output projection.
The rest are "full_attention" layers: q/k RMSNorm, rotary embedding on the first
`partial_rotary_factor` of each head, and an output gate (q_proj emits the query and a gate
per head, the attention output is multiplied by sigmoid(gate)). Every RMSNorm outside GDN is
zero-centred (weight stored as w, applied as 1 + w).

Every pass here is a *tree pass*: rows are nodes with parents (a chain for prefill and AR
decode). Attention layers write the nodes' K/V into a `KVCache` and attend under the tree
mask; GDN layers read the committed `RecurrentState` without changing it and walk each root
path (tandem.kernels.gdn). The pass returns a `TreeRecord` of the GDN inputs; `commit_state`
replays the accepted path from it into the committed state. So verification keeps no state
per node, and a chain pass equals token-by-token decoding.

Which GDN kernel a pass runs (`GDN_KERNELS`): a prefill, whose rows are all committed and which
every method runs alike, takes the chunked WY form (matrix products, not one update per token);
a tree pass takes `Qwen3_5ForCausalLM.gdn_tree`: on CUDA the Triton path kernel by default
(one launch walks every node's path; exact as the walk is, decode steps included, since they
run it too; the fastest at N <= 32 on the H100, bench/NOTES.md 2026-12-06), elsewhere the walk
(bitwise what token-by-token decoding computes, so greedy `chain` / `tree` equal `ar` exactly),
or as TANDEM_GDN_TREE says: walk, path, or the WY form (every path at once, equal to the walk up
to fp32 rounding): `wy` in torch ops, `wy_triton` as one Triton kernel on tensor cores (fp32
operands as three bf16 pieces, tandem.kernels.gdn_wy; on CUDA or under Triton's interpreter).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import HYBRID_ARCHITECTURES, ConfigError
from tandem.kernels.gdn_path import gdn_path_commit, gdn_path_tree, path_kernel_runs, root_paths
from tandem.kernels.gdn_wy import gdn_wy_commit_, gdn_wy_tree
from tandem.kernels.gdn import (conv_commit, conv_tree, conv_windows, gdn_chain_chunked, gdn_replay, gdn_tree_walk,
                                gdn_tree_wy, gdn_wy_commit)
from tandem.kv.cache import KVCache
from tandem.models.layers import MLP
from tandem.tree.draft_tree import ancestor_mask

ARCHITECTURES = HYBRID_ARCHITECTURES  # ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
# a tree pass's GDN kernel: "walk" (exact: the updates token-by-token decoding does), "path" (the walk's
# updates in one Triton launch), or the WY form in torch ops ("wy") or in one Triton launch ("wy_triton")
GDN_KERNELS = ("walk", "wy", "path", "wy_triton")
TRITON_KERNELS = ("path", "wy_triton")  # (CUDA with Triton, or Triton's interpreter)
WY_KERNELS = ("wy", "wy_triton")  # (they read the tree's ancestor mask and keep U, G for the commit)
MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


def is_qwen3_5(hf: dict[str, Any]) -> bool:
    """Whether a config.json describes a Qwen3.5 text model (or the multimodal wrapper of one)."""
    return hf.get("model_type") in MODEL_TYPES or any(a in ARCHITECTURES for a in hf.get("architectures") or [])


@dataclass(frozen=True)
class Qwen35Config:
    """The part of a Qwen3.5 `config.json` (or its `text_config`) the text model needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "qwen3_5"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen35Config":
        top = hf
        if isinstance(hf.get("text_config"), dict):  # Qwen3_5ForConditionalGeneration: the text part
            # the wrapper's own tie_word_embeddings decides (transformers ties the head from it)
            tie = {"tie_word_embeddings": top["tie_word_embeddings"]} if "tie_word_embeddings" in top else {}
            hf = {**hf["text_config"], **tie}
        try:
            n = int(hf["num_hidden_layers"])
            types = hf.get("layer_types")
            if types is None:  # transformers' default: every `full_attention_interval`-th layer attends
                every = int(hf.get("full_attention_interval", 4))
                types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
            types = tuple(types)
            bad = sorted(set(types) - {"linear_attention", "full_attention"})
            if bad or len(types) != n:
                raise ConfigError(f"layer_types must list {n} of 'linear_attention' / 'full_attention' (got {list(types)})")
            rope = hf.get("rope_parameters") or {}
            if rope.get("rope_type", "default") != "default":
                raise ConfigError(f"unsupported rope_type {rope.get('rope_type')!r} for qwen3_5; Tandem supports 'default'")
            if hf.get("hidden_act", "silu") != "silu":
                raise ConfigError(f"unsupported hidden_act {hf.get('hidden_act')!r} for qwen3_5 (silu only)")
            eos = hf.get("eos_token_id", top.get("eos_token_id"))
            eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
            return cls(
                vocab_size=int(hf["vocab_size"]), hidden_size=hidden, intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=n, num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
                head_dim=int(hf.get("head_dim") or hidden // heads), layer_types=types,
                linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
                linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
                linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
                max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", False)),
                bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"qwen3_5 config.json is missing or has a bad value for {e}; re-export the checkpoint") from None


# ---- state and per-pass records -----------------------------------------------------------
@dataclass
class RecurrentState:
    """The committed recurrent state of every GDN layer (one sequence per batch row)."""

    conv: list[torch.Tensor]  # per GDN layer [B, conv_dim, K - 1], model dtype: the last K - 1 conv inputs
    delta: list[torch.Tensor]  # per GDN layer [B, Hv, dk, dv] fp32: the gated delta rule's S

    def clone(self) -> "RecurrentState":
        return RecurrentState([c.clone() for c in self.conv], [s.clone() for s in self.delta])


@dataclass
class GDNRecord:
    """One GDN layer's inputs in a tree pass: what `commit_state` replays (n rows, no states)."""

    ext: torch.Tensor  # [B, K - 1 + n, conv_dim]: committed conv state, then the nodes' conv inputs
    k: torch.Tensor  # [B, n, Hv, dk] fp32, l2-normalised
    v: torch.Tensor  # [B, n, Hv, dv] fp32
    g: torch.Tensor  # [B, n, Hv] fp32 log decay
    beta: torch.Tensor  # [B, n, Hv] fp32
    U: torch.Tensor | None = None  # WY passes: [B, Hv, n, dv] pseudo-values
    G: torch.Tensor | None = None  # WY passes: [B, Hv, n] path log decays
    final: torch.Tensor | None = None  # chunked prefills: [B, Hv, dk, dv] the state after every row


@dataclass
class RowInputs:
    """One GDN layer's inputs for rows already in a draft's tree region (`draft_step`): what the
    delta rule and the conv of their descendants read, so those rows are never run again."""

    conv_in: torch.Tensor  # [B, m, conv_dim] the rows' conv inputs, model dtype
    k: torch.Tensor  # [B, m, Hv, dk] fp32
    v: torch.Tensor  # [B, m, Hv, dv] fp32
    g: torch.Tensor  # [B, m, Hv] fp32
    beta: torch.Tensor  # [B, m, Hv] fp32


@dataclass
class TreeRecord:
    parents: list[int]
    windows: torch.Tensor  # [n, K] conv windows (tandem.kernels.gdn.conv_windows)
    kernel: str = "walk"  # one of GDN_KERNELS, or "chunked" (a prefill chain)
    anc: torch.Tensor | None = None  # WY_KERNELS: [n, n] bool ancestor-or-self mask, on the model's device
    paths: tuple[torch.Tensor, torch.Tensor] | None = None  # "path": root paths [n, depth], lengths [n]
    layers: list[GDNRecord] = field(default_factory=list)  # one per GDN layer, in layer order

    def rows(self, idx: torch.Tensor) -> "TreeRecord":
        """The record of batch rows `idx` [b] of a pass over several sequences at once (the batched
        engine's one-row decodes share one GDN call per layer); the tree fields are shared."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, idx)

        return TreeRecord(self.parents, self.windows, self.kernel, self.anc, self.paths,
                          [GDNRecord(*(pick(getattr(r, f.name)) for f in fields(GDNRecord))) for r in self.layers])


@dataclass
class _Pass:
    """What one tree pass threads through the layers."""

    positions: torch.Tensor  # [B, n]
    cos: torch.Tensor  # [B, n, rotary_dim], model dtype
    sin: torch.Tensor
    state: RecurrentState
    record: TreeRecord
    cache: KVCache | None = None
    slots: torch.Tensor | None = None  # [n] cache rows of the nodes
    mask: torch.Tensor | None = None  # [B, 1, n, S] bool over cache columns; None = causal, no cache
    history: list[RowInputs] | None = None  # draft steps: per GDN layer, the earlier tree rows' inputs


# ---- layers -----------------------------------------------------------------------------
class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight applied as (1 + w), all in fp32, cast back at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head (weight as is), then times SiLU(z) in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * x32.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] dims (halves convention), the rest passes.
    x: [B, H, n, D]; cos, sin: [B, 1, n, r]."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen35Config, cache_layer: int):
        super().__init__()
        self.cache_layer = cache_layer  # this layer's index among the attention layers (its KV slot)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, D, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * D * 2, bias=bias)  # query and output gate, per head
        self.k_proj = nn.Linear(h, self.n_kv * D, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, h, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, p: _Pass) -> torch.Tensor:
        B, n, _ = x.shape  # x: [B, n, hidden]
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        q, gate = self.q_proj(x).view(B, n, H, 2 * D).chunk(2, dim=-1)  # [B, n, H, D] each
        gate = gate.reshape(B, n, H * D)
        q = self.q_norm(q).transpose(1, 2)  # [B, H, n, D]
        k = self.k_norm(self.k_proj(x).view(B, n, Hkv, D)).transpose(1, 2)  # [B, Hkv, n, D]
        v = self.v_proj(x).view(B, n, Hkv, D).transpose(1, 2)
        cos, sin = p.cos[:, None], p.sin[:, None]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if p.cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, enable_gqa=Hkv != H)
        else:
            width = p.mask.shape[-1]
            kc, vc = p.cache.k[self.cache_layer], p.cache.v[self.cache_layer]  # [B, Hkv, capacity, D]
            kc[:, :, p.slots] = k
            vc[:, :, p.slots] = v
            out = F.scaled_dot_product_attention(q, kc[:, :, :width], vc[:, :, :width], attn_mask=p.mask,
                                                 enable_gqa=Hkv != H)
        out = out.transpose(1, 2).reshape(B, n, H * D) * torch.sigmoid(gate)
        return self.o_proj(out)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen35Config, state_layer: int):
        super().__init__()
        self.state_layer = state_layer  # this layer's index among the GDN layers (its state slot)
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.dk, self.Hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(h, self.Hv, bias=False)
        # depthwise: conv1d.weight [conv_dim, 1, K] (Hugging Face's nn.Conv1d layout), no bias
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, p: _Pass) -> torch.Tensor:
        B, n, _ = x.shape  # x: [B, n, hidden]
        conv_state = p.state.conv[self.state_layer]  # [B, conv_dim, K - 1]
        old = p.history[self.state_layer] if p.history else None  # a draft step's earlier tree rows
        m = 0 if old is None else old.k.shape[1]
        cols = [conv_state.transpose(1, 2).to(x.dtype)] + ([old.conv_in] if m else []) + [self.in_proj_qkv(x)]
        ext = torch.cat(cols, dim=1)  # [B, K-1 + m + n, C]
        mixed = conv_tree(ext, self.conv1d.weight[:, 0], p.record.windows[m:])  # [B, n, C]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.Hv // self.Hk  # each q/k head serves `rep` consecutive value heads
        q = _l2norm(q.reshape(B, n, self.Hk, self.dk).float()).repeat_interleave(rep, dim=2) * self.dk ** -0.5
        k = _l2norm(k.reshape(B, n, self.Hk, self.dk).float()).repeat_interleave(rep, dim=2)  # [B, n, Hv, dk]
        v = v.reshape(B, n, self.Hv, self.dv).float()
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [B, n, Hv]
        # NOTE: in fp32 even for 16-bit weights, or exp(A_log) can overflow to inf in fp16
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [B, n, Hv]
        S0, rec = p.state.delta[self.state_layer], GDNRecord(ext, k, v, g, beta)
        if m:  # the earlier rows walk again (their inputs kept, no projection rerun); only new rows' o is used
            q = torch.cat([torch.zeros_like(old.k), q], 1)
            k, v, g, beta = (torch.cat(ab, 1) for ab in ((old.k, k), (old.v, v), (old.g, g), (old.beta, beta)))
        if p.record.kernel == "chunked":
            o, rec.final = gdn_chain_chunked(S0, q, k, v, g, beta)  # [B, n, Hv, dv]
        elif p.record.kernel == "wy":
            o, rec.U, rec.G = gdn_tree_wy(S0, q, k, v, g, beta, p.record.anc)
        elif p.record.kernel == "path":
            rec.v = v = v.contiguous()  # (a slice of the conv output in fp32 models)
            o = gdn_path_tree(S0, q, k, v, g, beta, *p.record.paths)
        elif p.record.kernel == "wy_triton":
            rec.v = v = v.contiguous()
            o, rec.U, rec.G = gdn_wy_tree(S0.contiguous(), q, k, v, g, beta, p.record.anc)
        else:
            o = gdn_tree_walk(S0, q, k, v, g, beta, p.record.parents)
        o = o[:, m:]
        p.record.layers.append(rec)
        z = self.in_proj_z(x).view(B, n, self.Hv, self.dv)
        o = self.norm(o.to(x.dtype), z)  # [B, n, Hv, dv]
        return self.out_proj(o.reshape(B, n, self.value_dim))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, idx: int):
        super().__init__()
        self.kind = cfg.layer_types[idx]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, cfg.gdn_layers.index(idx))
        else:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(idx))
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, p: _Pass) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        x = x + mixer(h, p)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(nn.Module):
    """The Qwen3.5 text model. Parameter names mirror Hugging Face's `Qwen3_5ForCausalLM`.

    `forward(ids)`: plain causal logits from an empty state (parity, scoring).
    `tree_forward(...)`: one tree pass over a KV cache and a committed state; see the module doc.
    """

    is_hybrid = True  # the runtime dispatches hybrid targets to tandem.runtime.hybrid

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        r = cfg.rotary_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
        self.register_buffer("inv_freq", inv, persistent=False)  # [rotary_dim // 2] fp32
        # target features for feature drafters (EAGLE-3 heads, block drafters), as Transformer keeps them
        self.feature_layers: tuple[int, ...] | None = None
        self.last_features: torch.Tensor | None = None  # [B, n, len(feature_layers) * hidden]
        self._gdn_tree = os.environ.get("TANDEM_GDN_TREE")  # a tree pass's GDN kernel (GDN_KERNELS), if chosen

    def enable_features(self, layers: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """Keep the residual stream entering `layers` (default: a low, a middle and a high layer)
        on every pass from now on, concatenated in `last_features`. Idempotent."""
        from tandem.models.transformer import default_feature_layers

        L = self.config.num_hidden_layers
        layers = tuple(layers) if layers is not None else (self.feature_layers or default_feature_layers(L))
        if any(not 0 <= i < L for i in layers):
            raise ValueError(f"feature layers {layers} outside the target's {L} layers")
        self.feature_layers = layers
        return layers

    @property
    def gdn_tree(self) -> str:
        """A tree pass's GDN kernel: TANDEM_GDN_TREE (or what was set), else the path kernel where
        it runs compiled (CUDA: one launch a layer, exact as the walk is; its passes are captured,
        runtime.hybrid_graphs) and the walk elsewhere."""
        if self._gdn_tree is not None:
            return self._gdn_tree
        return "path" if self.device.type == "cuda" and path_kernel_runs(self.device) else "walk"

    @gdn_tree.setter
    def gdn_tree(self, kernel: str) -> None:
        self._gdn_tree = kernel

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_state(self, batch: int = 1) -> RecurrentState:
        """The empty (all-zero) committed state: what a sequence starts from."""
        c = self.config
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        n = len(c.gdn_layers)
        conv = [torch.zeros(batch, conv_dim, c.linear_conv_kernel_dim - 1, dtype=self.dtype, device=self.device)
                for _ in range(n)]
        delta = [torch.zeros(batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                             dtype=torch.float32, device=self.device) for _ in range(n)]
        return RecurrentState(conv, delta)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        """K/V buffers for the full-attention layers only (GDN layers keep a RecurrentState)."""
        c = self.config
        return KVCache(len(c.attention_layers), c.num_key_value_heads, c.head_dim, capacity, self.dtype,
                       self.device, batch)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, n, r / 2] fp32
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _run(self, input_ids: torch.Tensor, p: _Pass) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        want = self.feature_layers or ()
        feats: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in want:  # the residual stream entering layer i
                feats[i] = x
            x = layer(x, p)
        if want:
            self.last_features = torch.cat([feats[i] for i in want], dim=-1)
        return self.lm_head(self.model.norm(x))  # [B, n, vocab]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, state: RecurrentState | None = None) -> torch.Tensor:
        """Causal logits [B, T, vocab] of `input_ids` [B, T] from `state` (default: empty); the
        state is not changed and no KV cache is used."""
        B, T = input_ids.shape
        parents = list(range(-1, T - 1))
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = self._rope(pos, self.dtype)
        rec = TreeRecord(parents, conv_windows(parents, self.config.linear_conv_kernel_dim).to(input_ids.device), "chunked")
        return self._run(input_ids, _Pass(pos, cos, sin, state or self.new_state(B), rec))

    @torch.no_grad()
    def tree_forward(self, tokens: list[int], parents: list[int], state: RecurrentState, cache: KVCache,
                     prefill: bool = False) -> tuple[torch.Tensor, TreeRecord]:
        """One pass over a tree (or a chain) that hangs from the committed sequence.

        tokens, parents: [n], parents in topological order with -1 for node(s) that follow the
        committed sequence directly. The nodes' K/V go to the cache's tree region (reserved
        here); a node attends to the verified prefix and to its own ancestors. The GDN layers
        read `state` and leave it as it is. Returns (logits [n, vocab], the pass's record for
        `commit`). `prefill`: the nodes are a chain that will be committed whole (the GDN layers
        take the chunked WY form, and the commit of every row costs nothing more).
        """
        n, dev = len(tokens), self.device
        rec = self.pass_record(parents, prefill)
        start = cache.reserve_rows(n)
        prefix = cache.prefix_len
        depth = [0] * n
        for i, q in enumerate(parents):
            depth[i] = 0 if q < 0 else depth[q] + 1
        pos = torch.tensor([[prefix + d for d in depth]], device=dev)  # [1, n]
        mask = torch.zeros(n, start + n, dtype=torch.bool, device=dev)  # [n, S]
        mask[:, :prefix] = True
        mask[:, start:] = rec.anc if rec.anc is not None else ancestor_mask(parents).to(dev)  # [n, n]
        cos, sin = self._rope(pos, self.dtype)
        p = _Pass(pos, cos, sin, state, rec, cache, torch.arange(start, start + n, device=dev), mask[None, None])
        return self._run(torch.tensor([tokens], device=dev), p)[0], rec

    def check_gdn_kernel(self) -> None:
        """One-line errors for a tree kernel (gdn_tree, TANDEM_GDN_TREE) this device cannot run."""
        if self.gdn_tree not in GDN_KERNELS:
            raise ConfigError(f"unknown GDN tree kernel {self.gdn_tree!r} (TANDEM_GDN_TREE); choose one of "
                              f"{', '.join(GDN_KERNELS)}")
        if self.gdn_tree in TRITON_KERNELS and not path_kernel_runs(self.device):
            raise ConfigError(f"the GDN {self.gdn_tree} kernel (TANDEM_GDN_TREE={self.gdn_tree}) runs on CUDA with "
                              "Triton (or under TRITON_INTERPRET=1); use TANDEM_GDN_TREE=walk or wy on this device")

    def pass_record(self, parents: list[int], prefill: bool = False) -> TreeRecord:
        """The empty record of a tree pass over `parents` (its GDN layers fill it in): which kernel
        the pass runs, its conv windows and what that kernel reads (tree_forward; the batched
        engine's passes, one per request, tandem.engine.hybrid_model)."""
        n, dev = len(parents), self.device
        if prefill and list(parents) != list(range(-1, n - 1)):
            raise ValueError("a prefill pass is a chain: parents must be [-1, 0, 1, ...]")
        self.check_gdn_kernel()
        # NOTE: "path" runs decode steps (n = 1) too: the same program for every pass is what
        # makes a tree node's state the bits token-by-token decoding reaches
        kernel = "chunked" if prefill else ("walk" if self.gdn_tree == "wy" and n == 1 else self.gdn_tree)
        # (the windows on the device once: each GDN layer's conv indexes with them)
        return TreeRecord(list(parents), conv_windows(parents, self.config.linear_conv_kernel_dim).to(dev), kernel,
                          ancestor_mask(parents).to(dev) if kernel in WY_KERNELS else None,
                          tuple(t.to(dev) for t in root_paths(parents)) if kernel == "path" else None)

    @torch.no_grad()
    def draft_step(self, tokens: list[int], positions: list[int], parents: list[int], state: RecurrentState,
                   cache: KVCache, history: list[RowInputs] | None) -> tuple[torch.Tensor, TreeRecord]:
        """A draft's expansion step (tandem.runtime.hybrid_runner): len(tokens) new rows appended to
        the cache's tree region after the m rows already there, whose GDN inputs `history` holds.

        parents: [m + T] over all tree rows (topological; -1 = hangs from the last prefix row);
        positions: [T]. A new row attends to the prefix and its ancestor rows; its GDN layers walk
        its root path from the committed `state` over the stored inputs. Returns (logits [T, vocab],
        the record: its layers hold the new rows' inputs, `ext` with the conv inputs last).
        """
        T, dev = len(tokens), self.device
        m = len(parents) - T
        start = cache.reserve_rows(T)
        prefix = cache.prefix_len
        anc = ancestor_mask(parents)  # [m + T, m + T]
        mask = torch.zeros(T, start + T, dtype=torch.bool)
        mask[:, :prefix] = True
        mask[:, prefix:] = anc[m:]
        pos = torch.tensor([positions], device=dev)
        cos, sin = self._rope(pos, self.dtype)
        # NOTE: the WY form whatever gdn_tree says: a draft's rounding never reaches the output (the
        # target verifies every token), and WY solves all m + T rows in ~10 ops a layer where the
        # walk needs ~6 per row (20x at a 32-head GDN layer on the CPU; bench/gpu_gdn.py)
        rec = TreeRecord(list(parents), conv_windows(parents, self.config.linear_conv_kernel_dim).to(dev), "wy", anc.to(dev))
        p = _Pass(pos, cos, sin, state, rec, cache, torch.arange(start, start + T, device=dev),
                  mask.to(dev)[None, None], history)
        return self._run(torch.tensor([tokens], device=dev), p)[0], rec

    @torch.no_grad()
    def commit_state(self, state: RecurrentState, record: TreeRecord, path: list[int]) -> None:
        """Replay the accepted `path` (node indices, root first, each the parent of the next)
        of the pass `record` into `state`, layer by layer, in place: the state keeps its tensors
        (a captured pass, runtime.hybrid_graphs, and the engine's pool slots read them there)."""
        if not path:
            return
        whole = path == list(range(len(record.parents)))  # a chain committed whole (a prefill)
        on_path = None
        for li, r in enumerate(record.layers):
            S = state.delta[li]
            if r.final is not None and whole:
                new = r.final
            elif record.kernel == "wy_triton":  # in place, one launch
                if on_path is None:  # (the path's nodes as a device mask, once for every layer)
                    on_path = torch.zeros(len(record.parents), dtype=torch.uint8)
                    on_path[path] = 1
                    on_path = on_path.to(S.device)
                new = gdn_wy_commit_(S.contiguous(), r.k, r.U, r.G, on_path, path[-1])
            elif r.U is not None:
                new = gdn_wy_commit(S, r.k, r.U, r.G, path)
            elif record.kernel == "path":  # in place, the kernel's own steps: the bits the pass read
                new = gdn_path_commit(S.contiguous(), r.k, r.v, r.g, r.beta, *record.paths, path[-1])
            else:  # the walk's updates again (and a chunked prefill committed in part, which nothing does)
                new = gdn_replay(S, r.k, r.v, r.g, r.beta, path)
            if new.data_ptr() != S.data_ptr():
                S.copy_(new)
            state.conv[li].copy_(conv_commit(r.ext, record.windows, path[-1]))


# ---- loading ------------------------------------------------------------------------------
def _hf_key(key: str) -> str | None:
    """Our parameter name for a checkpoint tensor name; None for tensors the text model skips
    (the vision tower and the multi-token-prediction head of the multimodal checkpoints)."""
    if key.startswith(("mtp.", "model.visual.", "visual.")):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def load_qwen3_5(d: Path, hf: dict[str, Any], device: str | torch.device, dtype: torch.dtype) -> Qwen3_5ForCausalLM:
    """Build the text model from a Qwen3.5 checkpoint directory (text-only or multimodal)."""
    from tandem.models.files import first_line as _first_line
    from tandem.models.files import install_state, open_safetensors
    from tandem.models.files import weight_files as _weight_files

    cfg = Qwen35Config.from_hf(hf)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for f in _weight_files(d):
        sf, keys = open_safetensors(f)
        with sf:
            for key in keys:
                ours = _hf_key(key)
                if ours is None:
                    continue
                if ours not in expected:
                    unexpected.append(key)
                    continue
                try:
                    t = sf.get_tensor(key)
                except Exception as e:
                    raise ConfigError(f"cannot read tensor {key!r} from {f}: {_first_line(e)}; the file is damaged") from None
                state[ours] = t.to(device=device, dtype=dtype)
    install_state(model, d, state, expected, unexpected, cfg.tie_word_embeddings)
    r = cfg.rotary_dim
    model.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))).to(device)
    return model.eval().requires_grad_(False)


def read_hf_config(d: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(d) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
