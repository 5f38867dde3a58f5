"""W12 checkpoint folders: writing one from a bf16 Hugging Face checkpoint, and reading one back.

A W12 folder is a Hugging Face folder whose config.json carries

    "quantization_config": {"quant_method": "w12", "format": "tandem-w12", "version": 1, ...}

and whose safetensors files hold, for every 2-D bf16 tensor NAME, the parts of its W12 matrix:

    NAME.w12_records      [ceil(N/128), ceil(K/64), 12288] uint8
    NAME.w12_base         [N] int16
    NAME.w12_shape        [2] int64 (N, K)
    NAME.w12_esc_offsets  [N + 1] int32
    NAME.w12_esc_index    [E] int32
    NAME.w12_esc_bits     [E] int16

plus the SHA-256 of NAME's original bf16 bytes in the file's metadata (`w12.sha256.NAME`). Other
tensors (norm weights) are stored unchanged. Reading decodes every matrix to bf16 and compares its
digest with the original's: a damaged record is refused, never loaded.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.quant.w12 import W12Escapes, W12Records, decode_w12, encode_w12, verify_w12, w12_stats

QUANT_METHOD = "w12"
FORMAT = "tandem-w12"
VERSION = 1
PARTS = ("records", "base", "shape", "esc_offsets", "esc_index", "esc_bits")
SUFFIX = ".w12_"


def quantization_config(d: Path) -> dict | None:
    """The config.json `quantization_config` of folder d, or None."""
    try:
        hf = json.loads((Path(d) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # read_config reports a missing or malformed config.json
    qc = hf.get("quantization_config") if isinstance(hf, dict) else None
    return qc if isinstance(qc, dict) else None


def is_w12_checkpoint(d: Path) -> bool:
    qc = quantization_config(d)
    return qc is not None and qc.get("quant_method") == QUANT_METHOD


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a bf16 tensor's bytes (row-major)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.int16).numpy()).hexdigest()


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def read_w12_checkpoint(d: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a W12 folder (CPU), matrices decoded to bf16 and checked against the
    original's digest. Raises ConfigError on a damaged, incomplete or unknown-version folder."""
    from tandem.models.files import weight_files as _weight_files

    d = Path(d)
    qc = quantization_config(d) or {}
    if qc.get("format") != FORMAT or qc.get("version") != VERSION:
        raise ConfigError(f"{str(d)!r} names W12 format {qc.get('format')!r} version {qc.get('version')!r}; "
                          f"this Tandem reads {FORMAT!r} version {VERSION}")
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(d):
        try:
            from safetensors import safe_open

            sf = safe_open(str(f), framework="pt", device="cpu")
            keys, meta = list(sf.keys()), sf.metadata() or {}
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise ConfigError(f"cannot read {f}: {_first_line(e)}; the file is damaged or not safetensors") from None
        with sf:
            tensors: dict[str, torch.Tensor] = {}
            for key in keys:
                try:
                    tensors[key] = sf.get_tensor(key)
                except Exception as e:
                    raise ConfigError(f"cannot read tensor {key!r} from {f}: {_first_line(e)}; the file is damaged") from None
        names = sorted({k.rsplit(SUFFIX, 1)[0] for k in tensors if SUFFIX in k})
        for name in names:
            missing = [p for p in PARTS if f"{name}{SUFFIX}{p}" not in tensors]
            if missing:
                raise ConfigError(f"W12 matrix {name!r} in {f} lacks its {missing[0]} part; the file is damaged")
            part = {p: tensors.pop(f"{name}{SUFFIX}{p}") for p in PARTS}
            shape = part["shape"].tolist()
            if part["shape"].dtype != torch.int64 or len(shape) != 2 or min(shape) < 0:
                raise ConfigError(f"W12 matrix {name!r} in {f} has a malformed shape {shape}")
            records = W12Records(part["records"], part["base"], (shape[0], shape[1]))
            escapes = W12Escapes(part["esc_offsets"], part["esc_index"], part["esc_bits"])
            try:
                w = decode_w12(records, escapes)
            except ConfigError as e:
                raise ConfigError(f"W12 matrix {name!r} in {f}: {e}") from None
            want = meta.get(f"w12.sha256.{name}")
            if want is None:
                raise ConfigError(f"W12 matrix {name!r} in {f} has no checksum of the original weights")
            if digest(w) != want:
                raise ConfigError(f"W12 matrix {name!r} in {f} does not restore the original bf16 weights "
                                  "bit for bit (checksum differs); the records are damaged: refusing to load")
            out[name] = w
        out.update(tensors)  # tensors stored as they were
    return out


