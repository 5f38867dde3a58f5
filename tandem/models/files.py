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
    return ModelConfig.from_hf(hf)


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
