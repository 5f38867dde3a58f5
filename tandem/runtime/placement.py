"""Placement search (SwiftSpec s3.1.3, with several workers): which x : k-x split of k workers
(GPUs with nccl, processes with gloo) between a tensor-parallel target and a tensor-parallel
draft decodes fastest.

A small draft stops getting faster past a couple of GPUs while a large target keeps gaining
(SwiftSpec Table 1), so the best split depends on the models and the machine: each candidate
split decodes the same trial request (`trial_tokens` new tokens, greedy) and the split with the
highest decode rate wins. The result is cached by the caller (Generator keeps it per engine).
Each trial starts its own worker pool and closes it (a pool's ranks are fixed at its start);
`timeout_s` bounds every exchange with a worker (None: TANDEM_WORKER_TIMEOUT, else 30 s).
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig


@dataclass(frozen=True)
class Split:
    target: int  # x: tensor-parallel size of the target
    draft: int  # k - x: tensor-parallel size of the draft

    def __str__(self) -> str:
        return f"{self.target}:{self.draft}"


def candidate_splits(k: int) -> list[Split]:
    if k < 2:
        raise ConfigError(f"a split needs at least 2 workers, one per model (got {k})")
    return [Split(x, k - x) for x in range(1, k)]


def search_split(target_model, draft_model, prompt_ids: list[int], spec: SpecConfig, transport: str, k: int,
                 trial_tokens: int = 32, verbose: bool = True, timeout_s: float | None = None,
                 trial: Callable[[Split], float] | None = None) -> tuple[Split, dict[str, float]]:
    """Try every x : k-x split on one trial request; returns (the fastest split, tokens/s by split).

    `trial(split) -> decode tokens/s` runs the trial request (default: `async` over `transport`
    with the split's tensor-parallel sizes); tests pass a table. The highest rate wins; on a tie
    the split with the larger target wins."""
    if transport not in ("gloo", "nccl"):
        raise ConfigError(f"searching a split needs the process transports (gloo or nccl), not {transport!r}")
    if trial is None:
        trial = functools.partial(_trial_rate, target_model, draft_model, prompt_ids, spec, transport,
                                  trial_tokens, timeout_s)
    rates = {str(split): trial(split) for split in candidate_splits(k)}
    best = max(candidate_splits(k), key=lambda s: (rates[str(s)], s.target))
    if verbose:
        print("tandem async: split search " + ", ".join(f"{s} {v:.1f} tok/s" for s, v in rates.items())
              + f" -> {best} (target:draft)", file=sys.stderr)
    return best, rates


def _trial_rate(target_model, draft_model, prompt_ids: list[int], spec: SpecConfig, transport: str,
                trial_tokens: int, timeout_s: float, split: Split) -> float:
    """Decode tokens/s of the trial request (greedy, `trial_tokens` new tokens) on `split`."""
    from tandem.runtime.async_decode import generate_async

    gen = GenerationConfig(max_new_tokens=trial_tokens, ignore_eos=True)
    r = generate_async(target_model, draft_model, prompt_ids, spec, SamplingConfig(), gen, set(),
                       transport=transport, verbose=False, timeout_s=timeout_s,
                       tensor_parallel_size=split.target, draft_tensor_parallel_size=split.draft)
    return r.decode_tokens_per_s
