"""Realistic model shapes with random weights, for profiling without downloading checkpoints.

Cost depends only on shapes, so the published configs with N(0, 0.02) weights time like the
real models. `random_model` builds the module on the meta device, casts it to the target dtype
there (free), then materialises it directly on the device: an 8B model never exists in fp32.
"""
from __future__ import annotations

import torch

from tandem.config import ConfigError, ModelConfig

_LLAMA3_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                             max_position_embeddings=131072, eos_token_ids=(128001,)),
    "llama3.2-1b": ModelConfig(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                               rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=(("factor", 32.0),) + _LLAMA3_ROPE[1:],
                               max_position_embeddings=131072, tie_word_embeddings=True, eos_token_ids=(128001,)),
    "qwen2.5-7b": ModelConfig(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                              attention_bias=True, eos_token_ids=(151643,)),
    "qwen2.5-0.5b": ModelConfig(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                                rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                                attention_bias=True, tie_word_embeddings=True, eos_token_ids=(151643,)),
    "tiny": ModelConfig(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
}


def random_model(name_or_cfg: str | ModelConfig, device: str | torch.device = "cpu", dtype=torch.bfloat16, seed: int = 0):
    """A Transformer of a preset's shape with N(0, 0.02) weights, built directly on `device` in `dtype`."""
    from tandem.models.layers import rope_inv_freq
    from tandem.models.transformer import Transformer

    cfg = preset_config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    with torch.device("meta"):
        model = Transformer(cfg)
    # NOTE: cast on meta first (free), so the weights are born in `dtype` on `device`.
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty materialises shared parameters separately
        model.lm_head.weight = model.model.embed_tokens.weight
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval().requires_grad_(False)


# The natural small draft for each target preset (the same tokenizer family where one exists).
DEFAULT_DRAFT = {"llama3-8b": "llama3.2-1b", "qwen2.5-7b": "qwen2.5-0.5b", "llama3.2-1b": "tiny",
                 "qwen2.5-0.5b": "tiny", "tiny": "tiny"}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def weight_bytes(model) -> int:
    """Bytes of the model's unique parameters: what one batch-1 forward pass must read."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
