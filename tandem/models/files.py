"""A local Hugging Face checkpoint folder: its config.json and its safetensors files.

NOTE: its own module, below the loaders (loader.py, qwen3_5.py) and the W12 checkpoint format
(tandem.quant.checkpoint), which all read folders and which the loader dispatches to.
"""
from __future__ import annotations

import json
from pathlib import Path

from tandem.config import ConfigError, ModelConfig


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
    return ModelConfig.from_hf(with_generation_eos(d, hf))


def with_generation_eos(d: Path, hf: dict) -> dict:
    """hf (config.json) with `eos_token_id` widened by generation_config.json's: instruct
    checkpoints list their end-of-turn ids there (Llama-3's <|eot_id|> beside <|end_of_text|>),
    and transformers' and vLLM's generation stop at any of them. An unreadable file adds nothing."""
    try:
        gen = json.loads((Path(d) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return hf
    more = gen.get("eos_token_id") if isinstance(gen, dict) else None
    if more is None:
        return hf
    text = hf.get("text_config")
    if isinstance(text, dict) and "eos_token_id" in text:  # (a multimodal wrapper: its text part's ids)
        return {**hf, "text_config": with_generation_eos_ids(text, more)}
    return with_generation_eos_ids(hf, more)


def with_generation_eos_ids(hf: dict, more) -> dict:
    ids = [] if hf.get("eos_token_id") is None else hf["eos_token_id"]
    ids = list(ids) if isinstance(ids, list) else [ids]
    for e in more if isinstance(more, list) else [more]:
        if isinstance(e, int) and not isinstance(e, bool) and e not in ids:
            ids.append(e)
    return {**hf, "eos_token_id": ids}


def weight_files(d: Path) -> list[Path]:
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


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def install_state(model, d: Path, state: dict, expected: dict, unexpected: list[str], tied: bool) -> None:
    """Check a checkpoint's tensors against the model built from its config.json, then load them
    into `model` (built on the meta device) in place. `state`: checkpoint name -> tensor (already
    cast); `expected`: the model's state dict; `unexpected`: names the config does not describe.
    Every mismatch is one ConfigError line naming the first offending tensor."""
    if unexpected:
        # e.g. biases the config does not announce: silently dropping them would change the logits
        raise ConfigError(f"checkpoint {str(d)!r} has {len(unexpected)} tensor(s) its config.json does not describe, "
                          f"first {sorted(unexpected)[0]!r}; this architecture variant is not supported")
    if tied:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConfigError(f"checkpoint {str(d)!r} lacks {len(missing)} tensor(s), first {missing[0]!r}; it does not "
                          f"match its config.json")
    check_shapes(state, expected)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def check_names(state: dict, expected: dict, owner: str) -> None:
    """A checkpoint's tensors are exactly the ones its config.json implies; `owner` names it."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ConfigError(f"{owner} does not match its config.json "
                          f"({'lacks ' + missing[0] if missing else 'has an unknown tensor ' + extra[0]})")


def check_shapes(state: dict, expected: dict, what: str = "") -> None:
    """Each tensor has the shape its config.json implies; `what` prefixes the message's "tensor"."""
    for key, t in state.items():
        if tuple(t.shape) != tuple(expected[key].shape):
            raise ConfigError(f"{what}tensor {key!r} has shape {tuple(t.shape)}, config.json implies "
                              f"{tuple(expected[key].shape)}")


def open_safetensors(f: Path):
    """(the open safetensors file, its tensor names); a damaged file is one ConfigError line."""
    from safetensors import safe_open

    try:
        sf = safe_open(str(f), framework="pt", device="cpu")
        return sf, list(sf.keys())
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise ConfigError(f"cannot read {f}: {first_line(e)}; the file is damaged or not safetensors") from None

