"""Where a measurement was taken: device, library versions, git commit, date, command line."""
from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tandem.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str | None:
    """HEAD (with -dirty), or $TANDEM_COMMIT where the tree travels without .git (the GPU machine)."""
    if os.environ.get("TANDEM_COMMIT"):
        return os.environ["TANDEM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                             check=False)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device | str) -> dict[str, Any]:
    dev = torch.device(device)
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    env: dict[str, Any] = {
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if dev.type == "cuda" else None,
        "transformers": tf_version,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([_prog()] + sys.argv[1:]),
    }
    return env


def _prog() -> str:
    name = Path(sys.argv[0]).name
    return "tandem" if name in ("__main__.py", "tandem", "-m") else name


def read_json(path: str | Path, flag: str) -> Any:
    """The JSON document at `path` (gzipped when it ends in .gz, as older results are kept),
    given on the command line as `flag`; ConfigError otherwise."""
    try:
        raw = Path(path).read_bytes()
        return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
    except gzip.BadGzipFile:
        raise ConfigError(f"{flag} {str(path)!r} ends in .gz but is not gzip data; give the plain .json "
                          "or gzip it") from None
    except OSError as e:
        raise ConfigError(f"cannot read {flag} {str(path)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} {str(path)!r} is not valid JSON ({e.msg})") from None


def ensure_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """Create the output folder now, before any work, so a bad path fails at once, not after a
    whole benchmark has run (its results would be lost)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {str(out)!r} is an existing file; give a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {flag} folder {str(out)!r}: {e.strerror}") from None
    return out


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=_jsonable) + "\n")


def _jsonable(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
