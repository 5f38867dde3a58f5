"""GenerationResult: what one decoded request returns (tokens, finish reason, tau, timings).
Every single-request loop (serial, async, hybrid) and the engine's clients read it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens (EOS included when generation stopped on it)
    prompt_tokens: int
    method: str
    target_passes: int
    draft_steps: int
    accept_lengths: list[int]  # accepted draft tokens per target pass (bonus excluded)
    seconds: float
    ttft: float  # seconds from start to the first new token
    finish_reason: str  # eos | length | stop
    stop_trimmed_text: str | None = None  # text cut before the stop string, when one matched
    per_depth: list[tuple[int, int]] = field(default_factory=list)  # (offered, accepted) per depth 1..
    # seconds spent drafting and verifying over the request (serial loop: device time between
    # CUDA events on the GPU, host time on the CPU; None where not measured)
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    # which loop decoded it: "resident" (tandem.runtime.resident, on the device) or "host"
    loop: str = "host"
    # --method auto: the candidate it ran ("ar", "chain", "tree", or a shape such as "tree d=3")
    auto_pick: str | None = None
    # target passes computed after the request had ended and thrown away (the resident loop queues
    # steps ahead of the one it reads); their time is in `seconds` and in draft/verify_seconds
    passes_past_end: int = 0

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tau(self) -> float:
        """Tokens committed per target verification pass, bonus included (1.0 for ar)."""
        return self.new_tokens / max(1, self.target_passes)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first (excludes prefill)."""
        dt = self.seconds - self.ttft
        return (self.new_tokens - 1) / dt if dt > 0 and self.new_tokens > 1 else 0.0
