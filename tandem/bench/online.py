"""`tandem bench --online`: load an OpenAI-compatible server over HTTP and measure what clients see.

    server  = --url URL, or `tandem serve`'s app started here on 127.0.0.1 (a free port, a thread)
    for method in --methods, for c in --concurrency:
        send --requests streamed completions (prompts cycled from the workload), at most c in flight,
        from a client process of its own (an in-process server's engine and HTTP handling share one
        interpreter lock, as they do under `tandem serve`; a client there would take a share too),
        at most --request-rate starts per second, none started after --max-seconds
    report per (method, c): requests/s, output tokens/s, TTFT, inter-token and end-to-end p50/p99,
    errors by kind -> results.json, results.md, online_latency.png

TTFT is from sending the request to the first SSE chunk carrying text; inter-token latency is per
token: every chunk carries the token counts so far (stream_options `continuous_usage_stats`), and
a chunk of k tokens after the first gives each of them 1/k of the gap since the previous text chunk
(SGLang's bench_serving does the same; a server without the counts: one token per chunk);
end-to-end is from sending to `[DONE]`. Output tokens come from the stream's usage. Also reported:
tokens per chunk, and the cores busy over each level in the client process (near 1: the load
generator is the limit), and with a server started here, in its process and its engine process.
The client is a few-line HTTP/1.1 parser on asyncio's protocol callbacks, not httpx (which took
most of a core at 64 streams on the CPU).
Errors (an HTTP status, a transport error, an error event inside the stream) are counted, never
raised. Exit status 0; 1 when any request failed. Only loopback URLs unless --allow-remote.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from tandem.config import ConfigError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_LEVELS = (1, 4, 8)


# ---------------------------------------------------------------------------------------------
# Records
@dataclass(frozen=True)
class Load:
    """What each level sends and its bounds."""

    url: str
    api_key: str | None
    max_tokens: int
    requests: int  # per level
    max_seconds: float  # per level: no request but the first starts after this
    request_rate: float | None  # starts per second (evenly spaced); None: as fast as concurrency allows
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it (seconds); `error` set when it failed."""

    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    itl: tuple[float, ...] = ()  # one gap per token after the first chunk's
    error: str | None = None
    chunks: int = 0  # SSE chunks that carried text


@dataclass
class Level:
    """One (method, concurrency) level's figures (milliseconds for latencies)."""

    method: str
    concurrency: int
    request_rate: float | None
    sent: int
    completed: int
    skipped: int  # not started: past --max-seconds
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    ttft_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    tokens_per_chunk: float | None = None  # > 1: the server joined steps (or released held text) into chunks
    client_cpu: float | None = None  # the load generator's cores busy over the level (near 1: it is the limit)
    cpu: dict = field(default_factory=dict)  # the same for the in-process server ("server", "engine")
    # the in-process server's engine over the level (its /metrics step histogram): steps a second and
    # the mean wall ms of a step (Engine.step, as the offline bench's step line) and the share of the
    # level's wall time inside steps (well below 1: the engine waited for requests or for the server)
    engine_steps_per_s: float | None = None
    engine_step_ms: float | None = None
    engine_busy: float | None = None


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile q (0..100) of xs; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _ms(xs: list[float], mean: bool = False) -> dict:
    def r(v):
        return None if v is None else round(1000 * v, 2)

    out = {"p50": r(pct(xs, 50)), "p99": r(pct(xs, 99))}
    if mean:
        out["mean"] = r(statistics.fmean(xs) if xs else None)
    return out


def summarize(method: str, concurrency: int, rate: float | None, samples: list[Sample | None], wall: float) -> Level:
    ok = [s for s in samples if s is not None and s.error is None]
    errors: dict[str, int] = {}
    for s in samples:
        if s is not None and s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
    wall = max(wall, 1e-9)
    return Level(method, concurrency, rate, sent=sum(s is not None for s in samples), completed=len(ok),
                 skipped=sum(s is None for s in samples), errors=errors, wall_s=round(wall, 3),
                 requests_per_s=round(len(ok) / wall, 3),
                 output_tokens_per_s=round(sum(s.tokens for s in ok) / wall, 1),
                 ttft_ms=_ms([s.ttft for s in ok]), itl_ms=_ms([x for s in ok for x in s.itl], mean=True),
                 e2e_ms=_ms([s.e2e for s in ok]),
                 tokens_per_chunk=round(sum(s.tokens for s in ok) / chunks, 2) if (chunks := sum(s.chunks for s in ok))
                 else None)


# ---------------------------------------------------------------------------------------------
# The client
class _Tally:
    """One streamed completion's figures, fed each SSE event's data as it arrives.

    The request asks for usage in every chunk (stream_options `continuous_usage_stats`, vLLM's
    extension), so a chunk whose text carries k tokens counts k: after the first text chunk each of
    its tokens gets an inter-token gap of (time since the previous text chunk) / k, as SGLang's
    bench_serving spreads them; the first chunk's time is the TTFT. A server that sends usage only
    at the end gets one token per text chunk (text alone cannot split them)."""

    def __init__(self, t0: float):
        self.t0, self.first, self.last = t0, None, None
        self.itl: list[float] = []
        self.tokens = self.counted = self.chunks = 0
        self.error: str | None = None
        self.done = False

    def event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        ev = json.loads(data)
        if "error" in ev:  # the server failed the request after the 200
            self.error = f"stream {ev['error'].get('code') or 'error'}"
            return
        use = ev.get("usage")
        n = use["completion_tokens"] if use else None
        if n is not None:
            self.tokens = n
        choices = ev.get("choices")
        if choices and choices[0].get("text"):
            k = n - self.counted if n is not None else 1
            self.counted = n if n is not None else self.counted + 1
            if self.first is None:
                self.first = now
            elif k > 0:
                self.itl.extend([(now - self.last) / k] * k)
            self.last = now
            self.chunks += 1

    def sample(self, end: float) -> Sample:
        return Sample(ttft=(self.first if self.first is not None else end) - self.t0, e2e=end - self.t0,
                      tokens=self.tokens, itl=tuple(self.itl), chunks=self.chunks)


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection reading a streamed response in the bytes' own callback.

    The load generator must not be the limit it measures: httpx (httpcore, anyio, h11, a line
    iterator) took most of a core at 64 streams on the CPU, profiled with py-spy. This parses the
    status line, the headers, chunked (or length- or close-delimited) framing and SSE events with
    a few bytes operations per chunk, and stamps each event with its arrival time."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.tally: _Tally | None = None
        self.done: asyncio.Future | None = None
        self.received = 0  # bytes of the current response
        self.reusable = False

    # ---- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.done is None or self.done.done():
            return
        self.received += len(data)
        self.buf += data
        try:
            self._parse(time.perf_counter())
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            self._end("bad SSE event")

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.done is not None and not self.done.done():
            if self.state == "body" and self.framing == "close":
                self._flush_sse(time.perf_counter(), final=True)
                self._end(None)
            else:
                self._end("RemoteProtocolError")

    # ---- one request
    def send(self, request: bytes, tally: _Tally) -> asyncio.Future:
        """Resolves to None (a complete 200 stream) or an error kind once the response ends."""
        self.tally, self.buf, self.sse, self.state = tally, bytearray(), bytearray(), "head"
        self.received, self.reusable = 0, False
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def _end(self, error: str | None) -> None:
        if not self.done.done():
            self.done.set_result(error)

    def _parse(self, now: float) -> None:
        buf = self.buf
        if self.state == "head":
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                return
            lines = bytes(buf[:i]).decode("latin-1").split("\r\n")
            del buf[:i + 4]
            self.status = int(lines[0].split(" ", 2)[1])
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip().lower()
            self.keep_alive = headers.get("connection") != "close"
            if "chunked" in headers.get("transfer-encoding", ""):
                self.framing = "chunked"
            elif "content-length" in headers:
                self.framing, self.left = "length", int(headers["content-length"])
            else:
                self.framing = "close"
            self.state = "body"
        if self.framing == "chunked":
            while True:
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                size = int(bytes(buf[:i]).split(b";")[0], 16)
                if size == 0:  # the last chunk, then optional trailers and an empty line
                    j = buf.find(b"\r\n\r\n", i) if buf[i + 2:i + 4] != b"\r\n" else i
                    if j < 0:
                        return
                    del buf[:j + 4]
                    self._flush_sse(now, final=True)
                    self.reusable = self.keep_alive and not buf
                    self._end(None)
                    return
                if len(buf) < i + 2 + size + 2:
                    return
                self.sse += buf[i + 2:i + 2 + size]
                del buf[:i + 2 + size + 2]
                self._flush_sse(now)
                if self.done.done():
                    return
        else:
            if self.framing == "length":
                take = min(self.left, len(buf))
                self.left -= take
            else:
                take = len(buf)
            self.sse += buf[:take]
            del buf[:take]
            self._flush_sse(now)
            if self.framing == "length" and self.left == 0 and not self.done.done():
                self._flush_sse(now, final=True)
                self.reusable = self.keep_alive
                self._end(None)

    def _flush_sse(self, now: float, final: bool = False) -> None:
        """Hand each complete event's data to the tally (a non-200 body: only its end matters)."""
        if self.status != 200:
            if final:
                self._end(f"HTTP {self.status}")
            return
        sse, tally = self.sse, self.tally
        if b"\r" in sse:
            sse[:] = sse.replace(b"\r\n", b"\n")
        while True:
            i = sse.find(b"\n\n")
            if i < 0:
                break
            for line in bytes(sse[:i]).split(b"\n"):
                if line.startswith(b"data:"):
                    tally.event(line[5:].lstrip(b" "), now)
                    if tally.error is not None:
                        self._end(tally.error)
                        return
            del sse[:i + 2]
        if final and not tally.done:
            self._end("RemoteProtocolError")  # the body ended before [DONE]


