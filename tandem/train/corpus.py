"""A Python-source corpus from the running interpreter: the standard library and site-packages.

Every file gets a *key*: its path relative to the root it was found under, prefixed by the
root's kind, with forward slashes (``stdlib/json/decoder.py``, ``site/numpy/core/x.py``).
The key alone decides the held-out split (``sha1(key) % 100 < HELDOUT_PERCENT``), so the same
file is held out on every machine that has it, whatever else that machine has installed.

Held-out files never train anything, the tokenizer included; training files whose *content*
equals a held-out file's are dropped too, so exact copies (vendored modules) cannot leak.
"""
from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_PERCENT = 2
MIN_BYTES = 200
MAX_BYTES = 200_000
MAX_LINE_CHARS = 1000  # drops minified / generated-data files (base64 blobs, giant tables)
SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules"}


@dataclass(frozen=True)
class SourceFile:
    key: str  # "stdlib/json/decoder.py" | "site/numpy/core/x.py"
    path: Path
    size: int  # bytes on disk (before decoding)


def stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big")


def is_heldout(key: str, percent: int = HELDOUT_PERCENT) -> bool:
    """The split: a pure function of the key (identical on every machine and Python version)."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest(), 16) % 100 < percent


def roots() -> list[tuple[str, Path]]:
    """(kind, directory) for the running interpreter: stdlib first, then each site-packages."""
    out: list[tuple[str, Path]] = []
    std = sysconfig.get_paths().get("stdlib")
    if std and Path(std).is_dir():
        out.append(("stdlib", Path(std).resolve()))
    try:
        sites = site.getsitepackages()
    except AttributeError:  # some virtualenv flavours lack it
        sites = []
    for s in sites:
        p = Path(s)
        if p.is_dir() and all(p.resolve() != r for _, r in out):
            out.append(("site", p.resolve()))
    return out


def list_files(
    kinds: tuple[str, ...] = ("stdlib", "site"),
    min_bytes: int = MIN_BYTES,
    max_bytes: int = MAX_BYTES,
    skip_tests: bool = False,
) -> list[SourceFile]:
    """Every candidate `.py` file, sorted by key; the first root wins a duplicated key.

    A root nested inside another (site-packages inside the stdlib folder) is walked only as
    itself. Size filters use the size on disk; content filters come later, when files are read.
    """
    rts = [(k, r) for k, r in roots() if k in kinds]
    all_roots = {r for _, r in roots()}
    seen: dict[str, SourceFile] = {}
    for kind, root in rts:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            keep = []
            for d in sorted(dirnames):
                if d in SKIP_DIRS or d.endswith((".dist-info", ".egg-info")):
                    continue
                if skip_tests and d in ("test", "tests", "testing"):
                    continue
                sub = here / d
                if sub in all_roots or d in ("site-packages", "dist-packages"):
                    continue
                keep.append(d)
            dirnames[:] = keep
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                p = here / f
                try:
                    if p.is_symlink() or not p.is_file():
                        continue
                    size = p.stat().st_size
                except OSError:
                    continue
                if not (min_bytes <= size <= max_bytes):
                    continue
                key = f"{kind}/{p.relative_to(root).as_posix()}"
                seen.setdefault(key, SourceFile(key, p, size))
    return [seen[k] for k in sorted(seen)]


def read_source(path: Path, max_line_chars: int = MAX_LINE_CHARS) -> str | None:
    """The file's text if it is clean UTF-8 Python source worth training on, else None."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\x00" in text or not text.strip():
        return None
    text = text.replace("\r\n", "\n")
    if max(map(len, text.split("\n"))) > max_line_chars:
        return None
    return text


def content_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def heldout_files(limit: int | None = None, kinds: tuple[str, ...] = ("stdlib", "site")) -> list[Path]:
    """Held-out files of this interpreter (sorted by key), readable and de-duplicated by content.

    This is the split the bundled pair was evaluated on; the benchmark's `source` workload reads
    its prompts from here. `limit` caps the number of files (the first ones by key).
    """
    return [p for _, p, _ in _heldout(limit, kinds)]