@dataclass
class ConvertReport:
    out: Path
    matrices: int = 0
    weights: int = 0  # weights in the converted matrices
    escapes: int = 0
    stored_bytes: int = 0  # W12 bytes of the converted matrices
    source_file_bytes: int = 0  # all weight files, before and after
    out_file_bytes: int = 0
    kept: list[str] = field(default_factory=list)  # tensors stored unchanged

    @property
    def escape_rate(self) -> float:
        return self.escapes / max(self.weights, 1)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.stored_bytes / max(self.weights, 1)

    @property
    def size_ratio(self) -> float:
        return self.out_file_bytes / max(self.source_file_bytes, 1)


def write_w12_checkpoint(src: str | Path, out: str | Path, device: str | torch.device = "cpu") -> ConvertReport:
    """Convert every 2-D bf16 tensor of checkpoint folder `src` to W12 in a new folder `out`, check
    each restores bit for bit (before writing, and again read back from disk), and copy config and
    tokenizer files. Raises ConfigError on a non-bf16 checkpoint, a used --out, or any difference."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tandem.models.files import read_config
    from tandem.models.files import weight_files as _weight_files

    src, out = Path(src), Path(out)
    if (src / "config.json").is_file():
        from tandem.models.qwen3_5 import is_qwen3_5

        try:
            hybrid = is_qwen3_5(json.loads((src / "config.json").read_text()))
        except (ValueError, AttributeError):
            hybrid = False  # (read_config says what is wrong with it)
        if hybrid:
            raise ConfigError(f"{str(src)!r} is a Qwen3.5 (hybrid) checkpoint; W12 conversion covers the attention-only "
                              "families (Llama, Mistral, Qwen2, Qwen3) for now")
    read_config(src)  # the clearest error for a wrong folder
    if is_w12_checkpoint(src):
        raise ConfigError(f"{str(src)!r} is already a W12 checkpoint")
    if out.resolve() == src.resolve():
        raise ConfigError("--out must be a new folder, not the source checkpoint")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} exists and is not an empty folder; pass a new folder")
    files = _weight_files(src)
    report = ConvertReport(out)
    plan: list[tuple[Path, dict[str, torch.Tensor], dict[str, str]]] = []
    for f in files:
        tensors: dict[str, torch.Tensor] = {}
        meta = {"format": "pt"}
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                t = sf.get_tensor(key)
                if t.dim() == 2 and t.dtype == torch.bfloat16:
                    records, escapes = encode_w12(t.to(device))
                    verify_w12(t, records, escapes, key)
                    parts = (records.data, records.base, torch.tensor(records.shape, dtype=torch.int64),
                             escapes.offsets, escapes.index, escapes.bits)
                    for p, v in zip(PARTS, parts):
                        tensors[f"{key}{SUFFIX}{p}"] = v.cpu().contiguous()
                    meta[f"w12.sha256.{key}"] = digest(t)
                    s = w12_stats(records, escapes)
                    report.matrices += 1
                    report.weights += s.weights
                    report.escapes += s.escapes
                    report.stored_bytes += s.stored_bytes
                elif t.is_floating_point() and t.dtype != torch.bfloat16:
                    raise ConfigError(f"W12 converts bfloat16 checkpoints; {key!r} in {f.name} is {t.dtype}: "
                                      "export the checkpoint in bfloat16 first")
                else:
                    tensors[key] = t
                    report.kept.append(key)
        plan.append((f, tensors, meta))
    if report.matrices == 0:
        raise ConfigError(f"{str(src)!r} has no 2-D bfloat16 tensors to convert")
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for f, tensors, meta in plan:
        save_file(tensors, str(out / f.name), metadata=meta)
        (out / f.name).chmod(0o644)  # safetensors writes 0600; match the copied files
        weight_map.update({k: f.name for k in tensors})
        report.source_file_bytes += f.stat().st_size
        report.out_file_bytes += (out / f.name).stat().st_size
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": report.out_file_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = {
        "quant_method": QUANT_METHOD, "format": FORMAT, "version": VERSION, "tile": [128, 64],
        "record_bytes": 12288, "matrices": report.matrices, "escape_rate": report.escape_rate,
        "bits_per_weight": round(report.bits_per_weight, 4),
    }
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for p in src.iterdir():  # tokenizer, generation config, model card
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, out / p.name)
    read_w12_checkpoint(out)  # read back from disk: every matrix's digest must match the original's
    return report
