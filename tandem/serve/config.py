"""ServerConfig: the server's knobs, one frozen record; `tandem serve`'s defaults come from it."""
from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.config import ConfigError
from tandem.engine.config import ENGINE_METHODS, EngineConfig

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServerConfig:
    host: str = LOOPBACK  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # required as `Authorization: Bearer KEY` on every /v1 route when set
    served_model_name: str = "tandem"  # the only `model` a request may name
    methods: tuple[str, ...] = ("tree", "ar")  # served engines; the first is a request's default
    # admitted requests (queued + running) at most; more get 503 + Retry-After. A burst of a few
    # hundred (an eval harness) queues, as it does on vLLM, which has no such bound
    max_pending: int = 1024
    retry_after_s: int = 1
    max_body_bytes: int = 1 << 20  # larger bodies get 413 before any parsing
    max_tokens_limit: int = 4096  # max_tokens above this (or above the context window) get 400
    max_n: int = 16  # choices per request (n): each is a request of its own, counted against max_pending
    max_stop: int = 4  # stop strings per request (OpenAI's limit)
    max_stop_chars: int = 256  # characters per stop string
    max_top_logprobs: int = 20  # chat's top_logprobs (completions' logprobs: at most 5, as OpenAI)
    # chunks a second that every open stream together is sent at most (0: a chunk per step): each
    # stream waits streams / max_chunk_rate seconds between chunks, joining the steps that come
    # meanwhile (its end is never held back): at 4,000, 8 streams get a chunk every 2 ms, 64 every 16 ms
    max_chunk_rate: float = 4000.0
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests may finish this long, then get 503
    # the reliability harness's faults: a request with `user` "tandem-fault" raises inside the
    # engine (it alone fails), one with "tandem-kill" stops the engine loop; never in production
    inject_faults: bool = False

    def validate(self) -> None:
        if not self.methods:
            raise ConfigError("serve at least one method (--methods ar,tree)")
        for m in self.methods:
            if m not in ENGINE_METHODS:
                raise ConfigError(f"unknown method {m!r} in --methods; choose from {', '.join(ENGINE_METHODS)}")
        if len(set(self.methods)) != len(self.methods):
            raise ConfigError(f"--methods names a method twice: {','.join(self.methods)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535 (got {self.port})")
        for name in ("max_pending", "max_body_bytes", "max_tokens_limit", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if not self.max_chunk_rate >= 0:
            raise ConfigError(f"--max-chunk-rate must be >= 0 chunks a second (0: a chunk per step; got {self.max_chunk_rate})")
        if not self.shutdown_grace_s >= 0:
            raise ConfigError(f"--shutdown-grace must be >= 0 seconds (got {self.shutdown_grace_s})")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key is empty; give a key or leave the flag out")
        if not self.served_model_name:
            raise ConfigError("--served-model-name is empty")


def engine_config_for(cfg: EngineConfig, method: str) -> EngineConfig:
    """The engine config of one served method: batch parallelism and row selection apply to the
    speculative methods only (an `ar` engine has nothing to draft)."""
    if method == "ar":
        return replace(cfg, method=method, batch_parallel=False, row_selection=False, prompt_admission=False)
    return replace(cfg, method=method)


def default_methods(target: str | None, draft: str | None, device: str = "cuda") -> tuple[str, ...]:
    """What a server serves without --methods: tree and ar where there is a drafter (a --draft, or
    the bundled pair), else ar. The first is a request's default: tree with a --draft; for the
    bundled pair tree on a GPU and ar on the CPU, where the engine's tree lost to ar at every
    concurrency (the bundled pair on this project's 2-core CPU,
    2026-12-07: 0.76x / 0.56x / 0.26x at 1 / 8 / 32 requests; `tandem bench --concurrency 1,8,32
    --methods ar,tree,tree+gate --draft eagle3 --num-prompts 32 --max-new-tokens 64`). A request still picks either with `method`."""
    if draft is None and target is not None:
        return ("ar",)
    return ("tree", "ar") if draft is not None or str(device).startswith("cuda") else ("ar", "tree")