class Client:
    """Streamed completions over a pool of keep-alive connections to one server (http or https)."""

    def __init__(self, url: str, api_key: str | None, timeout: float):
        u = urlparse(url)
        self.host, self.tls = u.hostname or "127.0.0.1", u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.path = u.path.rstrip("/") + "/v1/completions"
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.head = (f"POST {self.path} HTTP/1.1\r\nHost: {host}:{self.port}\r\n"
                     "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     + (f"Authorization: Bearer {api_key}\r\n" if api_key else ""))
        self.timeout = timeout
        self.idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        import ssl

        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port,
                                               ssl=ssl.create_default_context() if self.tls else None)
        return conn

    async def stream(self, body: dict) -> Sample:
        """One streamed completion; never raises for a server or transport failure."""
        data = json.dumps(body).encode()
        request = (self.head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data
        t0 = time.perf_counter()
        for attempt in (0, 1):
            reused = False
            while self.idle:  # a kept-alive connection, unless the server has closed it since
                conn = self.idle.pop()
                if conn.transport is not None and not conn.transport.is_closing():
                    reused = True
                    break
            else:
                try:
                    conn = await asyncio.wait_for(self._connect(), self.timeout)
                except asyncio.TimeoutError:
                    return Sample(error="ConnectTimeout")
                except OSError:
                    return Sample(error="ConnectError")
            tally = _Tally(t0)
            try:
                error = await asyncio.wait_for(conn.send(request, tally), self.timeout)
            except asyncio.TimeoutError:
                error = "ReadTimeout"
            if error == "RemoteProtocolError" and reused and conn.received == 0 and attempt == 0:
                continue  # the server closed the idle connection as this request went out: once more
            end = time.perf_counter()
            if conn.reusable and error is None:
                self.idle.append(conn)
            elif conn.transport is not None:
                conn.transport.close()
            return Sample(error=error) if error is not None else tally.sample(end)
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle = []


def request_body(prompt: str, load: Load, method: str | None) -> dict:
    body = {"prompt": prompt, "max_tokens": load.max_tokens, "temperature": load.temperature, "top_p": load.top_p,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": load.ignore_eos}
    if load.seed is not None:
        body["seed"] = load.seed
    if method is not None:
        body["method"] = method
    return body


async def run_level(load: Load, prompts: list[str], method: str | None, concurrency: int) -> Level:
    """`load.requests` requests, at most `concurrency` in flight; a start past the deadline is skipped."""
    sem = asyncio.Semaphore(concurrency)
    client = Client(load.url, load.api_key, timeout=load.max_seconds + 60)

    async def guarded(i: int, t0: float) -> Sample | None:
        if load.request_rate is not None:  # evenly spaced arrivals
            await asyncio.sleep(max(0.0, t0 + i / load.request_rate - time.perf_counter()))
        async with sem:
            # NOTE: the first request always starts (a level that sent nothing measures nothing)
            if i > 0 and time.perf_counter() > t0 + load.max_seconds:
                return None
            return await client.stream(request_body(prompts[i % len(prompts)], load, method))

    cpu0, t0 = time.process_time(), time.perf_counter()
    try:
        samples = await asyncio.gather(*(guarded(i, t0) for i in range(load.requests)))
    finally:
        client.close()
    wall = time.perf_counter() - t0
    level = summarize(method or "default", concurrency, load.request_rate, list(samples), wall)
    level.client_cpu = round((time.process_time() - cpu0) / max(wall, 1e-9), 3)
    return level


def run_levels(prompts: list[str], plan: list[tuple[Load, str | None, int]]) -> list[Level]:
    """Each (load, method, concurrency) of the plan in turn, in this process."""
    return [asyncio.run(run_level(load, prompts, m, c)) for load, m, c in plan]


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) a live process has used so far; None off Linux."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def step_totals(metrics, method: str) -> tuple[float, float]:
    """(steps, seconds in them) of a served method's engine so far: its /metrics step histogram."""
    reg, labels = metrics.registry, {"method": method}
    return (reg.get_sample_value("tandem_step_seconds_count", labels) or 0.0,
            reg.get_sample_value("tandem_step_seconds_sum", labels) or 0.0)


def client_process(prompts: list[str], plan: list[tuple[Load, str | None, int]],
                   watch: dict[str, int] | None = None, steps=None) -> list[Level]:
    """run_levels in a spawned process (no CUDA, no model: only the HTTP client), one level at a
    time; `watch` (name -> pid, e.g. this process as the server) gets each level's CPU use
    (cores busy over the level's wall time, in Level.cpu); `steps(method)` (step_totals of the
    in-process server) each level's engine steps."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    rows = []
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        for step in plan:
            before = {name: process_cpu_s(pid) for name, pid in (watch or {}).items()}
            s0 = steps(step[1]) if steps is not None else None
            t0 = time.perf_counter()
            level = ex.submit(run_levels, prompts, [step]).result()[0]
            wall = time.perf_counter() - t0
            if s0 is not None:
                (n1, sec1), (n0, sec0) = steps(step[1]), s0
                if n1 > n0:
                    level.engine_steps_per_s = round((n1 - n0) / wall, 1)
                    level.engine_step_ms = round(1e3 * (sec1 - sec0) / (n1 - n0), 3)
                    level.engine_busy = round((sec1 - sec0) / wall, 3)
            for name, pid in (watch or {}).items():
                after = process_cpu_s(pid)
                if after is not None and before[name] is not None:
                    level.cpu[name] = round((after - before[name]) / wall, 3)
            rows.append(level)
    return rows


# ---------------------------------------------------------------------------------------------
# A server in this process
class LocalServer:
    """`tandem serve`'s app under uvicorn in a thread, bound to 127.0.0.1 on a port the OS picks.
    `stop()` is `tandem serve`'s SIGTERM path (tandem.serve.runner): in-flight requests finish
    within the server's shutdown grace, then the engine thread stops."""

    def __init__(self, server, start_timeout_s: float = 60.0):
        from tandem.serve.app import create_app
        from tandem.serve.runner import make_server

        self.state = server
        self.uvicorn = make_server(create_app(server), server, "127.0.0.1", 0, log_level="warning")
        self.thread = threading.Thread(target=self.uvicorn.run, name="tandem-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        self.port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 60.0) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def build_local_server(args: argparse.Namespace, methods: list[str], max_concurrency: int):
    """The Server (tandem.serve.app) for --target/--draft (default: the bundled pair) serving `methods`."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"`tandem bench --online` needs {e.name}; install with pip install 'tandem[serve]'") from None
    from tandem.bench.harness import parse_nodes
    from tandem.config import SpecConfig
    from tandem.engine.config import ENGINE_METHODS, EngineConfig
    from tandem.runtime.pair import load_pair
    from tandem.serve.app import Server
    from tandem.serve.chat_template import ChatTemplate
    from tandem.serve.config import ServerConfig, engine_config_for
    from tandem.serve.driver import spare_main_thread

    for m in methods:
        if m not in ENGINE_METHODS:
            raise ConfigError(f"--online serves {', '.join(ENGINE_METHODS)}; {m!r} is not one of them")
    spec = SpecConfig(k=args.k, nodes=parse_nodes(args.nodes)[0], width=args.width, depth=args.depth)
    ecfg = EngineConfig(spec=spec, max_num_seqs=max(EngineConfig().max_num_seqs, max_concurrency),
                        long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", 0))
    for m in methods:
        engine_config_for(ecfg, m).validate()
    rate = getattr(args, "max_chunk_rate", None)
    cfg = ServerConfig(methods=tuple(methods), max_pending=max(ServerConfig().max_pending, max_concurrency),
                       max_chunk_rate=ServerConfig().max_chunk_rate if rate is None else rate)
    if getattr(args, "engine_process", False):
        from tandem.serve.cli import process_server

        return process_server(args, cfg, ecfg)
    threads = spare_main_thread(args.device)  # (as tandem serve)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=any(m != "ar" for m in methods))
    return Server(pair.target, pair.draft, pair.tokenizer, cfg, ecfg, ChatTemplate.for_checkpoint(pair.target_dir),
                  engine_threads=threads)


# ---------------------------------------------------------------------------------------------
# Flags, checks, outputs
def add_arguments(p: argparse.ArgumentParser) -> None:
    """--online and its flags (the rest: harness.add_arguments). --concurrency may exist already."""
    p.add_argument("--online", action="store_true",
                   help="load a server over HTTP (--url, or `tandem serve`'s app started here on 127.0.0.1)")
    p.add_argument("--url", default=None, help="with --online: a running OpenAI-compatible server")
    p.add_argument("--api-key", default=None, help="with --online --url: sent as 'Authorization: Bearer KEY'")
    p.add_argument("--allow-remote", action="store_true", help="with --online: allow a --url that is not loopback")
    if "--concurrency" not in p._option_string_actions:
        p.add_argument("--concurrency", default=None,
                       help="comma list of requests in flight (default 1,4,8 with --online)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="with --online: request starts per second (evenly spaced); default: as concurrency allows")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level: with --online (default 16); offline with --concurrency C, at most C "
                        "in flight, the next admitted as one finishes (default C: one wave)")
    p.add_argument("--engine-process", action="store_true",
                   help="with --online and no --url: the server's engines in a process of their own "
                        "(tandem serve --engine-process)")
    p.add_argument("--max-chunk-rate", type=float, default=None,
                   help="with --online and no --url: the server's --max-chunk-rate (default: tandem serve's)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="with --online and no --url: the server's prefill chunk per step at most this many tokens "
                        "(tandem serve's flag; 0: off)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="with --online: per level; requests not started by then are skipped")


def parse_levels(value) -> list[int]:
    """--concurrency as a comma string, an int or a list of ints (whoever registered the flag)."""
    if value is None:
        return list(DEFAULT_LEVELS)
    if isinstance(value, int):
        levels = [value]
    elif isinstance(value, str):
        try:
            levels = [int(c) for c in value.split(",") if c.strip()]
        except ValueError:
            raise ConfigError(f"--concurrency takes integers, e.g. 1,8,32 (got {value!r})") from None
    else:
        levels = [int(c) for c in value]
    if not levels or any(c < 1 for c in levels):
        raise ConfigError(f"--concurrency levels must be >= 1 (got {value!r})")
    return levels


def check(args: argparse.Namespace) -> tuple[list[int], list[str] | None]:
    """Bad flags -> ConfigError before any load; returns (levels, methods: None for `default`, no method field)."""
    from tandem.bench.env import ensure_out_dir

    levels = parse_levels(args.concurrency)
    if args.requests is None:
        args.requests = 16
    if args.requests < 1:
        raise ConfigError(f"--requests must be >= 1 (got {args.requests})")
    if not args.max_seconds > 0:
        raise ConfigError(f"--max-seconds must be > 0 (got {args.max_seconds})")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ConfigError(f"--request-rate must be > 0 (got {args.request_rate})")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ConfigError("--methods is empty")
    if args.url is not None:
        host = urlparse(args.url).hostname
        if host is None:
            raise ConfigError(f"--url {args.url!r} is not a URL (e.g. http://127.0.0.1:8000)")
        if host not in LOOPBACK_HOSTS and not args.allow_remote:
            raise ConfigError(f"--url {args.url} is not loopback; pass --allow-remote to load another host")
    elif args.api_key is not None:
        raise ConfigError("--api-key goes with --url (the server started here has no key)")
    ensure_out_dir(args.out)
    # `default`: requests without a method field, the server's default method
    return levels, [None if m == "default" else m for m in dict.fromkeys(methods)]


def prompt_texts(args: argparse.Namespace, tokenizer) -> list[str]:
    """The workload's prompt texts; with a tokenizer and --max-prompt-tokens, cut from the left."""
    from tandem.bench.workloads import load_workload

    texts = [p.text for p in load_workload(args.workload, args.num_prompts, args.data_dir, args.source_lines)]
    if tokenizer is not None and args.max_prompt_tokens is not None:
        if args.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens must be >= 1 (got {args.max_prompt_tokens})")
        texts = [tokenizer.decode(tokenizer.encode(t).ids[-args.max_prompt_tokens:]) for t in texts]
    return texts


def markdown(results: dict) -> str:
    c = results["config"]
    lines = [f"# tandem bench --online ({c['server']})", "",
             f"{c['requests']} requests per level, max_tokens {c['max_tokens']}, "
             f"request rate {c['request_rate'] or 'unbounded'}, {c['max_seconds']} s per level at most.", "",
             "| method | conc | ok | errors | skipped | req/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms "
             "| e2e p50/p99 ms | tok/chunk | CPU client / server / engine | engine steps/s, ms a step, busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["levels"]:
        errs = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['completed']} | {errs} | {r['skipped']} | "
                     f"{r['requests_per_s']} | {r['output_tokens_per_s']} | "
                     f"{r['ttft_ms']['p50']}/{r['ttft_ms']['p99']} | {r['itl_ms']['p50']}/{r['itl_ms']['p99']} | "
                     f"{r['e2e_ms']['p50']}/{r['e2e_ms']['p99']} | {r.get('tokens_per_chunk')} | "
                     f"{r.get('client_cpu')} / {r.get('cpu', {}).get('server', '-')} / "
                     f"{r.get('cpu', {}).get('engine', '-')} | "
                     + (f"{r['engine_steps_per_s']}, {r['engine_step_ms']}, {r['engine_busy']} |"
                        if r.get("engine_step_ms") is not None else "- |"))
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: Path, plots: bool = True) -> list[Path]:
    from tandem.bench.env import write_json

    written = [out / "results.json", out / "results.md"]
    from tandem.bench import plots as P

    if plots and P.available():
        written.append(P.online_levels(results["levels"], out / "online_latency.png"))
    results["files"] = [p.name for p in written]
    write_json(out / "results.json", results)
    (out / "results.md").write_text(markdown(results))
    return written


