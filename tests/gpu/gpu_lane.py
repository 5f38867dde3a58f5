"""What the GPU lane's tests share. The lane is one command on a CUDA machine:

    python -m pytest -q -m cuda tests/gpu

Tests take a `device` parameter. CUDA parameters carry the `cuda` marker and are skipped
without a GPU (the reason shows under -ra); where the same logic runs on the CPU, a CPU
parameter (CUDA-graph path emulated, tiny models) runs in the ordinary suite, so CI exercises
the logic the GPU runs.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

GPU_LANE = "python -m pytest -q -m cuda tests/gpu"
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs a CUDA GPU (GPU lane: {GPU_LANE})")

# Python openings the bundled pair was not trained on, as GPU-lane prompts (no dataset needed)
PROMPTS = [
    'def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    """Merge two sorted lists."""\n',
    "class LRUCache:\n    def __init__(self, capacity: int):\n        self.capacity = capacity\n",
    "import os\n\n\ndef walk_py_files(root):\n    for dirpath, _, names in os.walk(root):\n",
]


def cuda(*values, id: str):
    """A parameter set that runs only in the GPU lane."""
    return pytest.param(*values, marks=(pytest.mark.cuda, NEEDS_CUDA), id=id)


def cpu(*values, id: str):
    return pytest.param(*values, id=id)


def graphs_for(device: str) -> bool | str:
    """Real CUDA graphs on the GPU; their bookkeeping emulated (eager replay) on the CPU."""
    return True if device == "cuda" else "emulate"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@functools.lru_cache(maxsize=None)
def bundled_pair(device: str, dtype: str = "float32"):
    """The bundled pair on `device` (loaded once per session) and PROMPTS as token ids."""
    from tandem.runtime.pair import load_pair

    pair = load_pair(device=device, dtype=dtype)
    return pair.target, pair.draft, [pair.tokenizer.encode(p).ids for p in PROMPTS]


@functools.lru_cache(maxsize=None)
def preset_model(name: str, layers: int, device: str, dtype: str):
    """A preset's shapes (random weights) cut to `layers` layers: real widths, a short test."""
    from tandem.bench.presets import PRESETS, random_model
    from tandem.models.loader import resolve_dtype

    cfg = dataclasses.replace(PRESETS[name], num_hidden_layers=layers)
    return random_model(cfg, device, resolve_dtype(dtype))


@torch.no_grad()
def first_wrong_token(model, prompt: list[int], new: list[int], near_tie: float = 1e-3) -> dict | None:
    """Check greedy output against an uncached causal forward of prompt + output: every new token
    must be the argmax after the tokens before it, up to a near-tie (logit margin <= near_tie).
    Returns the first token that is not, or None."""
    full = torch.tensor([list(prompt) + list(new)], device=model.device)
    logits = model(full)[0].float()  # [L, vocab], no KV cache
    for i, t in enumerate(new):
        row = logits[len(prompt) - 1 + i]
        best = int(row.argmax())
        if best != t and float(row[best] - row[t]) > near_tie:
            return {"index": i, "got": t, "want": best, "margin": float(row[best] - row[t])}
    return None


@pytest.fixture
def no_grad():
    """The kernels have no backward: with grad enabled the torch paths would run instead. A
    module opts in with `pytestmark = pytest.mark.usefixtures("no_grad")` (or its autouse fixture)."""
    with torch.no_grad():
        yield

