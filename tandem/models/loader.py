"""Load a local Hugging Face checkpoint directory into our Transformer, and its tokenizer."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.config import ConfigError
from tandem.models.files import first_line as _first_line
from tandem.models.files import install_state, open_safetensors, read_config, with_generation_eos
from tandem.models.files import weight_files as _weight_files
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


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"
               ) -> Transformer | Qwen3_5ForCausalLM:
    """Build our Transformer from a checkpoint directory, weights cast to `dtype` on `device`.

    A Qwen3.5 checkpoint (hybrid: Gated DeltaNet + attention layers) loads into
    `tandem.models.qwen3_5.Qwen3_5ForCausalLM` instead."""
    d = Path(path)
    from tandem.models.qwen3_5 import is_qwen3_5, load_qwen3_5, read_hf_config

    hf = read_hf_config(d) if d.is_dir() else {}
    if isinstance(hf, dict) and is_qwen3_5(hf):
        return load_qwen3_5(d, with_generation_eos(d, hf), device, resolve_dtype(dtype))
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
        sf, keys = open_safetensors(f)
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
    install_state(model, d, state, expected, unexpected, cfg.tie_word_embeddings)
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
