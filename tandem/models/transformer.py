"""Our compact decoder for every supported family (Llama 2/3, Mistral, Qwen2, Qwen3).

NOTE: one class serves all four families because they differ only in two switches that
`ModelConfig` carries (q/k/v bias for Qwen2, q/k RMSNorm for Qwen3) and in RoPE scaling.
Parameter names mirror Hugging Face's, so a checkpoint's state dict loads as it is.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.config import ConfigError, ModelConfig
from tandem.kernels import gemv
from tandem.kernels.fused import add_rmsnorm, triton_enabled
from tandem.models.layers import (MLP, Attention, RMSNorm, fuse_decoder_layers, fused_layer_applies,
                                  fused_layer_forward, rope_inv_freq)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high feature layers, (2, L // 2, L - 3), clipped into a target
    of `num_layers` layers (a tiny target may repeat one: the feature width stays 3 x hidden)."""
    return (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))


def additive_off_gpu(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A pass's bool mask as an additive one (0 / -inf) where attention runs through SDPA (the CPU):
    converted once per pass, not once per layer inside SDPA. On CUDA the mask stays bool: the
    cached-attention kernel (tandem.kernels.attention) reads bool masks only, and a float mask
    sent every layer to SDPA, a memset and a transpose copy (three launches a layer)."""
    if mask is None or mask.dtype != torch.bool or triton_enabled(x):
        return mask
    return torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, delta, positions, inv_freq, cache=None, slots=None, mask=None, resid_out=None):
        """x: residual stream [B, T, hidden]; delta: the previous layer's MLP output to add first.

        Returns (residual, this layer's MLP output): the add is deferred so it fuses with the
        next RMSNorm (one kernel for `x += delta; h = norm(x)`). `resid_out` [T, hidden] (fused
        path only, see `fused`): where x + delta is written (a slice of the target-feature buffer).
        """
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if self.fused(x, cache):
            return fused_layer_forward(self.self_attn, self.mlp, ln1, ln2, x, delta, positions, inv_freq, cache,
                                       slots, mask, resid_out)
        assert resid_out is None
        x, h = add_rmsnorm(x.contiguous(), delta, ln1.weight, ln1.eps)  # (x: a strided feature slice after a fused layer)
        a = self.self_attn(h, positions, inv_freq, cache, slots, mask)
        x, h = add_rmsnorm(x, a, ln2.weight, ln2.eps)
        return x, self.mlp(h)

    def fused(self, x: torch.Tensor, cache) -> bool:
        """Whether this pass runs as the fused layer kernels (tandem.kernels.fused_layer)."""
        return cache is not None and fused_layer_applies(self.self_attn, self.mlp, x, cache)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """`forward(input_ids, positions, cache, slots, mask) -> logits`.

    input_ids, positions, slots: [B, T]; mask: [B, 1, T, S] bool over cache columns [0, S).
    With `cache=None` it runs plain causal attention over the T rows (training, parity).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # Target features for feature drafters (EAGLE-3 heads, block drafters): the residual
        # stream entering each of these layers, concatenated, is kept in `last_features`
        # [B, T, len(feature_layers) * hidden] by every forward. None: no features (no cost).
        self.feature_layers: tuple[int, ...] | None = None
        self.last_features: torch.Tensor | None = None
        self.head_w12 = None  # a W12 copy of the LM head for one-row passes (use_w12_gemv)

    def enable_features(self, layers: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """Keep target features from now on: by default a low, a middle and a high layer,
        (2, L // 2, L - 3) as EAGLE-3's reference implementations take them. Idempotent."""
        L = self.config.num_hidden_layers
        if layers is None:
            layers = self.feature_layers or default_feature_layers(L)
        if any(not 0 <= i < L for i in layers):
            raise ValueError(f"feature layers {layers} outside the target's {L} layers")
        self.feature_layers = tuple(layers)
        return self.feature_layers

    def hidden_states(self, input_ids, positions=None, cache=None, slots=None, mask=None) -> torch.Tensor:
        """The final norm's output [B, T, hidden]."""
        x, delta = self._stream(input_ids, positions, cache, slots, mask)
        norm = self.model.norm
        return add_rmsnorm(x, delta, norm.weight, norm.eps)[1]  # [B, T, hidden]

    def _stream(self, input_ids, positions, cache, slots, mask) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream after the last layer, as (x, the last MLP output still to add) [B, T, hidden]."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x, delta = self.model.embed_tokens(input_ids), None
        mask = additive_off_gpu(mask, x)
        feats: dict[int, torch.Tensor] = {}
        want = self.feature_layers or ()
        hid = x.shape[-1]
        # fused layers write a feature layer's residual straight into its slice of the features
        # (no add and no cat: four launches a pass); a layer named twice in `want` (a tiny target)
        # is copied into its other slice
        buf = torch.empty(B, T, len(want) * hid, dtype=x.dtype, device=x.device) if want and B == 1 else None
        for i, layer in enumerate(self.model.layers):
            out = None
            if i in want:  # the residual stream entering layer i (the add is deferred, see DecoderLayer)
                if buf is not None and layer.fused(x, cache):
                    j = want.index(i)
                    out = buf[0, :, j * hid:(j + 1) * hid]
                else:
                    feats[i] = x if delta is None else x + delta
            x, delta = layer(x, delta, positions, self.inv_freq, cache, slots, mask, resid_out=out)
            if out is not None:
                feats[i] = out[None]
        if want:
            if buf is None:
                self.last_features = torch.cat([feats[i] for i in want], dim=-1)  # [B, T, len(want) * hidden]
            else:
                for j, i in enumerate(want):
                    dst = buf[..., j * hid:(j + 1) * hid]
                    if feats[i].data_ptr() != dst.data_ptr():
                        dst.copy_(feats[i])
                self.last_features = buf
        return x, delta

    def forward(self, input_ids, positions=None, cache=None, slots=None, mask=None) -> torch.Tensor:
        x, delta = self._stream(input_ids, positions, cache, slots, mask)
        norm, head = self.model.norm, self.lm_head
        if (type(head) is nn.Linear and x.shape[:2] == (1, 1) and delta is not None
                and gemv.applies(x[0], head.weight)):
            # one row of a large model: the residual add, the final norm and the LM head in one streaming GEMV
            # (at the Llama-3-8B shape it read the 1 GB head in 330 us where cuBLAS took 379, one H100)
            w = head.weight if self.head_w12 is None else self.head_w12
            return gemv.norm_gemv(x[0], delta[0], norm.weight, norm.eps, w)[None]  # [1, 1, vocab]
        return head(add_rmsnorm(x, delta, norm.weight, norm.eps)[1])  # [B, T, vocab]

    def fuse_projections(self) -> "Transformer":
        """Fuse q/k/v and gate/up weights (inference only: fewer, larger matrix products)."""
        fuse_decoder_layers(self.model.layers)
        return self

    def use_w12_gemv(self) -> dict:
        """Keep a W12 copy (tandem.quant.w12: 12 bits a weight, lossless) of every projection and of the LM
        head, which one-row passes through tandem.kernels.gemv read instead of the bf16 weights: a batch-1
        decode step then reads 12/16 of the bytes. Passes of several rows keep the bf16 weights (so the
        weights take 1.75x their bf16 memory in this mode). bf16 models with fused projections; every copy
        is checked to restore its matrix bit for bit. Returns {"escape_rate", "bits_per_weight"}."""
        from tandem.quant.w12 import encode_w12, gemv_operand, verify_w12, w12_stats

        if self.dtype != torch.bfloat16:
            raise ConfigError(f"W12 copies are of bf16 weights; this model is {self.dtype} (load it with --dtype bfloat16)")
        self.fuse_projections()
        weights = escapes = stored = 0

        def w12(w: torch.Tensor, name: str):
            nonlocal weights, escapes, stored
            rec, esc = encode_w12(w.detach())
            verify_w12(w, rec, esc, name)
            st = w12_stats(rec, esc)
            weights, escapes, stored = weights + st.weights, escapes + st.escapes, stored + st.stored_bytes
            return gemv_operand(rec, esc)

        for i, layer in enumerate(self.model.layers):
            a, m = layer.self_attn, layer.mlp
            a.w12 = {"qkv": w12(a.qkv_weight, f"layer {i} qkv"), "o": w12(a.o_proj.weight, f"layer {i} o_proj")}
            m.w12 = {"gate_up": w12(m.gate_up_weight, f"layer {i} gate_up"),
                     "down": w12(m.down_proj.weight, f"layer {i} down_proj")}
        self.head_w12 = w12(self.lm_head.weight, "lm_head")
        return {"escape_rate": escapes / max(weights, 1), "bits_per_weight": 8 * stored / max(weights, 1)}

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype
