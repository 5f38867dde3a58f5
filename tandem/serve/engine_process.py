"""The engine loop in a process of its own (`tandem serve --engine-process`).

In one process the engine thread and the HTTP side (detokenizing, JSON, one SSE chunk per stream
per step) share one interpreter lock: on the H200 (2026-12-02) the server delivered 0.15-0.5x of
the offline engine's tokens from 8 streams up (its load generator then ran in the server's own
process too). Here the child process loads the models and runs the unchanged EngineDriver; the
server process keeps the tokenizer, the routes and the streams, and a stream that falls behind
joins the steps' tokens into one chunk (RequestHandle.next_merged) while the engine runs on.

    server process                                   engine process (spawned)
    ProcessDriver.submit(job) ---- ("add", ...) ---->  EngineDriver.submit
    ProcessDriver.abort(rid) ----- ("abort", rid) -->  EngineDriver.abort
    ProcessDriver.pools() -------- ("pools", n) ---->  EngineDriver.pools (between two steps)
                   <------------- ("pools", n, report)
    reader thread  <-- ("events", acks, rids, counts, tokens, logprobs, ends, metric calls)  every turn
      -> the acks first (each add: (rid, None) taken, or (rid, error) refused; they ride in the
         turn's message, not a write each: a pipe write in the engine loop for every request);
         then each event loop gets its requests' events in one call_soon_threadsafe;
         the metric calls are replayed on the server's ServerMetrics
         (deltas: flat lists of request ids, token counts and tokens (_Deltas), logprobs only for
         the requests that asked; the per-request part of every step kept to a few plain lists;
         ends: (rid, Finished | Failed); counter increments summed per turn)
    ProcessDriver.stop() --------- ("stop",) ------->  EngineDriver.stop (in-flight: 503), exit
                   <------------- ("ended", error)     also when the loop dies (error: its text)

The child runs the engine loop on its main thread, the one that loaded the models (on the CPU,
torch ops on another thread cost several times as much: tandem.serve.driver.spare_main_thread),
and reads the pipe on a thread of its own. It ignores SIGINT and SIGTERM: the server process's
shutdown path stops it (a terminal's Ctrl-C reaches the whole process group); if the server
process dies, the pipe closes and the child stops and exits.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from tandem.config import ConfigError
from tandem.engine.config import EngineConfig
from tandem.serve.driver import Delta, EngineDriver, Event, Failed, Job, post

START_TIMEOUT_S = 900.0  # loading the models (the child's whole start)


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds its engines from (the server process loads no model)."""

    target: str | None  # None: the bundled pair
    draft: str | None
    device: str
    dtype: str
    methods: tuple[str, ...]
    engine_config: EngineConfig
    inject_faults: bool = False


# ---- metrics: recorded in the child, replayed on the server's registry -----------------------
class _Recorder:
    """Stands for ServerMetrics in the child: every call on a metric is kept (name, labels, op,
    value) for the server process to replay; gauges keep only their last value per turn."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, str, float]] = []  # observations, in order
        self.incs: dict[tuple[str, tuple], float] = {}  # counter increments, summed until the next take
        self.gauges: dict[tuple[str, tuple], float] = {}
        self.sent: dict[tuple[str, tuple], float] = {}  # gauges as the server process last had them

    def __getattr__(self, name: str) -> "_Metric":
        m = self.__dict__[name] = _Metric(self, name, ())  # (made once: later lookups are plain attributes)
        return m

    def take(self) -> list[tuple[str, tuple, str, float]]:
        """The calls since the last take (one inc per counter); gauges only where they changed (an
        idle loop sends nothing)."""
        changed = {k: v for k, v in self.gauges.items() if self.sent.get(k) != v}
        self.sent.update(changed)
        out = (self.calls + [(n, lab, "inc", v) for (n, lab), v in self.incs.items()]
               + [(n, lab, "set", v) for (n, lab), v in changed.items()])
        self.calls, self.incs, self.gauges = [], {}, {}
        return out


class _Metric:
    def __init__(self, rec: _Recorder, name: str, labels: tuple):
        self.rec, self.name, self.label_values = rec, name, labels
        self.children: dict[tuple, _Metric] = {}

    def labels(self, *values) -> "_Metric":
        m = self.children.get(values)
        if m is None:
            m = self.children[values] = _Metric(self.rec, self.name, values)
        return m

    def inc(self, value: float = 1.0) -> None:
        key = (self.name, self.label_values)
        self.rec.incs[key] = self.rec.incs.get(key, 0.0) + value

    def observe(self, value: float) -> None:
        self.rec.calls.append((self.name, self.label_values, "observe", value))

    def set(self, value: float) -> None:
        self.rec.gauges[(self.name, self.label_values)] = value


def replay(metrics, calls: list[tuple[str, tuple, str, float]]) -> None:
    """The child's metric calls, on the server's ServerMetrics."""
    for name, labels, op, value in calls:
        m = getattr(metrics, name)
        getattr(m.labels(*labels) if labels else m, op)(value)


# ---- the engine process ---------------------------------------------------------------------------
class _Deltas:
    """One turn's new tokens, flat: request i of `rids` committed tokens[sum(counts[:i]):][:counts[i]]
    (one list each, pickled in a few calls, not a tuple per request); `logprobs` only for the
    requests that asked (request id -> one TokenLogprob per new token)."""

    __slots__ = ("rids", "counts", "tokens", "logprobs")

    def __init__(self):
        self.rids: list[str] = []
        self.counts: list[int] = []
        self.tokens: list[int] = []
        self.logprobs: dict[str, list] = {}


class _ChildDriver(EngineDriver):
    """The EngineDriver, its events and metric calls sent to the server process after every turn."""

    def __init__(self, engines, recorder: _Recorder, send):
        super().__init__(engines, recorder)
        self.send = send
        self.deltas = _Deltas()
        self.ends: list[tuple[str, Event]] = []
        self.acks: list[tuple[str, str | None]] = []  # adds taken (None) or refused (the error), this turn

    def _publish_all(self, mine) -> int:
        """The step's new tokens of every request into the turn's flat lists (no Delta per
        request here: the server process builds those, off the engine's interpreter)."""
        new = 0
        d = self.deltas
        rids, counts, tokens = d.rids, d.counts, d.tokens  # (no call per request a step)
        for lv in mine:
            out = lv.request.output_ids
            sent, end = lv.sent, len(out)
            if end <= sent:
                continue
            job = lv.job
            rids.append(job.request_id)
            counts.append(end - sent)
            if end - sent == 1:
                tokens.append(out[sent])
            else:
                tokens += out[sent:]
            if job.top_logprobs is not None:
                have = lv.engine.logprobs.get(job.request_id)
                if have is not None:
                    d.logprobs[job.request_id] = have[sent:end]
            lv.sent = end
            new += end - sent
        return new

    def _send(self, lv, event) -> None:
        """A request's end (Finished or Failed); its tokens go through _publish_all's flat lists."""
        self.ends.append((lv.job.request_id, event))

    def _flush(self) -> None:
        calls = self.metrics.take()
        d = self.deltas
        if d.rids or self.ends or calls or self.acks:
            acks, ends, self.deltas, self.ends, self.acks = self.acks, self.ends, _Deltas(), [], []
            self.send(("events", acks, d.rids, d.counts, d.tokens, d.logprobs, ends, calls))

    def _main(self) -> None:
        try:
            super()._main()
        finally:
            self.send(("ended", self.error))


def _child(spec: EngineSpec, conn) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    try:
        from tandem.runtime.pair import load_pair
        from tandem.serve.config import engine_config_for
        from tandem.serve.driver import inject_faults
        from tandem.serve.logprobs import LogprobEngine

        pair = load_pair(spec.target, spec.draft, spec.device, spec.dtype,
                         need_draft=any(m != "ar" for m in spec.methods))
        engines = {m: LogprobEngine(pair.target, pair.draft if m != "ar" else None, pair.tokenizer,
                                    engine_config_for(spec.engine_config, m)) for m in spec.methods}
        if spec.inject_faults:
            for e in engines.values():
                e.fault_hook = inject_faults
    except Exception as e:  # (ConfigError's text is for the user; anything else: its type too)
        send(("failed", str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"))
        return
    driver = _ChildDriver(engines, _Recorder(), send)
    send(("ready", {m: e.context_window for m, e in engines.items()}))
    threading.Thread(target=_receive, args=(conn, driver, send), name="tandem-engine-pipe", daemon=True).start()
    profile = os.environ.get("TANDEM_ENGINE_PROFILE")  # (a file: where the engine loop's time went, for bench scripts)
    sampler = None
    if profile:
        from tandem.bench.stack_sampler import StackSampler

        sampler = StackSampler(mode="cpu").start()  # (SIGPROF on this thread: no bias toward lock releases)
    try:
        driver.run()  # the engine loop on this thread, which loaded the models (see spare_main_thread)
    finally:
        if sampler is not None:
            with open(profile, "w") as f:
                f.write(sampler.stop().report(40) + "\n")


def _receive(conn, driver: "_ChildDriver", send) -> None:
    """The engine process's pipe: the server process's commands, onto the driver's queue."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the server process is gone
            msg = ("stop",)
        if msg[0] == "add":
            _, rid, prompt_ids, params, method, top = msg
            fut: Future = Future()
            # (resolved on the engine loop's thread, by its _add: the ack goes with that turn's events)
            fut.add_done_callback(lambda f, rid=rid: driver.acks.append((rid, _error(f))))
            driver.commands.put(("add", Job(rid, prompt_ids, params, method, top), fut))  # (_send: no loop here)
        elif msg[0] == "abort":
            driver.abort(msg[1])
        elif msg[0] == "pools":
            driver.pools().add_done_callback(lambda f, n=msg[1]: send(("pools", n, f.result())))
        else:  # stop
            driver.stop()
            return


def _error(f: Future) -> str | None:
    e = f.exception()
    return None if e is None else str(e)


# ---- the server process's side -------------------------------------------------------------------
class ProcessDriver:
    """EngineDriver's interface (start, stop, alive, submit, abort) over an engine process.
    Spawns it and waits until its engines are built (ConfigError if it could not build them)."""

    def __init__(self, spec: EngineSpec, metrics, start_timeout_s: float = START_TIMEOUT_S):
        ctx = multiprocessing.get_context("spawn")  # (fork would copy a CUDA context and the server's threads)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(spec, child), name="tandem-engine", daemon=True)
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self.futures: dict[str, Future] = {}
        self.reports: dict[int, Future] = {}  # pools() asked, not answered yet
        self._asked = 0
        self.error: str | None = None
        self._lock = threading.Lock()  # the pipe's sending end and the three tables
        self._stopping = threading.Event()
        self.process.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.process.kill()
            raise ConfigError(f"the engine process did not start within {start_timeout_s:.0f} s")
        msg = self.conn.recv()
        if msg[0] != "ready":
            self.process.join(5)
            raise ConfigError(f"the engine process could not start: {msg[1]}")
        self.context_windows: dict[str, int] = msg[1]
        self.thread = threading.Thread(target=self._read, name="tandem-engine-reader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and self.error is None and not self._stopping.is_set()

    def submit(self, job: Job) -> Future:
        fut: Future = Future()
        with self._lock:
            if not self.alive:
                fut.set_exception(ConfigError("the engine is not running"))
                return fut
            self.jobs[job.request_id], self.futures[job.request_id] = job, fut
            self.conn.send(("add", job.request_id, job.prompt_ids, job.params, job.method, job.top_logprobs))
        return fut

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self.process.is_alive():
                try:
                    self.conn.send(("abort", request_id))
                except (OSError, ValueError):  # (the pipe is closed: the process is gone)
                    pass

    def pools(self) -> Future:
        """Resolves to the engine process's `pool_report` (tandem.serve.driver), taken between two steps."""
        fut: Future = Future()
        with self._lock:
            if self.error is not None or not self.process.is_alive():  # (no loop left to answer)
                fut.set_exception(ConfigError("the engine is not running"))
                return fut
            self._asked += 1
            n = self._asked
            self.reports[n] = fut
            try:
                self.conn.send(("pools", n))
            except (OSError, ValueError):
                del self.reports[n]
                fut.set_exception(ConfigError("the engine is not running"))
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        """In-flight requests get 503 server_shutting_down (from the engine process), then it exits."""
        self._stopping.set()
        with self._lock:
            try:
                self.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                if msg[0] == "events":
                    _, acks, rids, counts, tokens, lps, ends, calls = msg
                    for rid, error in acks:  # (before the events: a request's handler starts on its ack)
                        self._ack(rid, error)
                    self._events(rids, counts, tokens, lps, ends)
                    replay(self.metrics, calls)
                elif msg[0] == "pools":
                    with self._lock:
                        fut = self.reports.pop(msg[1], None)
                    if fut is not None:
                        fut.set_result(msg[2])
                else:  # ended
                    self.error = msg[1]
                    if self.error is None and not self._stopping.is_set():
                        self.error = "the engine loop stopped"
                    break
        except (EOFError, OSError):
            self.error = self.error or "the engine process exited"
        finally:
            self._fail_all()

    def _ack(self, rid: str, error: str | None) -> None:
        """The engine process took the request (error None) or refused it: its submit() resolves."""
        with self._lock:
            fut = self.futures.pop(rid, None)
            if error is not None:
                self.jobs.pop(rid, None)
        if fut is not None and fut.set_running_or_notify_cancel():
            if error is not None:
                fut.set_exception(ConfigError(error))
            else:
                fut.set_result(None)

    def _events(self, rids: list[str], counts: list[int], tokens: list[int], lps: dict, ends: list) -> None:
        """One turn's events (_Deltas' fields, then the ends), each to its request's job (a
        request that ended leaves the table; its last Delta comes first, as the engine process
        sent them)."""
        with self._lock:
            jobs = self.jobs
            pairs, i = [], 0
            for rid, n in zip(rids, counts):
                job = jobs.get(rid)
                if job is not None:
                    pairs.append((job, Delta(tokens[i:i + n], lps.get(rid))))
                i += n
            for rid, event in ends:
                job = jobs.pop(rid, None)
                if job is not None:
                    pairs.append((job, event))
        post(pairs)

    def _fail_all(self) -> None:
        """The engine process is gone: whatever is still in flight fails (and waits no more)."""
        with self._lock:
            jobs, self.jobs = self.jobs, {}
            futures, self.futures = self.futures, {}
            reports, self.reports = self.reports, {}
        self.metrics.engine_alive.set(0)
        for fut in reports.values():
            fut.set_exception(ConfigError("the engine is not running"))  # (a killed process sent no last update)
        for fut in futures.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(ConfigError("the engine is not running"))
        shutting = self._stopping.is_set() and self.error is None
        event = (Failed("the server is shutting down; retry on a running server", 503, "server_shutting_down")
                 if shutting else Failed("the engine stopped"))
        post([(job, event) for job in jobs.values()])
