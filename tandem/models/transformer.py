"""Our compact decoder for every supported family (Llama 2/3, Mistral, Qwen2, Qwen3).

NOTE: one class serves all four families because they differ only in two switches that
`ModelConfig` carries (q/k/v bias for Qwen2, q/k RMSNorm for Qwen3) and in RoPE scaling.
Parameter names mirror Hugging Face's, so a checkpoint's state dict loads as it is.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.models.layers import MLP, Attention, RMSNorm, rope_cos_sin, rope_inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache=None, slots=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def hidden_states(self, input_ids, positions=None, cache=None, slots=None, mask=None) -> torch.Tensor:
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, slots, mask)
        return self.model.norm(x)  # [B, T, hidden]

    def forward(self, input_ids, positions=None, cache=None, slots=None, mask=None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, positions, cache, slots, mask))  # [B, T, vocab]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype
