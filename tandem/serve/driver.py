"""EngineDriver: ONE thread owns the engines and steps them while requests exist.

HTTP handlers never touch an engine. They `submit` a Job (its `put` is called on its event
`loop` with each event, a whole step's events for one loop delivered by ONE
`loop.call_soon_threadsafe`, not one wake-up per request) and `abort` by id; both are
commands on a thread-safe queue that the engine thread drains between steps, so every engine
call happens on the one thread, in order (an abort always follows its add).

After each step, every live request whose output grew gets a `Delta` (its new token ids and
their target logprobs), and every finished one a `Finished`. A step that raises fails the
requests of that engine only (`Failed`, the error logged, not sent) and aborts them; if the
pool is not clean afterwards, or anything outside a step raises, the loop ends and `alive` goes
False (so /health answers 503) after failing every live request.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Union

from tandem.config import ConfigError
from tandem.engine.request import Request, RequestOutput, SamplingParams
from tandem.serve.logprobs import LogprobEngine, TokenLogprob
from tandem.serve.metrics import ServerMetrics

log = logging.getLogger("tandem.serve")


# Fault injection for the reliability harness (`tandem serve --inject-faults`): a request whose
# id starts with FAULT_PREFIX raises inside the engine in its own part of a step (it alone
# fails); one starting with KILL_PREFIX stops the engine loop (/health then answers 503).
FAULT_PREFIX, KILL_PREFIX = "fault-", "kill-"
FAULT_USER, KILL_USER = "tandem-fault", "tandem-kill"  # the `user` field that asks for each


class InjectedFault(RuntimeError):
    pass


def inject_faults(req: Request) -> None:
    """Engine.fault_hook under --inject-faults."""
    if req.request_id.startswith(FAULT_PREFIX):
        raise InjectedFault(f"injected fault in request {req.request_id}")


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token when the request asked for logprobs


@dataclass(frozen=True)
class Finished:
    output: RequestOutput
    method: str
    logprobs: list[TokenLogprob] | None  # one per output token


@dataclass(frozen=True)
class Failed:
    message: str  # for the client: never the exception's text
    status: int = 500
    code: str = "engine_error"


Event = Union[Delta, Finished, Failed]


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str
    top_logprobs: int | None  # None: no logprobs; k: the token's own plus k alternatives
    # `put(event)` runs on `loop`'s thread; a step's events for one loop arrive in one call (post)
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    put: Callable[[Event], None] | None = field(default=None, repr=False)


@dataclass
class _Live:
    job: Job
    engine: LogprobEngine
    request: Request
    sent: int = 0  # output tokens already handed out


def pool_report(engines: dict[str, LogprobEngine]) -> dict[str, dict]:
    """Per served method: the pool's check() problems, free and total blocks, open sequences,
    requests in the engine (a clean idle server: no problem, every block free, none open) and the
    engine's preemptions so far."""
    return {m: {"problems": e.pool.check(), "free": e.pool.num_free, "blocks": e.pool.num_blocks,
                "sequences": len(e.pool.seqs), "requests": len(e.requests), "preemptions": e.counters.preemptions}
            for m, e in engines.items()}


def _deliver(items: list) -> None:
    """On an event loop's thread: each (put, event) of a step, in order."""
    for put, event in items:
        put(event)


def post(pairs: list[tuple[Job, Event]]) -> None:
    """Each event loop gets its jobs' events in one call_soon_threadsafe, in order."""
    out: dict = {}
    for job, event in pairs:
        out.setdefault(job.loop, []).append((job.put, event))
    for loop, items in out.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the handler's event loop is closed (server shutting down)
            pass


def spare_main_thread(device: str) -> int | None:
    """Call before loading models when the engine will step on another thread. On the CPU the main
    thread takes one intra-op thread (it forms no OpenMP team), and the returned count is the
    engine thread's (EngineDriver(threads=...)); on another device nothing changes (None). Measured on this project's 2-core CPU (torch
    2.13, libgomp): once the main thread has run a parallel op, a [64, 64] x [64, 128] linear on
    another thread takes 24-41 us against 8 us on the main thread (bench/cpu_thread_ops.py), and
    the in-process server at 64 streams delivered 0.31x of the offline engine."""
    if not str(device).startswith("cpu"):
        return None
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    return n


