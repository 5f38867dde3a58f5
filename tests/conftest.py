"""Shared test fixtures.

`tiny_checkpoint(family, **overrides) -> Path` builds a tiny random Hugging Face model of a
supported family, saves it with `save_pretrained` (config.json + model.safetensors, plus a
byte-level `tokenizer.json`) under the test's `tmp_path`, and returns the directory, ready for
`tandem.models.loader.load_model` / `load_tokenizer`, or for transformers'
`AutoModelForCausalLM.from_pretrained` as a reference.

Families (see `TINY_FAMILIES`):
  "llama"          GQA, tied embeddings, llama3 `rope_scaling` whose
                   original_max_position_embeddings (16) is short enough that it matters
  "llama_untied"   GQA, separate lm_head, no rope scaling
  "mistral"        GQA
  "qwen2"          q/k/v bias
  "qwen3"          q/k RMSNorm, head_dim (32) != hidden_size / num_attention_heads (16)

`shared_tiny_checkpoint` is the session-scoped, cached, read-only variant (same arguments).
Plain helpers `tiny_hf_config`, `build_tiny_hf_model`, `save_tiny_checkpoint` and
`write_byte_tokenizer` can be imported (`from conftest import ...`) where a fixture does not fit.

Every parameter (norm weights and biases included) is drawn at random from a seeded
generator, so weights that a loader silently skipped would show up as logit differences.
Keyword overrides go to the transformers config (e.g. `num_hidden_layers=1`); the special
keywords `seed=`, `save_kwargs={...}` (e.g. `{"max_shard_size": "20KB"}`),
`tokenizer=False` and `name=` (subdirectory of tmp_path) are consumed by the fixture.

The tokenizer has 256 byte tokens plus `<s>` (256) and `</s>` (257), matching the configs'
bos/eos ids; the models' vocabulary (320) is larger, as real checkpoints' often is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import os

import pytest
import torch

# Tiny CPU models gain nothing from intra-op threads, and OpenMP spin-waiting makes them 10-100x
# slower on a loaded machine; override with TANDEM_TEST_THREADS=<n>.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "1")))

TINY_BASE: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=256,
    eos_token_id=257,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# family -> (transformers config class name, overrides on TINY_BASE)
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=10000.0)),
    "llama_untied": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32, rope_theta=1e6)),
}


def tiny_hf_config(family: str, **overrides: Any):
    """The transformers config object for a tiny model of `family` (see TINY_FAMILIES)."""
    import transformers

    cls_name, fam_over = TINY_FAMILIES[family]
    kw = {**TINY_BASE, **fam_over, **overrides}
    cfg = getattr(transformers, cls_name)(**kw)
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    return cfg


def build_tiny_hf_model(family: str, seed: int = 0, **overrides: Any):
    """A tiny fp32 transformers *ForCausalLM with every parameter randomised (seeded)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                # std 1/sqrt(fan_in) (embeddings too, so tied heads give O(1) logits)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def write_byte_tokenizer(directory: Path) -> Path:
    """Write a byte-level BPE `tokenizer.json` (no merges; ids 0-255 = bytes, 256 <s>, 257 </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # the ByteLevel alphabet is the GPT-2 byte->unicode map; rebuild it to give bytes their ids
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_to_unicode = {b: chr(c) for b, c in zip(bs, cs)}
    assert set(byte_to_unicode.values()) == set(alphabet)
    vocab = {byte_to_unicode[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    path = Path(directory) / "tokenizer.json"
    tok.save(str(path))
    return path


def save_tiny_checkpoint(out: Path, family: str, *, seed: int = 0, save_kwargs: dict | None = None,
                         tokenizer: bool = True, **overrides: Any) -> Path:
    """Build a tiny random model of `family` and `save_pretrained` it (plus tokenizer.json) into `out`."""
    out = Path(out)
    model = build_tiny_hf_model(family, seed=seed, **overrides)
    model.save_pretrained(out, **(save_kwargs or {}))
    if tokenizer:
        write_byte_tokenizer(out)
    return out


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """Factory fixture: `tiny_checkpoint(family, **overrides) -> Path`, a fresh directory under
    this test's tmp_path that the test may modify freely (see module docstring)."""

    def make(family: str, *, name: str | None = None, **kwargs: Any) -> Path:
        out = tmp_path / (name or f"{family}-{kwargs.get('seed', 0)}")
        if out.exists():
            raise ValueError(f"{out} already exists; pass name= to build a second checkpoint of {family!r}")
        return save_tiny_checkpoint(out, family, **kwargs)

    return make


@pytest.fixture(scope="session")
def shared_tiny_checkpoint(tmp_path_factory):
    """Session-wide cached variant of `tiny_checkpoint` (same arguments except name=): each
    distinct call builds its directory once. Treat the result as READ-ONLY; use
    `tiny_checkpoint` for a checkpoint you want to damage or edit."""
    cache: dict[str, Path] = {}

    def make(family: str, **kwargs: Any) -> Path:
        key = f"{family}|{sorted(kwargs.items())!r}"
        if key not in cache:
            cache[key] = save_tiny_checkpoint(tmp_path_factory.mktemp(family), family, **kwargs)
        return cache[key]

    return make
