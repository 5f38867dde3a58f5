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


def _hybrid_presets() -> dict:
    """Qwen3.5 (hybrid) shapes, as their published config.json files give them: 3 Gated DeltaNet
    layers to 1 attention layer, attention heads of 256 with a quarter rotary, GDN heads of 128."""
    from tandem.models.qwen3_5 import Qwen35Config

    def qwen3_5(hidden: int, inter: int, layers: int, heads: int, kv: int, gdn_k: int, gdn_v: int) -> Qwen35Config:
        types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))
        return Qwen35Config(vocab_size=248320, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv, head_dim=256, layer_types=types,
                            linear_num_key_heads=gdn_k, linear_num_value_heads=gdn_v, rope_theta=1e7,
                            max_position_embeddings=262144, tie_word_embeddings=True, eos_token_ids=(248044,))

    return {"qwen3.5-4b": qwen3_5(2560, 9216, 32, 16, 4, 16, 32),
            "qwen3.5-0.8b": qwen3_5(1024, 3584, 24, 8, 2, 16, 16),
            "qwen3.5-tiny": Qwen35Config(  # (for tests: 4 layers of 64)
                vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, layer_types=("linear_attention",) * 3 + ("full_attention",),
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                max_position_embeddings=2048, tie_word_embeddings=True)}


# hybrid (Qwen3.5) target shapes, and the natural draft of each (a smaller model of the family)
HYBRID_PRESETS = _hybrid_presets()
DEFAULT_HYBRID_DRAFT = {"qwen3.5-4b": "qwen3.5-0.8b", "qwen3.5-0.8b": "qwen3.5-tiny", "qwen3.5-tiny": "qwen3.5-tiny"}


def random_hybrid(name: str, device: str | torch.device = "cpu", dtype=torch.bfloat16, seed: int = 0):
    """A Qwen3.5 model of a hybrid preset's shape, built on `device` in `dtype`: N(0, 0.02)
    matrices, norms at identity, GDN decays in transformers' initial range (A = U(0, 16),
    dt_bias 1), so the delta rule's state neither explodes nor vanishes."""
    from tandem.models.qwen3_5 import Qwen3_5ForCausalLM

    if name not in HYBRID_PRESETS:
        raise ConfigError(f"unknown hybrid preset {name!r}; choose one of {', '.join(HYBRID_PRESETS)}")
    cfg = HYBRID_PRESETS[name]
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g, device=device).mul(16).clamp(min=1e-3).log())
            elif pname.endswith("dt_bias") or pname.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)  # (the GDN output norm applies its weight as is)
            elif "norm" in pname or pname.endswith("bias"):
                p.zero_()  # (every other norm is zero-centred: 0 is the identity)
            else:
                p.normal_(0.0, 0.02, generator=g)
    r = cfg.rotary_dim
    model.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))).to(device)
    return model.eval().requires_grad_(False)


def random_model(name_or_cfg: str | ModelConfig, device: str | torch.device = "cpu", dtype=torch.bfloat16, seed: int = 0):
    """A Transformer of a preset's shape with N(0, 0.02) weights, built directly on `device` in `dtype`
    (a hybrid preset's name: random_hybrid)."""
    from tandem.models.layers import rope_inv_freq
    from tandem.models.transformer import Transformer

    if isinstance(name_or_cfg, str) and name_or_cfg in HYBRID_PRESETS:
        return random_hybrid(name_or_cfg, device, dtype, seed)
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


# EAGLE-3 heads of published shapes, for the target preset they were trained on: (target preset,
# draft vocabulary). The layer is the target's width (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B:
# hidden 4096, intermediate 14336, 32 / 8 heads, draft_vocab_size 32000).
EAGLE3_PRESETS: dict[str, tuple[str, int]] = {"eagle3-llama3.1-8b": ("llama3-8b", 32000),
                                              "eagle3-tiny": ("tiny", 256)}


def random_eagle3(name: str, target, device: str | torch.device = "cpu", dtype=torch.bfloat16, seed: int = 1):
    """An EAGLE-3 head of a preset's shape with N(0, 0.02) weights for `target` (sharing its
    embeddings; a random d2t onto distinct target ids), built directly on `device` in `dtype`."""
    import dataclasses

    from tandem.models.eagle3 import Eagle3Config, Eagle3Head
    from tandem.models.transformer import default_feature_layers

    if name not in EAGLE3_PRESETS:
        raise ConfigError(f"unknown EAGLE-3 preset {name!r}; choose one of {', '.join(EAGLE3_PRESETS)}")
    tc = target.config
    draft_vocab = min(EAGLE3_PRESETS[name][1], tc.vocab_size)
    cfg = Eagle3Config(llama=dataclasses.replace(tc, num_hidden_layers=1), draft_vocab_size=draft_vocab,
                       target_hidden_size=tc.hidden_size, feature_layers=default_feature_layers(tc.num_hidden_layers))
    with torch.device("meta"):
        head = Eagle3Head(cfg, target.model.embed_tokens)
    head = head.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in head.named_parameters():
            p.fill_(1.0) if "norm" in pname else p.normal_(0.0, 0.02, generator=g)
        ids = torch.randperm(tc.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
        head.d2t = (ids - torch.arange(draft_vocab)).to(device)
    head.materialize_buffers(device, dtype)
    return head.eval().requires_grad_(False)


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