GAUGE_S = 0.02  # the gauges (queue depth, running, KV blocks) while busy: set this often, not every step


class EngineDriver:
    def __init__(self, engines: dict[str, LogprobEngine], metrics: ServerMetrics, idle_wait_s: float = 0.05,
                 threads: int | None = None):
        """threads: torch's intra-op threads for the engine thread (spare_main_thread's count)."""
        self.engines, self.metrics, self.idle_wait_s = engines, metrics, idle_wait_s
        self.threads = threads
        self._running = False  # the loop runs (set before its thread starts, so alive holds from start())
        self._gauges_at = 0.0  # (perf_counter) when the gauges are next set while the engines are busy
        self.commands: queue.Queue = queue.Queue()
        self.live: dict[str, _Live] = {}  # engine thread only
        self._outbox: list[tuple[Job, Event]] = []  # this step's events, engine thread only
        self.error: str | None = None
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._main, name="tandem-engine", daemon=True)

    # ---- any thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self.thread.start()

    def run(self) -> None:
        """The loop on the calling thread (the engine process's main thread, which loaded the
        models: on the CPU torch's intra-op threads are fast only there, see spare_main_thread)."""
        self._running = True
        self._main()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is in flight (each gets `Failed`) and end the loop."""
        self._stopping.set()
        self.commands.put(None)  # wake an idle loop
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._running and self.error is None and not self._stopping.is_set()

    def submit(self, job: Job) -> Future:
        """Resolves (None) once the engine holds the request; raises ConfigError if it refused it."""
        fut: Future = Future()
        self.commands.put(("add", job, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def pools(self) -> Future:
        """Resolves to each engine's KV pool between two steps (`pool_report`), taken on the engine thread."""
        fut: Future = Future()
        self.commands.put(("pools", fut))
        return fut

    # ---- the engine thread -----------------------------------------------------------------
    def _main(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        self.metrics.engine_alive.set(1)
        try:
            while not self._stopping.is_set():
                busy = any(e.has_unfinished() for e in self.engines.values())
                self._drain(block=not busy)
                for method, engine in self.engines.items():
                    if engine.has_unfinished():
                        self._step(method, engine)
                self._flush()
                if not busy or time.perf_counter() >= self._gauges_at:  # (gauges: every GAUGE_S while busy)
                    self._gauges()
                    self._gauges_at = time.perf_counter() + GAUGE_S
        except Exception as e:  # a bug outside a step: the loop is dead, say so everywhere
            log.exception("the engine loop stopped")
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._running = False
            self.metrics.engine_alive.set(0)
            for rid in list(self.live):
                if self.error is None:  # stop(): a shutdown, not a fault
                    self._fail(self.live.pop(rid), "the server is shutting down; retry on a running server",
                               status=503, code="server_shutting_down")
                else:
                    self._fail(self.live.pop(rid), "the engine stopped")
            self._drain(block=False)  # adds that raced the stop: refused
            self._flush()
            self._gauges()

    def _drain(self, block: bool) -> None:
        if not block and not self.commands.queue:  # (the queue's deque, read without its lock: a busy loop's usual case)
            return
        try:
            cmd = self.commands.get(timeout=self.idle_wait_s) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is not None:
                if cmd[0] == "add":
                    self._add(cmd[1], cmd[2])
                elif cmd[0] == "pools":
                    cmd[1].set_result(pool_report(self.engines))
                else:
                    self._abort(cmd[1])
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, job: Job, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # the handler gave up first
        if job.request_id.startswith(KILL_PREFIX):  # fault injection (tandem serve --inject-faults)
            fut.set_exception(ConfigError("the engine loop was stopped on purpose (--inject-faults)"))
            raise InjectedFault("the engine loop was stopped on purpose (--inject-faults)")
        if not self.alive:
            fut.set_exception(ConfigError("the engine is not running"))
            return
        engine = self.engines[job.method]
        try:
            req = engine.add_request(job.prompt_ids, job.params, request_id=job.request_id)
        except ConfigError as e:
            fut.set_exception(e)
            return
        if job.top_logprobs is not None:
            engine.want_logprobs(job.request_id, job.top_logprobs)
        self.live[job.request_id] = _Live(job, engine, req)
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        fut.set_result(None)

    def _abort(self, request_id: str) -> None:
        live = self.live.pop(request_id, None)
        if live is None:
            return  # finished already, or never added
        live.engine.abort(request_id)
        live.engine.forget(request_id)
        self.metrics.requests.labels("aborted").inc()

    def _step(self, method: str, engine: LogprobEngine) -> None:
        mine = [lv for lv in self.live.values() if lv.engine is engine]
        t0 = time.perf_counter()
        try:
            finished = engine.step()
        except Exception:
            log.exception("an engine step failed (method %s); failing its %d requests", method, len(mine))
            self._engine_fault(engine, mine)
            return
        m = self.metrics
        m.step_seconds.labels(method).observe(time.perf_counter() - t0)
        # (the step's own record: it verified draft nodes; not two sums over the requests' figures)
        records = engine.counters.records
        speculative = bool(records) and records[-1].nodes > 0
        m.steps.labels(method, "true" if speculative else "false").inc()
        m.speculating.labels(method).set(int(speculative))
        new = self._publish_all(mine)
        if new:
            m.generation_tokens.inc(new)  # (once a step: a metric call per request is a cost per token)
        for out in finished:
            lv = self.live.pop(out.request_id, None)
            if lv is None:
                continue
            if out.finish_reason == "error":  # it raised in its own part of the step: it alone fails
                self._fail(lv, "the engine failed on this request; it was aborted")
            else:
                self._finish(lv, out, method)

    def _publish_all(self, mine: list[_Live]) -> int:
        """A Delta for each of `mine` that committed tokens in this step; returns how many tokens."""
        return sum(self._publish(lv) for lv in mine)

    def _publish(self, lv: _Live) -> int:
        """A Delta for the tokens `lv` committed since the last one; returns how many."""
        out = lv.request.output_ids
        n = len(out) - lv.sent
        if n <= 0:
            return 0
        lps = lv.engine.logprobs.get(lv.job.request_id)
        self._send(lv, Delta(out[lv.sent:], lps[lv.sent:len(out)] if lps is not None else None))
        lv.sent = len(out)
        return n

    def _finish(self, lv: _Live, out: RequestOutput, method: str) -> None:
        lps = lv.engine.logprobs.get(out.request_id)
        lv.engine.forget(out.request_id)
        f, m = out.figures, self.metrics
        m.requests.labels("completed").inc()
        m.draft_tokens.inc(f.draft_tokens)
        m.accepted_tokens.inc(f.accepted_tokens)
        m.tau.labels(method).observe(out.tau)
        if f.ttft is not None:
            m.ttft.observe(f.ttft)
        self._send(lv, Finished(out, method, lps[:len(out.token_ids)] if lps is not None else None))

    def _engine_fault(self, engine: LogprobEngine, mine: list[_Live]) -> None:
        for lv in mine:
            self.live.pop(lv.job.request_id, None)
            engine.abort(lv.job.request_id)
            self._fail(lv, "the engine failed on this request; it was aborted")
        problems = engine.pool.check()
        if problems or engine.has_unfinished():
            raise RuntimeError(f"the KV pool is inconsistent after a failed step: {problems[:3]}")

    def _fail(self, lv: _Live, message: str, status: int = 500, code: str = "engine_error") -> None:
        if lv.engine.requests.get(lv.job.request_id) is not None:
            lv.engine.abort(lv.job.request_id)
        lv.engine.forget(lv.job.request_id)
        self.metrics.requests.labels("failed").inc()
        self._send(lv, Failed(message, status, code))

    def _send(self, lv: _Live, event: Event) -> None:
        self._outbox.append((lv.job, event))

    def _flush(self) -> None:
        """Hand each event loop its events of this step in one call (in the order they were sent)."""
        box, self._outbox = self._outbox, []
        post(box)

    def _gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(sum(len(e.scheduler.waiting) for e in self.engines.values()))
        m.running.set(sum(len(e.scheduler.running) for e in self.engines.values()))
        for method, e in self.engines.items():
            m.kv_blocks.labels(method).set(e.pool.num_blocks - e.pool.num_free)
            m.kv_blocks_total.labels(method).set(e.pool.num_blocks)