def run(args: argparse.Namespace) -> int:
    """`tandem bench --online`."""
    from tandem.bench.env import environment

    from tandem.serve.config import default_methods

    levels, methods = check(args)
    local = None
    if args.url is None:
        # the methods named, served as `tandem serve --methods` would (its first the default); `default`
        # alone serves what `tandem serve` does without --methods
        served = [m for m in methods if m is not None] or list(default_methods(args.target, args.draft, args.device))
        server = build_local_server(args, served, max(levels))
        prompts = prompt_texts(args, server.tokenizer)
        local = LocalServer(server)
        url = local.url
    else:
        prompts = prompt_texts(args, None)
        url = args.url
    load = Load(url, args.api_key, args.max_new_tokens, args.requests, args.max_seconds, args.request_rate,
                temperature=args.temperature, top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    # warm-up: one short request per method, not measured (first-call costs on both sides)
    warm = Load(**{**asdict(load), "requests": 1, "max_tokens": 2})
    plan = [(warm, m, 1) for m in methods] + [(load, m, c) for m in methods for c in levels]
    try:
        # an in-process server shares this interpreter's lock with its engine thread: a client in
        # the same process would take a share of it too (profiled on the CPU: the load generator
        # held it more than the server did), so the load comes from a process of its own
        if local is not None:
            import os

            watch = {"server": os.getpid()}
            engine = getattr(local.state.driver, "process", None)  # (--engine-process)
            if engine is not None:
                watch["engine"] = engine.pid
            served = local.state.config.methods
            rows = client_process(prompts, plan, watch,
                                  steps=lambda m: step_totals(local.state.metrics, m or served[0]))
        else:
            rows = run_levels(prompts, plan)
        rows = rows[len(methods):]
    finally:
        if local is not None:
            local.stop()
    from tandem.runtime.pair import resolve_device

    results = {"env": environment(resolve_device(args.device) if local is not None else "cpu"),
               "config": {"server": ("in-process tandem serve" + (", engine process" if args.engine_process else "")
                                     if local is not None else args.url),
                          "client": "a process of its own" if local is not None else "this process",
                          "methods": [m or "default" for m in methods], "concurrency": levels, "requests": args.requests,
                          "max_tokens": args.max_new_tokens, "max_seconds": args.max_seconds,
                          "request_rate": args.request_rate, "workload": args.workload, "num_prompts": len(prompts)},
               "levels": [asdict(r) for r in rows]}
    out = Path(args.out)
    write_outputs(results, out, plots=not args.no_plots)
    print(markdown(results), end="")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}")
    return 0 if all(not r.errors for r in rows) else 1
