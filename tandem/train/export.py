"""Write a trained Transformer as a standard Hugging Face checkpoint directory."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.models.loader import resolve_dtype
from tandem.models.transformer import Transformer
from tandem.train.tokenizer import save_tokenizer


def export_hf(model: Transformer, tok, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """config.json, model.safetensors, generation_config.json, tokenizer files.

    Tied embeddings: `lm_head.weight` is omitted (transformers re-ties it from
    `model.embed_tokens.weight` because config.json says `tie_word_embeddings: true`).
    """
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(model.config, torch_dtype=dtype)
    hf = cfg.to_hf()
    hf["use_cache"] = True
    hf["pad_token_id"] = cfg.bos_token_id
    (d / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    dt = resolve_dtype(dtype)
    state = {}
    for k, v in model.state_dict().items():
        if cfg.tie_word_embeddings and k == "lm_head.weight":
            continue
        state[k] = v.detach().to("cpu", dt).contiguous()
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    eot = cfg.bos_token_id
    gen = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot, "do_sample": False}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(tok, d, model_max_length=cfg.max_position_embeddings)
    return d


def parity_check(path: str | Path, n_tokens: int = 32, seed: int = 0) -> float:
    """Max |logit difference| between Tandem and transformers on the checkpoint (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    from tandem.models.loader import load_model

    ours = load_model(path, "cpu", "float32")
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ours.config.vocab_size, (2, n_tokens), generator=g)
    with torch.no_grad():
        a = ours(ids)
        b = theirs(ids).logits
    return float((a - b).abs().max())
