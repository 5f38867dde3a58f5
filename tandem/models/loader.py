"""Load a local Hugging Face checkpoint directory into our Transformer, and its tokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from tandem.config import ConfigError, ModelConfig
from tandem.models.layers import rope_inv_freq
from tandem.models.transformer import Transformer

if TYPE_CHECKING:
    from tandem.models.qwen3_5 import Qwen3_5ForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def read_config(path: str | Path) -> ModelConfig:
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"checkpoint directory {str(d)!r} does not exist; pass a local Hugging Face model folder")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{str(d)!r} has no config.json; pass a Hugging Face checkpoint folder (config.json + *.safetensors)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file} is not valid JSON ({e.msg} at line {e.lineno}); re-export the checkpoint") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_file} must hold a JSON object")
    return ModelConfig.from_hf(hf)


def _weight_files(d: Path) -> list[Path]:
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise ConfigError(f"{index} is malformed (no weight_map); re-export the checkpoint") from None
        files = sorted({d / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{str(d)!r} is missing shard(s) {', '.join(missing)} listed in its index")
        return files
    shards = sorted(d.glob("model-*.safetensors"))
    if shards:
        return shards
    raise ConfigError(f"{str(d)!r} has no model.safetensors (or sharded model-*.safetensors); only safetensors checkpoints are supported")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"
               ) -> Transformer | Qwen3_5ForCausalLM:
    """Build our Transformer from a checkpoint directory, weights cast to `dtype` on `device`.

    A Qwen3.5 checkpoint (hybrid: Gated DeltaNet + attention layers) loads into
    `tandem.models.qwen3_5.Qwen3_5ForCausalLM` instead."""
    d = Path(path)
    from tandem.models.qwen3_5 import is_qwen3_5, load_qwen3_5, read_hf_config

    hf = read_hf_config(d) if d.is_dir() else {}
    if isinstance(hf, dict) and is_qwen3_5(hf):
        return load_qwen3_5(d, hf, device, resolve_dtype(dtype))
    cfg = read_config(d)
    dt = resolve_dtype(dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    w12 = None
    from tandem.quant.checkpoint import is_w12_checkpoint

    if is_w12_checkpoint(d):  # W12 matrices, decoded to bf16 and checked bit for bit against the original
        from tandem.quant.checkpoint import read_w12_checkpoint

        w12 = read_w12_checkpoint(d)
        for key, t in w12.items():
            if key in expected:
                state[key] = t.to(device=device, dtype=dt)
            elif not key.endswith("rotary_emb.inv_freq"):
                unexpected.append(key)
    for f in _weight_files(d) if w12 is None else []:
        try:
            sf = safe_open(str(f), framework="pt", device="cpu")
            keys = list(sf.keys())
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise ConfigError(f"cannot read {f}: {_first_line(e)}; the file is damaged or not safetensors") from None
        with sf:
            for key in keys:
                if key in expected:
                    try:
                        t = sf.get_tensor(key)
                    except Exception as e:
                        raise ConfigError(f"cannot read tensor {key!r} from {f}: {_first_line(e)}; the file is damaged") from None
                    # NOTE: outside the try: a bad device must not be reported as a damaged file.
                    state[key] = t.to(device=device, dtype=dt)
                elif not key.endswith("rotary_emb.inv_freq"):  # old exports saved this buffer
                    unexpected.append(key)
    if unexpected:
        # e.g. biases the config does not announce: silently dropping them would change the logits
        raise ConfigError(f"checkpoint {str(d)!r} has {len(unexpected)} tensor(s) its config.json does not describe, "
                          f"first {sorted(unexpected)[0]!r}; this architecture variant is not supported")
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConfigError(f"checkpoint {str(d)!r} lacks {len(missing)} tensor(s), first {missing[0]!r}; it does not match its config.json")
    for key, t in state.items():
        if tuple(t.shape) != tuple(expected[key].shape):
            raise ConfigError(f"tensor {key!r} has shape {tuple(t.shape)}, config.json implies {tuple(expected[key].shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval().requires_grad_(False)


def load_tokenizer(path: str | Path):
    """The checkpoint's `tokenizer.json` through the `tokenizers` library."""
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        raise ConfigError(f"{str(path)!r} has no tokenizer.json; Tandem needs a fast-tokenizer file beside the weights")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:
        raise ConfigError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
