"""A request's sampling settings, its lifecycle and its figures.

State machine (the scheduler moves it; only `abort` may jump to ABORTED from anywhere):

    WAITING --admit--> RUNNING --eos / stop / length--> FINISHED
       ^                  |
       +----preempt-------+      (its KV is freed; on re-admission prompt + output is recomputed)
"""
from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.config import ConfigError, GenerationConfig, SamplingConfig


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, named as in vLLM. temperature 0 is greedy."""

    max_tokens: int | None = 16  # None: up to the context window (as vLLM)
    temperature: float = 0.0
    top_p: float = 1.0
    # the request's own random stream (the same output whatever else is in the batch); None (vLLM's
    # default): a fresh random seed for each request, drawn when the engine takes it
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # completions per prompt (LLM.generate runs n requests, seeds seed, seed + 1, ... when a seed is
    # given; the engine itself takes one: Engine.add_request refuses n > 1)
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # vLLM accepts one string
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()  # at construction, as vLLM's: a bad value is named where it was written

    def sampling(self) -> SamplingConfig:
        """(seed None, not yet drawn by the engine: 0)"""
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=self.seed or 0)

    def generation(self, max_new: int) -> GenerationConfig:
        """max_new: max_tokens as the engine held it to the context window (for max_tokens None, the
        whole window after the prompt)."""
        return GenerationConfig(max_new_tokens=max_new, ignore_eos=self.ignore_eos, stop=self.stop)

    def validate(self) -> None:
        """One-line ConfigErrors naming the field (SamplingConfig's name the CLI's flags)."""
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ConfigError(f"max_tokens must be a positive integer or None (got {self.max_tokens!r})")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0.0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0 (got {self.temperature!r}); use 0 for greedy")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be a number in (0, 1] (got {self.top_p!r})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or None (got {self.seed!r})")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n must be a positive integer (got {self.n!r})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop must be non-empty strings (got {list(self.stop)!r})")


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class RequestFigures:
    """Per-request counters. tau: tokens committed per target verification pass, bonus included."""

    target_passes: int = 0  # verify passes (prefill chunks excluded)
    draft_tokens: int = 0  # draft tokens offered over all passes
    accepted_tokens: int = 0  # of those, accepted
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (last admission)
    ttft: float | None = None  # seconds from add_request to the first new token

    def tau(self, new_tokens: int) -> float:
        return new_tokens / max(1, self.target_passes)


_IDS = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_IDS)}"


@dataclass(eq=False)
class Request:
    """One generation request. `token_ids()` (prompt + output) is what the target has seen or
    will see; `num_computed` of them have their K/V in the pool (committed rows)."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    prompt: str | None = None  # the text, when the caller gave text
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # eos | length | stop | abort | error (it raised in its part of a step)
    stop_text: str | None = None  # text cut before the matched stop string
    stop_reason: str | None = None  # that stop string
    figures: RequestFigures = field(default_factory=RequestFigures)
    arrival: float = field(default_factory=time.perf_counter)
    num_computed: int = 0  # target K/V rows committed (reset by preemption)
    max_new: int = 0  # max_tokens, held to the context window (set by the engine)
    # engine-private state, dropped on preemption and at the end: the drafter, the emitter
    runtime: dict[str, Any] = field(default_factory=dict, repr=False)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """token_ids()[-1] without building the list (a step asks for every request's root)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def prefill_target(self) -> int:
        """Rows to compute before decoding: every token but the last, which is the root of the
        first verify pass (as in the single-request loop)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, in vLLM's shape: `finish_reason` is "stop" for an EOS as for a
    stop string (`stop_reason`: the string; None for an EOS), "length", "abort" or "error"."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | None
    cumulative_logprob: float | None = None  # (not computed)
    logprobs: None = None  # (not computed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """What `Engine.step` and `LLM.generate` hand back for a finished (or aborted) request. The
    fields are flat (`finish_reason`: eos | stop | length | abort | error, telling an EOS from a
    stop string); `outputs[0]` and `finished` give the same in vLLM's shape."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    figures: RequestFigures
    stop_reason: str | None = None  # the stop string that ended it
    samples: tuple["RequestOutput", ...] = ()  # SamplingParams.n > 1 (LLM.generate): the other completions

    @property
    def tau(self) -> float:
        return self.figures.tau(len(self.token_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every completion of the prompt (n of them), this one first."""
        return [CompletionOutput(i, o.text, o.token_ids, "stop" if o.finish_reason == "eos" else o.finish_reason,
                                 o.stop_reason) for i, o in enumerate((self, *self.samples))]