def heldout_texts(limit: int | None = None, max_bytes: int | None = None,
                  kinds: tuple[str, ...] = ("stdlib", "site")) -> list[str]:
    """The texts of `heldout_files`, in the same order; `max_bytes` caps their total UTF-8 size."""
    out, total = [], 0
    for _, _, text in _heldout(limit, kinds):
        n = len(text.encode("utf-8"))
        if max_bytes is not None and out and total + n > max_bytes:
            break
        out.append(text)
        total += n
    return out


def heldout_keys(limit: int | None = None, kinds: tuple[str, ...] = ("stdlib", "site")) -> list[str]:
    return [k for k, _, _ in _heldout(limit, kinds)]


def _heldout(limit, kinds):
    out, hashes = [], set()
    for sf in list_files(kinds):
        if limit is not None and len(out) >= limit:
            break
        if not is_heldout(sf.key):
            continue
        text = read_source(sf.path)
        if text is None:
            continue
        h = content_hash(text)
        if h in hashes:
            continue
        hashes.add(h)
        out.append((sf.key, sf.path, text))
    return out


@dataclass
class Corpus:
    train_keys: list[str] = field(default_factory=list)
    train_texts: list[str] = field(default_factory=list)
    heldout_keys: list[str] = field(default_factory=list)
    heldout_texts: list[str] = field(default_factory=list)
    candidates: int = 0
    skipped_unreadable: int = 0
    skipped_duplicate: int = 0

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.train_texts)

    @property
    def heldout_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.heldout_texts)


def build_corpus(
    max_train_bytes: int,
    kinds: tuple[str, ...] = ("stdlib", "site"),
    min_bytes: int = MIN_BYTES,
    max_bytes: int = MAX_BYTES,
    skip_tests: bool = False,
    max_heldout_bytes: int | None = None,
    log=print,
) -> Corpus:
    """Training texts up to `max_train_bytes`, and the held-out texts, both deterministic.

    Files are listed in key order; under the byte cap the training files are taken in the order
    of `stable_hash(key)` (a fixed pseudo-random order, so a cap samples every package rather
    than the alphabetically first ones) and then put back in key order.
    """
    files = list_files(kinds, min_bytes, max_bytes, skip_tests)
    c = Corpus(candidates=len(files))
    held = [f for f in files if is_heldout(f.key)]
    train = [f for f in files if not is_heldout(f.key)]
    hashes: set[str] = set()

    def read_new(f) -> str | None:
        """The file's text unless unreadable or a copy of a text already taken (counted in c)."""
        text = read_source(f.path)
        if text is None:
            c.skipped_unreadable += 1
            return None
        h = content_hash(text)
        if h in hashes:
            c.skipped_duplicate += 1
            return None
        hashes.add(h)
        return text

    held_total = 0
    for f in held:  # key order; every held-out hash is recorded, so a training copy is excluded below
        text = read_new(f)
        if text is None:
            continue
        if max_heldout_bytes is None or held_total < max_heldout_bytes:
            c.heldout_keys.append(f.key)
            c.heldout_texts.append(text)
            held_total += len(text.encode("utf-8"))
    picked: list[tuple[str, str]] = []
    total = 0
    for f in sorted(train, key=lambda f: (stable_hash(f.key), f.key)):
        if total >= max_train_bytes:
            break
        text = read_new(f)
        if text is None:
            continue
        picked.append((f.key, text))
        total += len(text.encode("utf-8"))
    picked.sort()
    c.train_keys = [k for k, _ in picked]
    c.train_texts = [t for _, t in picked]
    log(f"corpus: {len(files)} candidate files; train {len(c.train_texts)} files {total / 1e6:.1f} MB; "
        f"held out {len(c.heldout_texts)} files {held_total / 1e6:.2f} MB; "
        f"skipped {c.skipped_unreadable} unreadable, {c.skipped_duplicate} duplicate")
    return c
