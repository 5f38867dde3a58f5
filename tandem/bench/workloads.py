"""Benchmark workloads: named prompt sets and generic JSONL files, as a list of `Prompt`s.

Known names (read from `<repo>/../shared/datasets`, or `--data-dir`):

- ``mbpp``: MBPP test split (task_ids 11-510); prompt = the function signature line from
  ``code`` followed by the task text as a docstring (a completion prompt for a code model).
- ``spec-bench``: Spec-Bench's 480 questions (6 subtasks); prompt = the first turn.
- ``mt-bench``: MT-Bench's 80 questions; prompt = the first turn.
- ``gsm8k``: GSM8K test; prompt = ``"Question: ...\\nAnswer:"``.
- ``source``: the first `source_lines` lines of held-out Python files
  (`tandem.train.corpus.heldout_files`), the split the bundled pair never trained on.
- ``FILE.jsonl``: one JSON object per line with a ``prompt`` string (``id`` optional).
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from tandem.config import ConfigError

WORKLOADS = ("mbpp", "spec-bench", "mt-bench", "gsm8k", "source")
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "datasets"
_FILES = {
    "mbpp": "mbpp/mbpp.jsonl",
    "spec-bench": "spec_bench/question.jsonl",
    "mt-bench": "mt_bench/question.jsonl",
    "gsm8k": "gsm8k/test.jsonl",
}
MBPP_TEST_IDS = range(11, 511)
_DEF_RE = re.compile(r"^def\s+\w+\s*\(.*\)\s*(->.*)?:\s*$")


@dataclass(frozen=True)
class Prompt:
    id: str  # stable id within the workload (task id, question id, file key, line number)
    text: str
    category: str | None = None


def add_workload_arguments(p: argparse.ArgumentParser, num_prompts: int = 16) -> None:
    p.add_argument("--workload", default="mbpp",
                   help=f"{' | '.join(WORKLOADS)} | FILE.jsonl (records with a 'prompt' string)")
    p.add_argument("--data-dir", default=None, help=f"datasets folder (default: {DEFAULT_DATA_DIR})")
    p.add_argument("--num-prompts", type=int, default=num_prompts, help="prompts taken from the workload, in order")
    p.add_argument("--source-lines", type=int, default=32, help="lines per prompt for --workload source")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="truncate prompts from the left to this many tokens")


def load_workload(name: str, num_prompts: int, data_dir: str | Path | None = None,
                  source_lines: int = 32) -> list[Prompt]:
    """The first `num_prompts` prompts of workload `name` (see the module docstring)."""
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1 (got {num_prompts})")
    if name == "source":
        return _source(num_prompts, source_lines)
    if name in _FILES:
        root = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
        path = root / _FILES[name]
        if not path.is_file():
            raise ConfigError(f"workload {name!r} needs {path}; pass --data-dir DIR holding {_FILES[name]}")
        records = _read_jsonl(path)
        make = {"mbpp": _mbpp, "spec-bench": _turn, "mt-bench": _turn, "gsm8k": _gsm8k}[name]
        prompts = [p for p in (make(r, i) for i, r in enumerate(records)) if p is not None]
    elif name.endswith(".jsonl") or Path(name).is_file():
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"workload file {name!r} does not exist; give a JSONL file or one of {', '.join(WORKLOADS)}")
        prompts = []
        for i, r in enumerate(_read_jsonl(path)):
            if not isinstance(r.get("prompt"), str):
                raise ConfigError(f"{path}:{i + 1} has no 'prompt' string; each JSONL record needs one")
            prompts.append(Prompt(str(r.get("id", i)), r["prompt"], r.get("category")))
    else:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} or a FILE.jsonl")
    prompts = [p for p in prompts if p.text.strip()]
    if not prompts:
        raise ConfigError(f"workload {name!r} has no non-empty prompts")
    return prompts[:num_prompts]


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{i + 1} is not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}:{i + 1} must be a JSON object")
        out.append(rec)
    return out


def mbpp_prompt(text: str, code: str) -> str:
    """`def f(a, b):` + the task text as its docstring; without a def, the docstring alone."""
    doc = " ".join(text.split()).replace('"""', "'''")
    sig = next((ln.rstrip() for ln in code.replace("\r\n", "\n").split("\n") if _DEF_RE.match(ln.rstrip())), None)
    if sig is None:
        return f'"""{doc}"""\n'
    return f'{sig}\n    """{doc}"""\n'


def _mbpp(r: dict, i: int) -> Prompt | None:
    if int(r.get("task_id", -1)) not in MBPP_TEST_IDS:
        return None
    return Prompt(str(r["task_id"]), mbpp_prompt(r.get("text", ""), r.get("code", "")))


def _turn(r: dict, i: int) -> Prompt | None:
    turns = r.get("turns") or []
    if not turns or not isinstance(turns[0], str):
        return None
    return Prompt(str(r.get("question_id", i)), turns[0], r.get("category"))


def _gsm8k(r: dict, i: int) -> Prompt | None:
    q = r.get("question")
    return Prompt(str(i), f"Question: {q}\nAnswer:") if isinstance(q, str) else None


def _source(num_prompts: int, lines: int) -> list[Prompt]:
    try:
        from tandem.train.corpus import heldout_files
    except ImportError:
        raise ConfigError("--workload source needs tandem.train.corpus.heldout_files (the training recipe); "
                          "it is not available in this install") from None
    if lines < 1:
        raise ConfigError(f"--source-lines must be >= 1 (got {lines})")
    out: list[Prompt] = []
    # Some files are too short or blank at the top; ask for a few more than needed.
    limit = 2 * num_prompts + 8
    files = heldout_files(limit=limit)
    try:  # machine-independent ids ("stdlib/json/decoder.py") where the corpus offers them
        from tandem.train.corpus import heldout_keys

        keys = heldout_keys(limit=limit)
    except ImportError:
        keys = []
    if len(keys) != len(files):
        keys = [str(f) for f in files]
    for key, path in zip(keys, files):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        head = "".join(text.splitlines(keepends=True)[:lines])
        if len(head.strip()) >= 40:
            out.append(Prompt(key, head))
        if len(out) >= num_prompts:
            break
    if not out:
        raise ConfigError("--workload source found no held-out Python files on this interpreter")
    return out
