"""Loading a target/draft pair (default: the bundled pair) onto a device, with input checks."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.models.loader import load_model, load_tokenizer, read_config, resolve_dtype

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "assets" / "pair"
BUNDLED_TARGET = BUNDLED_DIR / "target"
BUNDLED_DRAFT = BUNDLED_DIR / "draft"


# --draft may name a bundled drafter instead of a folder
BUNDLED_DRAFTERS = {"draft": BUNDLED_DRAFT, "block": BUNDLED_DIR / "block", "eagle3": BUNDLED_DIR / "eagle3"}

# config.json `architectures` -> draft kind; anything else is a draft model (a causal LM)
DRAFT_ARCHITECTURES = {"TandemBlockDrafter": "block", "LlamaForCausalLMEagle3": "eagle3",
                       "Eagle3LlamaForCausalLM": "eagle3"}


def draft_kind(path: Path) -> str:
    """'model' (a small causal LM), 'block' (a parallel block drafter) or 'eagle3' (a head)."""
    import json

    try:
        archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return "model"  # read_config gives the clear error
    return next((DRAFT_ARCHITECTURES[a] for a in archs if a in DRAFT_ARCHITECTURES), "model")


def drafter_kind(model) -> str | None:
    """draft_kind of a loaded drafter (None: no drafter)."""
    if model is None:
        return None
    return "eagle3" if hasattr(model, "econfig") else "block" if hasattr(model, "bconfig") else "model"


def needs_draft_model(method: str, kind: str | None) -> str | None:
    """Why `method` cannot run with a drafter of `kind` (async and tlv run a draft model), or None."""
    if method not in ("async", "tlv") or kind in (None, "model"):
        return None
    what = {"eagle3": "an EAGLE-3 head drafts from the target's features",
            "block": "a block drafter already drafts in one pass per verify"}[kind]
    return f"--method {method} runs a draft model; {what}: use --method tree or chain with it"


def _is_hybrid(path: Path) -> bool:
    import json

    from tandem.models.qwen3_5 import is_qwen3_5

    try:
        return is_qwen3_5(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return False  # read_config gives the clear error


def bundled_available() -> bool:
    return (BUNDLED_TARGET / "config.json").is_file() and (BUNDLED_DRAFT / "config.json").is_file()


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for but no CUDA GPU is visible to PyTorch; use cpu "
                          "(--device cpu, device=\"cpu\")")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"unknown device {name!r}; use cpu or cuda")
    return torch.device(name)


# Which bundled drafter a single request gets when none is named, by device. On a GPU the EAGLE-3 head: MBPP,
# bf16, one H100 (2026-12-06, bench/results/h100-2026-12-06-gemv/call3 and h100-2026-12-06-head): `tree` 2.35x
# `ar` with the head, 1.40x with the small draft model (each against `ar` in its own call). On the CPU the small
# draft model: there the two were even (`auto` 1.19x and 1.32x with overlapping intervals, this 2-core machine,
# 2026-12-06: `tandem bench --workload source --num-prompts 8 --max-new-tokens 96 --methods ar,chain,tree,auto
# --warmup 1 --draft draft|eagle3`), and it is the drafter every method runs (`async` and `tlv` need one).
GPU_DEFAULT_DRAFTER = "eagle3"


def default_drafter(method: str, device: str | None, certified_head: bool = False) -> str | None:
    """The bundled drafter `tandem generate` loads when neither --target nor --draft is given: a name of
    BUNDLED_DRAFTERS, or None for the bundled pair's own draft model."""
    if method in ("auto", "chain", "tree") and not certified_head and resolve_device(device).type == "cuda":
        return GPU_DEFAULT_DRAFTER
    return None


@dataclass
class Pair:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object
    target_dir: Path
    draft_dir: Path | None


def resolve_target(target: str | Path | None) -> Path:
    """The target's folder: the given one, or the bundled target (ConfigError when it is missing)."""
    if target is None:
        if not bundled_available():
            raise ConfigError("no --target given and the bundled pair is missing; pass --target DIR")
        return BUNDLED_TARGET
    return Path(target)


def target_tokenizer(target: str | Path | None) -> tuple[Path, object]:
    """The target's folder (resolve_target) and its tokenizer, after the checks that give a wrong
    folder its clear error; all a process that loads no model needs (`tandem serve
    --engine-process`). Raises ConfigError on bad input."""
    target = resolve_target(target)
    if not _is_hybrid(target):  # Qwen3.5 (tandem.models.qwen3_5) reads its own config
        read_config(target)  # the clearest error for a wrong directory comes from its config
    return target, load_tokenizer(target)


def load_pair(target: str | Path | None = None, draft: str | Path | None = None, device: str | None = "cpu",
              dtype: str = "float32", need_draft: bool = True, method: str | None = None) -> Pair:
    """Load target (+ draft); without paths, the bundled pair. Raises ConfigError on bad input
    (with `method`, also a drafter that method cannot run: before any weights load)."""
    dev = resolve_device(device)
    resolve_dtype(dtype)
    if target is None and draft is None and need_draft:  # the bundled pair
        draft = BUNDLED_DRAFT
    target = resolve_target(target)
    if isinstance(draft, str) and draft in BUNDLED_DRAFTERS and not Path(draft).exists():
        draft = BUNDLED_DRAFTERS[draft]
        if not (draft / "config.json").is_file():
            raise ConfigError(f"the bundled drafter {str(draft)!r} is missing from this install")
    draft = Path(draft) if draft is not None and need_draft else None
    target, tokenizer = target_tokenizer(target)
    kind = draft_kind(draft) if draft is not None else None
    why = needs_draft_model(method, kind) if method is not None else None
    if why:
        raise ConfigError(why)
    if kind == "model":
        if not _is_hybrid(draft):  # (a Qwen3.5 draft reads its own config, as a Qwen3.5 target does)
            read_config(draft)
        if load_tokenizer(draft).get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"draft {str(draft)!r} and target {str(target)!r} use different tokenizers; "
                              "speculative decoding needs one shared vocabulary")
    elif kind is not None and not draft.is_dir():
        raise ConfigError(f"draft directory {str(draft)!r} does not exist")
    tm = _load("target", target, dev, dtype)
    dm = None
    if kind == "model":
        dm = _load("draft", draft, dev, dtype)
        tv, dv = tm.config.vocab_size, dm.config.vocab_size
        if dv > tv:  # (a padded embedding: it could draft ids the target has no row for)
            raise ConfigError(f"draft {str(draft)!r} has vocab_size {dv}, more than the target's {tv}: it could "
                              f"draft ids the target cannot verify; use a draft whose vocab_size is at most {tv}")
    elif kind == "block":  # heads ship no tokenizer: the target's applies
        from tandem.models.block_drafter import load_block_drafter

        dm = load_block_drafter(draft, tm, dev, resolve_dtype(dtype))
    elif kind == "eagle3":  # EAGLE-3 heads ship no tokenizer either
        from tandem.models.eagle3 import load_eagle3

        dm = load_eagle3(draft, tm, dev, resolve_dtype(dtype))
    return Pair(tm, dm, tokenizer, target, draft)


def _load(role: str, path: Path, device: torch.device, dtype: str) -> torch.nn.Module:
    """load_model, with its errors saying which checkpoint of the pair (target or draft) is wrong."""
    try:
        return load_model(path, device, dtype)
    except ConfigError as e:
        where = f"{role} checkpoint" if str(path) in str(e) else f"{role} checkpoint {str(path)!r}"
        raise ConfigError(f"{where}: {e}") from None
