"""The reliability harness of `tandem serve` (issue 13, item 5): one function per check, each driving
a real server over loopback and returning a CheckResult (the figure it reached, whether that meets
the bar, and what went wrong). `bench/serve_reliability.py` runs the full set and writes a report;
tests/test_serve_reliability.py runs a scaled-down set in CI.

A check gets a Target: the server's URL, its in-process state (for the engines' pools and the
driver), and the API key. The server must have an API key and run on 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tandem.serve.app import Server

ERROR_KEYS = {"message", "type", "param", "code"}
MAX_ERROR_BYTES = 4096
LEAK_PATTERNS = re.compile(r"Traceback|File \"|\.py\b|/tandem/|/site-packages/|/home/|/usr/")
PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(", "# sort a list\n", "def main():",
           "x = [", "while True:"]


@dataclass(frozen=True)
class CheckResult:
    name: str
    figure: str  # what was reached, e.g. "0 of 140 responses >= 500"
    passed: bool
    details: tuple[str, ...] = ()  # the first failures, one line each

    def as_dict(self) -> dict:
        return {"name": self.name, "figure": self.figure, "passed": self.passed, "details": list(self.details)}


@dataclass
class Target:
    url: str
    server: "Server"  # in-process: its engines' pools, pending count, config
    api_key: str
    app: "FastAPI | None" = None  # for the list of routes

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.auth, timeout=timeout)


class LoopbackServer:
    """uvicorn in a thread on 127.0.0.1, a port the OS picks; `stop()` drains as SIGTERM does."""

    def __init__(self, server, api_key: str):
        from tandem.serve.app import create_app
        from tandem.serve.runner import make_server

        app = create_app(server)
        self.uvicorn = make_server(app, server, "127.0.0.1", 0, log_level="warning")
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        host, port = self.uvicorn.servers[0].sockets[0].getsockname()[:2]
        if host != "127.0.0.1":
            raise RuntimeError(f"the server bound {host}, not loopback")
        self.target = Target(f"http://127.0.0.1:{port}", server, api_key, app)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)


# ---- helpers -----------------------------------------------------------------------------------
def error_problems(r: httpx.Response) -> list[str]:
    """What is wrong with an error response's body: OpenAI's shape, <= 4 KB, no traceback or path."""
    out = []
    if len(r.content) > MAX_ERROR_BYTES:
        out.append(f"{len(r.content)} bytes")
    if LEAK_PATTERNS.search(r.text):
        out.append("leaks a traceback or a path")
    try:
        err = r.json()["error"]
        if set(err) != ERROR_KEYS or not isinstance(err["message"], str) or not err["message"]:
            out.append(f"keys {sorted(err)}")
    except (ValueError, KeyError, TypeError):
        out.append("not an OpenAI error body")
    return out


def pools(server) -> dict[str, dict]:
    """Each engine's pool (tandem.serve.driver.pool_report), taken by the engine loop between two steps
    (its thread in this process, or the engine process with --engine-process). Not read from this
    thread: an abort on the engine thread drops the request from the engine before its blocks go back
    to the pool, and a report read between the two saw no request but a held sequence (a CI run
    failed the status map's pool check so, once)."""
    return server.driver.pools().result(30)


def idle(server, timeout: float = 5.0) -> bool:
    """Wait until no request is in any engine and none is pending; False on timeout."""
    deadline = time.monotonic() + timeout
    while server.pending or any(p["requests"] for p in pools(server).values()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def pool_violations(server) -> list[str]:
    """The KV invariant of every engine's pool, checked while idle: check() clean, every block free."""
    out = []
    for method, p in pools(server).items():
        out += [f"{method}: {v}" for v in p["problems"]]
        if p["free"] != p["blocks"]:
            out.append(f"{method}: {p['blocks'] - p['free']} blocks still held")
        if p["sequences"]:
            out.append(f"{method}: {p['sequences']} sequences still in the pool")
    return out


def outcome_counts(t: Target) -> dict[str, float]:
    """The server's own ledger, read from /metrics (tandem_requests_total by outcome)."""
    text = httpx.get(t.url + "/metrics", timeout=30).text
    counts = {k: 0.0 for k in ("completed", "rejected", "aborted", "failed")}
    for m in re.finditer(r'^tandem_requests_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        counts[m.group(1)] = float(m.group(2))
    return counts


def post_at_once(t: Target, bodies: list[dict], width: int | None = None, timeout: float = 600) -> list[httpx.Response]:
    """POST every body to /v1/completions concurrently, at most `width` in flight (None: all at
    once); the responses in the bodies' order."""
    width = width or len(bodies)

    async def run() -> list[httpx.Response]:
        gate = asyncio.Semaphore(width)
        async with httpx.AsyncClient(base_url=t.url, headers=t.auth, timeout=timeout,
                                     limits=httpx.Limits(max_connections=width)) as ac:
            async def one(b: dict) -> httpx.Response:
                async with gate:
                    return await ac.post("/v1/completions", json=b)

            return await asyncio.gather(*(one(b) for b in bodies))

    return asyncio.run(run())


def completion_text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["text"] if r.status_code == 200 else f"<status {r.status_code}>"


def sse_data(lines) -> list[str]:
    return [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]


def long_body(i: int, max_tokens: int, stream: bool = True) -> dict:
    return {"model": "tandem", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


class HeldStreams:
    """n admitted streaming requests, each past its first chunk, held open (each its own connection)."""

    def __init__(self, t: Target, n: int, max_tokens: int, method: str | None = None):
        self.stack = ExitStack()
        self.client = self.stack.enter_context(t.client())
        self.streams = []
        for i in range(n):
            body = long_body(i, max_tokens)
            if method:
                body["method"] = method
            r = self.stack.enter_context(self.client.stream("POST", "/v1/completions", json=body))
            lines = r.iter_lines()  # keep the iterator: dropping it closes the stream
            first = next(lines)
            self.streams.append((r, lines, [first]))

    def finish(self) -> list[list[str]]:
        """Read every stream to its end: each one's data lines."""
        out = [sse_data(seen + list(lines)) for _, lines, seen in self.streams]
        self.close()
        return out

    def close(self) -> None:
        self.stack.close()


# ---- (1) bad inputs ----------------------------------------------------------------------------------
def hand_written_bad_inputs(context_window: int) -> list[tuple[str, str, object]]:
    """(HTTP method, route, body: bytes or JSON) cases that must each be refused cleanly."""
    msg = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, str, object]] = []
    for route in ("/v1/completions", "/v1/chat/completions"):
        for raw in (b"", b"{", b"{not json", b"[1, 2]", b"null", b"42", b'"x"', b"\xff\xfe\x00", b"{}" * 3,
                    b'{"prompt": "x"', b"\x00" * 64, "{\"prompt\": \"\u00e9\"}".encode("latin-1")):
            cases.append(("POST", route, raw))
        for name, values in (("max_tokens", ["ten", -1, 0, 10 ** 12, 1.5, None, [], {}]),
                             ("temperature", [-1, 3, "hot", [], 1e308]), ("top_p", [0, 2, -0.5, "x"]),
                             ("n", [0, 2, 100, "1"]), ("stop", [5, [""], ["a"] * 9, [1], ["x" * 999]]),
                             ("model", ["nope", "", 5, "../../etc/passwd", "x" * 5000]),
                             ("method", ["async", 3, "tree;rm"]), ("seed", ["x", 1.5, []]),
                             ("stream", ["yes", 1]), ("stream_options", [1, {"include_usage": "y"}]),
                             ("presence_penalty", [1, "x"]), ("frequency_penalty", [-2]),
                             ("logit_bias", [{"1": 5}, "x"]), ("ignore_eos", ["x"]), ("user", [5])):
            for v in values:
                base = {"prompt": "x"} if route == "/v1/completions" else {"messages": msg}
                cases.append(("POST", route, {**base, name: v}))
    long_prompt = "def " * (context_window + 8)
    cases += [("POST", "/v1/completions", body) for body in (
        {}, {"prompt": None}, {"prompt": 5}, {"prompt": ""}, {"prompt": []}, {"prompt": ["a", "b"]}, {"prompt": [1]},
        {"prompt": long_prompt}, {"prompt": "x", "echo": True}, {"prompt": "x", "best_of": 3},
        {"prompt": "x", "suffix": "y"}, {"prompt": "x", "logprobs": 6}, {"prompt": "x", "logprobs": -1})]
    cases += [("POST", "/v1/chat/completions", body) for body in (
        {}, {"messages": []}, {"messages": "hi"}, {"messages": [{}]},
        {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
        {"messages": [{"role": "user", "content": long_prompt}]}, {"messages": msg, "top_logprobs": 2},
        {"messages": msg, "logprobs": True, "top_logprobs": 99}, {"messages": msg, "max_completion_tokens": 0})]
    for route, method in (("/v1/completions", "GET"), ("/v1/chat/completions", "PUT"), ("/v1/models", "POST"),
                          ("/v1/nothing", "GET"), ("/v1/engines", "POST"), ("/../etc/passwd", "GET"),
                          ("/health", "DELETE")):
        cases.append((method, route, None))
    return cases


def _bodies(max_examples: int, seed: int) -> list[tuple[str, dict]]:
    """Hypothesis-generated request bodies: the schemas' field names (and others) with any JSON values."""
    from hypothesis import HealthCheck, given, seed as hseed, settings, strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-10 ** 6, 10 ** 6)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),  # JSON has no NaN / inf
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=6)
    fields = st.sampled_from(["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature",
                              "top_p", "n", "stop", "stream", "stream_options", "seed", "logprobs", "top_logprobs",
                              "logit_bias", "method", "echo", "best_of", "suffix", "ignore_eos", "user"])
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"]) | st.text(
        max_size=5), "content": st.text(max_size=20) | json_values})
    body = st.dictionaries(fields | st.text(max_size=8), json_values, max_size=6)
    chat = st.builds(lambda b, m: {**b, "messages": m}, body, st.lists(message, max_size=3) | json_values)
    completion = st.builds(lambda b, p: {**b, "prompt": p}, body, st.text(max_size=30) | json_values)
    case = st.tuples(st.just("/v1/completions"), completion) | st.tuples(st.just("/v1/chat/completions"), chat)
    out: list[tuple[str, dict]] = []

    @hseed(seed)
    @settings(max_examples=max_examples, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(case)
    def collect(c):
        out.append(c)

    collect()
    return out


def _bounded(body: dict) -> dict:
    """A generated body that happens to be valid still runs: keep its generation short."""
    body = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is None and name in body or isinstance(v, int) and not isinstance(v, bool) and 4 < v <= 4096:
            body[name] = 4
    if "max_tokens" not in body:
        body["max_tokens"] = 4
    return body


def check_bad_inputs(t: Target, generated: int = 1000, seed: int = 0) -> CheckResult:
    """(1) Hand-written bad requests plus hypothesis-generated bodies: no response >= 500, every
    error body OpenAI-shaped, <= 4 KB, with no traceback or file path."""
    cases: list[tuple[str, str, object]] = hand_written_bad_inputs(t.server.context_window)
    n_hand = len(cases)
    cases = [(m, route, _bounded(b) if isinstance(b, dict) else b) for m, route, b in cases]
    cases += [("POST", route, _bounded(b)) for route, b in _bodies(generated, seed)]
    problems, n5xx, n_err = [], 0, 0
    with t.client() as c:
        for method, route, body in cases:
            kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else (
                {"json": body} if body is not None else {})
            r = c.request(method, route, **kw)
            if r.status_code >= 500:
                n5xx += 1
            if r.status_code >= 400:
                n_err += 1
                bad = error_problems(r)
                if bad or r.status_code >= 500:
                    problems.append(f"{method} {route} {json.dumps(body, default=repr)[:120]} -> "
                                    f"{r.status_code} {'; '.join(bad)}")
    passed = n5xx == 0 and not problems
    return CheckResult("bad_inputs", f"{n5xx} of {len(cases)} responses >= 500 ({n_hand} hand-written, "
                                     f"{len(cases) - n_hand} generated); {len(problems)} bad error bodies of {n_err}",
                       passed, tuple(problems[:10]))


# ---- (2) the status-code map ---------------------------------------------------------------------------
def check_status_map(t: Target) -> CheckResult:
    """(2) Each condition's exact status, error type and param (and Retry-After on 503)."""
    s = t.server
    big = s.config.max_body_bytes
    ctx = s.context_window
    msg = [{"role": "user", "content": "hi"}]
    conditions = [
        # (name, method, route, headers, body, status, type, param)
        ("no API key", "POST", "/v1/completions", {"Authorization": ""}, {"prompt": "x"}, 401,
         "authentication_error", None),
        ("wrong API key", "POST", "/v1/chat/completions", {"Authorization": "Bearer wrong"}, {"messages": msg}, 401,
         "authentication_error", None),
        ("unknown model", "POST", "/v1/completions", {}, {"prompt": "x", "model": "gpt-9"}, 404, "invalid_request_error",
         "model"),
        ("body too large", "POST", "/v1/completions", {}, b"{" + b" " * big + b"}", 413, "invalid_request_error",
         None),
        ("malformed JSON", "POST", "/v1/completions", {}, b"{not json", 400, "invalid_request_error", None),
        ("not an object", "POST", "/v1/chat/completions", {}, b"[1]", 400, "invalid_request_error", None),
        ("missing prompt", "POST", "/v1/completions", {}, {"max_tokens": 4}, 400, "invalid_request_error", "prompt"),
        ("missing messages", "POST", "/v1/chat/completions", {}, {}, 400, "invalid_request_error", "messages"),
        ("wrong-typed field", "POST", "/v1/completions", {}, {"prompt": "x", "max_tokens": "ten"}, 400,
         "invalid_request_error", "max_tokens"),
        ("n over max_n", "POST", "/v1/chat/completions", {}, {"messages": msg, "n": s.config.max_n + 1}, 400,
         "invalid_request_error", "n"),
        ("huge max_tokens", "POST", "/v1/completions", {}, {"prompt": "x", "max_tokens": 10 ** 9}, 400,
         "invalid_request_error", "max_tokens"),
        ("prompt over the context window", "POST", "/v1/completions", {}, {"prompt": "def " * (ctx + 8)}, 400,
         "invalid_request_error", "prompt"),
        ("temperature out of range", "POST", "/v1/completions", {}, {"prompt": "x", "temperature": 9}, 400,
         "invalid_request_error", "temperature"),
        ("wrong method", "GET", "/v1/completions", {}, None, 405, "invalid_request_error", None),
        ("unknown route", "GET", "/v1/nothing", {}, None, 404, "invalid_request_error", None),
    ]
    problems = []

    def judge(name, r, status, etype, param, retry_after=False):
        try:
            err = r.json()["error"]
            got = (r.status_code, err.get("type"), err.get("param"))
        except (ValueError, KeyError, TypeError):
            got = (r.status_code, None, None)
        if got != (status, etype, param) or error_problems(r):
            problems.append(f"{name}: want {(status, etype, param)}, got {got} {'; '.join(error_problems(r))}")
        if retry_after and r.headers.get("retry-after") != str(s.config.retry_after_s):
            problems.append(f"{name}: Retry-After {r.headers.get('retry-after')!r}")

    with t.client() as c:
        for name, method, route, headers, body, status, etype, param in conditions:
            kw = {"content": body, "headers": {**headers, "Content-Type": "application/json"}} if isinstance(
                body, bytes) else {"json": body, "headers": headers} if body is not None else {"headers": headers}
            judge(name, c.request(method, route, **kw), status, etype, param)
        held = HeldStreams(t, s.config.max_pending, max_tokens=min(400, ctx // 2))
        try:
            judge("server full", c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503,
                  "server_overloaded", None, retry_after=True)
        finally:
            held.close()
    n = len(conditions) + 1
    return CheckResult("status_map", f"{n - len(problems)} of {n} conditions exact", not problems, tuple(problems))


# ---- (4) a burst of 4x capacity -----------------------------------------------------------------------
def check_burst(t: Target, factor: int = 4, max_tokens: int = 256) -> CheckResult:
    """(4) capacity requests admitted and held, then (factor - 1) x capacity more at once: every one
    of the excess gets 503 + Retry-After, and every admitted request completes with max_tokens tokens."""
    cap = t.server.config.max_pending
    held = HeldStreams(t, cap, max_tokens)
    problems = []
    try:
        excess = post_at_once(t, [long_body(i, max_tokens, False) for i in range((factor - 1) * cap)], timeout=120)
    except BaseException:
        held.close()
        raise
    rejected = [r for r in excess if r.status_code == 503 and r.headers.get("retry-after")
                and not error_problems(r)]
    if len(rejected) != len(excess):
        problems.append(f"{len(excess) - len(rejected)} of the excess were not a clean 503 + Retry-After: "
                        f"{sorted({r.status_code for r in excess})}")
    completed = 0
    for i, events in enumerate(held.finish()):
        chunks = [json.loads(e) for e in events[:-1]] if events and events[-1] == "[DONE]" else None
        if not chunks:
            problems.append(f"admitted request {i}: no [DONE]")
            continue
        finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
        if finish[-1] == "length" and finish.count("length") == 1:
            completed += 1
        else:
            problems.append(f"admitted request {i}: finish reasons {finish[-3:]}")
    return CheckResult("burst", f"{len(rejected)} of {len(excess)} excess got 503 + Retry-After; "
                                f"{completed} of {cap} admitted completed", not problems, tuple(problems))


# ---- (5) random disconnects ---------------------------------------------------------------------------
def _raw_request(t: Target, body: dict) -> socket.socket:
    """A non-streamed request sent on a bare socket (so it can be dropped before any response byte)."""
    data = json.dumps(body).encode()
    host, port = t.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {t.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    sock.sendall(head + data)
    return sock


DISCONNECTS = ("before the first byte", "mid-stream")


def check_disconnects(t: Target, n: int = 200, seed: int = 0, max_tokens: int = 200,
                      kinds: tuple[str, ...] = DISCONNECTS) -> CheckResult:
    """(5) n clients that go away: before the first response byte (a non-streamed request dropped
    once admitted), or mid-stream after 1..8 chunks. Each must be aborted (the server idle, its
    blocks free) within 1 s, the next request must succeed, and the pools stay clean."""
    import random

    rng = random.Random(seed)
    s = t.server
    problems, worst = [], 0.0
    aborted0 = outcome_counts(t)["aborted"]
    with t.client() as c:
        for i in range(n):
            body = {**long_body(i, max_tokens), "method": rng.choice(s.config.methods)}
            kind = rng.choice(kinds)
            if kind == "before the first byte":
                sock = _raw_request(t, {**body, "stream": False})
                deadline = time.monotonic() + 10
                while not s.pending and time.monotonic() < deadline:
                    time.sleep(0.002)
                sock.close()
            else:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    want, seen = rng.randint(1, 8), 0
                    for ln in lines:
                        seen += ln.startswith("data: ")
                        if seen >= want:
                            break
            t0 = time.monotonic()
            ok = idle(s, timeout=5.0)
            took = time.monotonic() - t0
            worst = max(worst, took)
            if not ok or took > 1.0:
                problems.append(f"#{i} {kind}: not aborted within 1 s ({took:.2f} s)")
            if i % 10 == 9 or i == n - 1:
                nxt = c.post("/v1/completions", json={"prompt": PROMPTS[i % 8], "max_tokens": 2, "temperature": 0})
                if nxt.status_code != 200:
                    problems.append(f"#{i}: the next request got {nxt.status_code}")
                idle(s)
                problems += [f"#{i}: {v}" for v in pool_violations(s)]
    aborted = outcome_counts(t)["aborted"] - aborted0
    if aborted != n:
        problems.append(f"the server counted {aborted:g} aborts for {n} disconnects")
    return CheckResult("disconnects", f"{n - len(problems)} of {n} clean; slowest abort {worst * 1000:.0f} ms",
                       not problems, tuple(problems[:10]))


# ---- (3) a soak ----------------------------------------------------------------------------------------
def _rss_bytes(server=None) -> int:
    """The server's resident memory: this process's (the server runs in it), plus its engine
    process's when it has one (--engine-process); /proc on Linux, else this process's peak."""
    import os

    pids = ["self"]
    proc = getattr(getattr(server, "driver", None), "process", None)
    if proc is not None and proc.pid is not None:
        pids.append(str(proc.pid))
    try:
        total = 0
        for pid in pids:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return total
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _error_code(body: bytes) -> str | None:
    """An OpenAI-shaped error body's code (None if it is not one)."""
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def check_soak(t: Target, seconds: float = 600.0, concurrency: int = 8, max_tokens: int = 48,
               method: str = "tree", warmup_s: float = 5.0) -> CheckResult:
    """(3) `concurrency` clients send streamed requests back to back for `seconds`, speculation on:
    0 unplanned errors (every request 200, one finish_reason, `[DONE]` last), and resident memory
    after the run within 5% of what it was once warm."""
    errors: list[str] = []
    done = [0]
    lock = threading.Lock()
    stop_at = [time.monotonic() + warmup_s]

    def client(k: int) -> None:
        i = k
        with t.client() as c:
            while time.monotonic() < stop_at[0]:
                body = {**long_body(i, max_tokens), "method": method}
                i += concurrency
                try:
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        events = sse_data(r.iter_lines()) if r.status_code == 200 else []
                        status = r.status_code
                        if status != 200:  # (the error's code, for the report)
                            status = f"{status} {_error_code(r.read())}"
                except httpx.HTTPError as e:
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                choices = [ch["choices"][0] for ch in map(json.loads, events[:-1]) if ch["choices"]]
                finishes = [c["finish_reason"] for c in choices if c["finish_reason"]]
                with lock:
                    if status != 200 or not events or events[-1] != "[DONE]" or len(finishes) != 1:
                        errors.append(f"request {i - concurrency}: status {status}, finishes {finishes}")
                    done[0] += 1

    def run(duration: float) -> None:
        stop_at[0] = time.monotonic() + duration
        threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    run(warmup_s)  # caches, graphs and allocator pools warm before the baseline
    idle(t.server)
    before, warm_done = _rss_bytes(t.server), done[0]
    run(seconds)
    idle(t.server)
    after = _rss_bytes(t.server)
    growth = (after - before) / before
    n = done[0] - warm_done
    problems = errors[:10] + ([f"memory grew {100 * growth:.1f}% ({before >> 20} -> {after >> 20} MiB)"]
                              if growth > 0.05 else [])
    return CheckResult("soak", f"{n} requests in {seconds:.0f} s at concurrency {concurrency} ({method}): "
                       f"{len(errors)} errors, memory {100 * growth:+.1f}%", not problems, tuple(problems))


# ---- (7) preemptions --------------------------------------------------------------------------------------
def check_preemptions(t: Target, n: int = 16, max_tokens: int = 48, method: str = "tree",
                      min_preemptions: int = 50) -> CheckResult:
    """(7) On a server whose KV pool holds a few requests, n concurrent greedy requests with
    speculation force preemptions (recompute); each output equals the same request sent alone."""
    bodies = [{**long_body(i, max_tokens, stream=False), "prompt": f"# {i}\n" + PROMPTS[i % len(PROMPTS)],
               "method": method} for i in range(n)]
    with t.client() as c:
        solo = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    before = pools(t.server)[method]["preemptions"]
    outs = [completion_text(r) for r in post_at_once(t, bodies)]
    idle(t.server)
    forced = pools(t.server)[method]["preemptions"] - before
    differ = [i for i in range(n) if outs[i] != solo[i]]
    problems = [f"request {i}: {outs[i][:40]!r} != solo {solo[i][:40]!r}" for i in differ[:5]]
    if forced < min_preemptions:
        problems.append(f"only {forced} preemptions (the bar is {min_preemptions}): shrink the pool")
    problems += pool_violations(t.server)  # (6) on this server too: every block back, check() clean
    return CheckResult("preemptions", f"{forced} preemptions over {n} concurrent requests; "
                       f"{n - len(differ)} of {n} outputs equal their solo runs", not problems, tuple(problems))


# ---- (8) determinism -----------------------------------------------------------------------------------------
def check_deterministic(t: Target, batches: tuple[int, ...] = (1, 2, 4, 8, 16), max_tokens: int = 48,
                        prompt: str = PROMPTS[0]) -> CheckResult:
    """(8) On a server started with --deterministic (and tree + ar): one greedy prompt sent b times
    at once for each batch size b, with speculation (tree) and without (ar): one unique output."""
    methods = [m for m in ("tree", "ar") if m in t.server.config.methods]
    if not t.server.engine_config.deterministic:
        raise ValueError("check_deterministic needs a server started with --deterministic")
    body = {**long_body(0, max_tokens, stream=False), "prompt": prompt}

    outs: dict[str, int] = {}
    for method in methods:
        for b in batches:
            for text in map(completion_text, post_at_once(t, [{**body, "method": method}] * b)):
                outs[text] = outs.get(text, 0) + 1
    idle(t.server)
    n = sum(outs.values())
    problems = [f"{c} of {n} outputs were {text[:40]!r}" for text, c in sorted(outs.items(), key=lambda kv: -kv[1])]
    return CheckResult("deterministic", f"{len(outs)} unique output(s) over {n} requests (batches "
                       f"{', '.join(map(str, batches))}; {' and '.join(methods)})", len(outs) == 1,
                       tuple(problems[:5]) if len(outs) > 1 else ())


# ---- (10) faults --------------------------------------------------------------------------------------------
def check_faults(t: Target, n: int = 40, every: int = 20, max_tokens: int = 24, method: str = "tree") -> CheckResult:
    """(10a, b) On a server started with inject_faults (it is killed at the end: give it its own):
    n greedy requests with speculation (as many at once as the server admits), one in `every`
    marked to raise inside the engine in its own part of a step. Only the marked ones fail, each
    with a 500 and an OpenAI-shaped body; the others equal their solo runs; the pools end clean.
    Then a request stops the engine loop: /health answers 503 within 1 s, and a new request gets
    503."""
    from tandem.serve.driver import FAULT_USER, KILL_USER

    if not t.server.config.inject_faults:
        raise ValueError("check_faults needs a server started with inject_faults (tandem serve --inject-faults)")
    bodies = [{**long_body(i, max_tokens, stream=False), "prompt": f"# {i}\n" + PROMPTS[i % len(PROMPTS)],
               "method": method, **({"user": FAULT_USER} if i % every == every - 1 else {})} for i in range(n)]
    faulted = {i for i, b in enumerate(bodies) if b.get("user") == FAULT_USER}
    with t.client() as c:
        solo = {i: c.post("/v1/completions", json=b).json()["choices"][0]["text"]
                for i, b in enumerate(bodies) if i not in faulted}

    # at most the server's capacity in flight (more would be refused with 503 by design: check 4)
    rs = post_at_once(t, bodies, width=min(n, t.server.config.max_pending))
    problems = []
    for i, r in enumerate(rs):
        if i in faulted:
            if r.status_code != 500:
                problems.append(f"faulted request {i}: status {r.status_code}, not 500")
            problems += [f"faulted request {i}: {p}" for p in error_problems(r)]
        elif r.status_code != 200:
            problems.append(f"request {i} (not faulted): status {r.status_code}")
        elif r.json()["choices"][0]["text"] != solo[i]:
            problems.append(f"request {i} (not faulted): output differs from its solo run")
    idle(t.server)
    problems += pool_violations(t.server)
    failed_ok = sum(1 for i in faulted if rs[i].status_code == 500)
    others_ok = sum(1 for i, r in enumerate(rs) if i not in faulted and r.status_code == 200)
    # (b) the engine loop dies: /health must say so within a second, and nothing is admitted
    with t.client(timeout=30) as c:
        c.post("/v1/completions", json={**long_body(0, 4, stream=False), "user": KILL_USER})
        t0 = time.monotonic()
        while c.get("/health").status_code != 503:
            if time.monotonic() - t0 > 5:
                break
            time.sleep(0.01)
        health_s = time.monotonic() - t0
        after = c.post("/v1/completions", json=long_body(1, 4, stream=False))
    if health_s > 1.0:
        problems.append(f"/health took {health_s:.2f} s to answer 503 (the bar is 1 s)")
    if after.status_code != 503:
        problems.append(f"a request after the engine stopped got {after.status_code}, not 503")
    return CheckResult("faults", f"{failed_ok} of {len(faulted)} faulted requests failed alone (500), {others_ok} of "
                       f"{n - len(faulted)} others completed as solo; engine killed: /health 503 after "
                       f"{1000 * health_s:.0f} ms", not problems, tuple(problems[:10]))


def check_sigterm(max_tokens: int = 400, grace_s: float = 0.5, timeout_s: float = 60.0,
                  engine_process: bool = False) -> CheckResult:
    """(10c) A real `tandem serve` process (the bundled pair, ar; with `engine_process`, its engine
    in a process of its own) gets SIGTERM with two streams in flight: each stream ends with
    [DONE] (finished, or the 503 shutdown event once the grace is over), the process exits by the
    signal after a clean shutdown, and its log has no traceback."""
    import os
    import signal
    import subprocess
    import tempfile
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])  # this checkout, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        log_path = Path(d) / "serve.log"
        with open(log_path, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "--port", "0", "--methods", "ar",
                                     "--shutdown-grace", str(grace_s), "--log-level", "info"]
                                    + (["--engine-process"] if engine_process else []),
                                    stdout=f, stderr=f, env=env)
        try:
            deadline, url = time.monotonic() + timeout_s, None
            while url is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    return CheckResult("sigterm", "the server did not start", False, (log_path.read_text()[-300:],))
                m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log_path.read_text())
                url = m.group(1) if m else None
                time.sleep(0.05)
            outs: list[list[str]] = [[], []]
            started = [threading.Event(), threading.Event()]

            def stream(k: int) -> None:
                body = {"prompt": PROMPTS[k], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
                    for ln in r.iter_lines():
                        started[k].set()
                        if ln.startswith("data: "):
                            outs[k].append(ln[len("data: "):])

            threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(2)]
            for th in threads:
                th.start()
            for ev in started:
                ev.wait(timeout_s)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout_s)
            for th in threads:
                th.join(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        text = log_path.read_text()
    if rc != -signal.SIGTERM:
        problems.append(f"exit status {rc}, not -SIGTERM")
    if "Application shutdown complete" not in text or "Traceback" in text:
        problems.append("no clean shutdown in the log (or a traceback)")
    ends = []
    for k, out in enumerate(outs):
        if not out or out[-1] != "[DONE]":
            problems.append(f"stream {k} did not end with [DONE]")
            continue
        last = json.loads(out[-2]) if len(out) > 1 else {}
        ends.append(f"503 {last['error'].get('code')}" if "error" in last else "finished")
    return CheckResult("sigterm", f"exit by SIGTERM after a clean shutdown: {rc == -signal.SIGTERM}; streams ended: "
                       f"{', '.join(ends) or 'none'}", not problems, tuple(problems))


# ---- (6) the KV invariant --------------------------------------------------------------------------------
def check_kv_invariant(t: Target, phase: str) -> CheckResult:
    """(6) Once idle, every engine's pool passes check() and holds no block."""
    problems = [] if idle(t.server) else ["requests still in the engine after 5 s"]
    problems += pool_violations(t.server)
    return CheckResult(f"kv_invariant after {phase}", f"{len(problems)} violations", not problems, tuple(problems))


# ---- (9) streaming ---------------------------------------------------------------------------------------
def check_streaming(t: Target, prompts: list[str] = PROMPTS, max_tokens: int = 8) -> CheckResult:
    """(9) Each stream (completions and chat, each served method): exactly one finish_reason, one
    `[DONE]` and last, usage equal to the non-streamed request's, deltas joined == its text."""
    problems, n = [], 0
    with t.client() as c:
        for p in prompts:
            for method in t.server.config.methods:
                for route in ("/v1/completions", "/v1/chat/completions"):
                    n += 1
                    body = {"max_tokens": max_tokens, "temperature": 0, "method": method}
                    body.update({"prompt": p} if route == "/v1/completions" else
                                {"messages": [{"role": "user", "content": p}]})
                    ref = c.post(route, json=body).json()
                    with c.stream("POST", route, json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
                        events = sse_data(r.iter_lines())
                    where = f"{route} {method} {p!r}"
                    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
                        problems.append(f"{where}: [DONE] not once and last")
                        continue
                    chunks = [json.loads(e) for e in events[:-1]]
                    choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
                    finishes = [ch["finish_reason"] for ch in choices if ch["finish_reason"] is not None]
                    chat = route.endswith("chat/completions")
                    text = "".join((ch["delta"].get("content") or "") if chat else ch["text"] for ch in choices)
                    ref_text = ref["choices"][0]["message"]["content"] if chat else ref["choices"][0]["text"]
                    usage = [ch["usage"] for ch in chunks if ch.get("usage")]
                    if len(finishes) != 1 or finishes[0] != ref["choices"][0]["finish_reason"]:
                        problems.append(f"{where}: finish reasons {finishes}")
                    if text != ref_text:
                        problems.append(f"{where}: deltas join to {text!r}, not {ref_text!r}")
                    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
                    if len(usage) != 1 or [usage[0][k] for k in keys] != [ref["usage"][k] for k in keys]:
                        problems.append(f"{where}: usage {usage} vs {ref['usage']}")
    return CheckResult("streaming", f"{n - len(problems)} of {n} streams exact", not problems, tuple(problems[:10]))


# ---- (11) the ledger --------------------------------------------------------------------------------------
def check_ledger(t: Target, rounds: int = 2) -> CheckResult:
    """(11) A mixed workload counted by the client (completed, rejected, aborted; refusals before
    admission are not the ledger's) equals the server's own counters on /metrics, and
    sent = completed + rejected + aborted + failed."""
    s = t.server
    before = outcome_counts(t)
    mine = {"completed": 0, "rejected": 0, "aborted": 0, "failed": 0}
    sent = 0
    with t.client() as c:
        for k in range(rounds):
            for i in range(3):
                r = c.post("/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 3, "temperature": 0})
                sent += 1
                mine["completed" if r.status_code == 200 else "failed"] += 1
            c.post("/v1/completions", json={"prompt": "x", "n": s.config.max_n + 1})  # refused by validation: not sent
            held = HeldStreams(t, s.config.max_pending, max_tokens=min(400, s.context_window // 2))
            sent += s.config.max_pending
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            sent += 1
            mine["rejected" if r.status_code == 503 else "failed"] += 1
            held.close()  # every held stream goes away mid-stream
            mine["aborted"] += s.config.max_pending
            idle(s)
    after = outcome_counts(t)
    server = {k: after[k] - before[k] for k in mine}
    problems = []
    if sent != sum(mine.values()):
        problems.append(f"sent {sent} != {sum(mine.values())} counted")
    if server != {k: float(v) for k, v in mine.items()}:
        problems.append(f"the server counted {server}, the client {mine}")
    return CheckResult("ledger", f"sent {sent} = " + " + ".join(f"{v} {k}" for k, v in mine.items())
                       + f"; server's counters {'equal' if server == mine else 'differ'}",
                       not problems, tuple(problems))


# ---- (12) security ----------------------------------------------------------------------------------------
_opens: list[str] = []
_watch: list[str] = []
_hooked: list[bool] = []


def _audit(event: str, args) -> None:
    if event == "open" and _watch and isinstance(args[0], str) and any(w in args[0] for w in _watch):
        _opens.append(args[0])


def check_security(t: Target) -> CheckResult:
    """(12) Every /v1 route refuses a request without the key (401); 413 for an oversized body;
    404 for an unknown model, with no file opened under the name it gave."""
    problems = []
    routes = sorted({(r.path, m) for r in getattr(t.app, "routes", []) if r.path.startswith("/v1")
                     for m in getattr(r, "methods", ()) or ()})
    if not routes:
        problems.append("no /v1 routes found")
    for path, method in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": t.api_key}):
            r = httpx.request(method, t.url + path, headers=headers, json={"prompt": "x", "max_tokens": 1}, timeout=30)
            if r.status_code != 401:
                problems.append(f"{method} {path} with {headers or 'no key'}: {r.status_code}")
    with t.client() as c:
        r = c.post("/v1/completions", content=b"x" * (t.server.config.max_body_bytes + 1))
        if r.status_code != 413 or error_problems(r):
            problems.append(f"oversized body: {r.status_code}")
        if not _hooked:
            sys.addaudithook(_audit)  # hooks cannot be removed; this one only counts while _watch is set
            _hooked.append(True)
        name = "tandem-probe-model-a8f3"
        _opens.clear()
        _watch.append(name)
        try:
            r = c.post("/v1/completions", json={"prompt": "x", "model": f"../../{name}"})
        finally:
            _watch.clear()
        if r.status_code != 404 or error_problems(r):
            problems.append(f"unknown model: {r.status_code}")
        if _opens:
            problems.append(f"the unknown model opened {len(_opens)} files")
    n = len(routes) * 3 + 3  # each route x 3 keys, 413, 404, file opens
    unauthenticated = sum(p.startswith(("GET /v1", "POST /v1")) for p in problems)
    return CheckResult("security", f"{len(routes)} /v1 routes, {unauthenticated} unauthenticated; "
                                   f"{n - len(problems)} of {n} probes right; {len(_opens)} file opens",
                       not problems, tuple(problems))
