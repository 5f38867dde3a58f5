"""The server's Prometheus metrics, in a registry of its own (two servers in one process do not mix).

Request outcomes (the ledger: every request that passed validation ends in exactly one):
completed, aborted (client gone), rejected (503, queue full), failed (engine error).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter("tandem_draft_tokens", "Draft tokens offered to the target", registry=r)
        self.accepted_tokens = Counter("tandem_accepted_tokens", "Draft tokens accepted", registry=r)
        self.tau = Histogram("tandem_request_tau", "Tokens per target pass of each finished request",
                             ["method"], buckets=TAU_BUCKETS, registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Admission to first token", registry=r)
        self.queue_depth = Gauge("tandem_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("tandem_running_requests", "Requests the engine is decoding", registry=r)
        self.pending = Gauge("tandem_pending_requests", "Admitted requests not yet finished (the bounded queue)",
                             registry=r)
        self.kv_blocks = Gauge("tandem_kv_blocks_in_use", "KV blocks held by requests", ["method"], registry=r)
        self.kv_blocks_total = Gauge("tandem_kv_blocks_total", "KV blocks in the pool", ["method"], registry=r)
        self.step_seconds = Histogram("tandem_step_seconds", "Engine step time", ["method"], buckets=STEP_BUCKETS,
                                      registry=r)
        self.steps = Counter("tandem_steps", "Engine steps, by whether any draft token was verified",
                             ["method", "speculative"], registry=r)
        self.speculating = Gauge("tandem_step_speculative", "1 when the last step verified draft tokens",
                                 ["method"], registry=r)
        self.engine_alive = Gauge("tandem_engine_alive", "1 while the engine loop runs", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
