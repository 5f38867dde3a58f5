"""The FastAPI app: /v1/completions, /v1/chat/completions (JSON or server-sent events), /v1/models,
/health, /metrics.

A request's path through the server:

    BodyLimit (413 before parsing) -> auth (401) -> JSON + schema (400) -> bounds (400 / 404)
    -> capacity (503 + Retry-After) -> driver.submit -> events -> one JSON body, or SSE chunks

Every error, including unknown routes and bugs, leaves as an OpenAI-shaped body (errors.py).
A handler whose client goes away aborts its request in the engine: a stream through its
response's `finally`, a non-streamed request by polling for the disconnect while it waits.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.config import ConfigError
from tandem.engine.config import EngineConfig
from tandem.engine.request import SamplingParams
from tandem.runtime.streaming import StopStreamer
from tandem.serve.chat_template import BUILTIN_TEMPLATE, ChatTemplate, TemplateError
from tandem.serve.config import ServerConfig, engine_config_for
from tandem.serve.detokenize import IncrementalDecode
from tandem.serve.driver import (FAULT_PREFIX, FAULT_USER, KILL_PREFIX, KILL_USER, Delta, EngineDriver, Event, Failed,
                                 Finished, Job, inject_faults)
from tandem.serve.errors import APIError, error_body
from tandem.serve.engine_process import EngineSpec, ProcessDriver
from tandem.serve.logprobs import LogprobEngine, LogprobFormat, TextOffsets
from tandem.serve.metrics import ServerMetrics
from tandem.serve.schemas import ChatCompletionRequest, CompletionRequest, unknown_fields, unsupported
from tandem.serve.sse import DONE, ChunkTemplate, Slot, frame

log = logging.getLogger("tandem.serve")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
OMIT = object()  # a record's "usage" left out (None: sent as null)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions `logprobs`
DISCONNECT_POLL_S = 0.25


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 before anything parses it (declared
    Content-Length checked first, then the bytes actually received); the body is replayed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await _raw_error(send, 413, f"the request body is over {self.limit} bytes")
        body, more = bytearray(), True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > self.limit:
                return await _raw_error(send, 413, f"the request body is over {self.limit} bytes")
            more = msg.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _raw_error(send, status: int, message: str) -> None:
    data = json.dumps(error_body(status, message, code="request_too_large")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


class ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: finished, client gone before or
    during the body, or cancelled (an un-started generator's own `finally` would never run)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class RequestHandle:
    """One admitted request as the handler sees it: its events, and `close()` (idempotent) that
    aborts it in the engine unless it finished, and frees its place in the bounded queue."""

    def __init__(self, server: "Server", request_id: str):
        self.server, self.request_id = server, request_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._held: Event | None = None  # taken from the queue by next_merged, not yet handed out
        self.done = self.closed = False
        self.sent_at = -math.inf  # (event-loop clock) when next_merged last handed out a Delta
        self._pacing: asyncio.Future | None = None  # a paced next_merged's wait, cut short by the request's end

    def put(self, ev: Event) -> None:
        """The driver's delivery (on this handle's event loop)."""
        self.queue.put_nowait(ev)
        if self._pacing is not None and not isinstance(ev, Delta):
            _wake(self._pacing)  # (the end goes out now, not after the pacing gap)

    async def next(self) -> Event:
        if self._held is not None:
            ev, self._held = self._held, None
        else:
            ev = await self.queue.get()
        if isinstance(ev, (Finished, Failed)):
            self.done = True
        return ev

    async def next_merged(self) -> Event:
        """The next event, with the Deltas queued behind it joined into one (a stream that fell
        behind the engine sends one chunk for them, not one per step). Paced: a Delta waits until
        `Server.chunk_gap()` has passed since this stream's last one (the request's end cuts the
        wait short), gathering the steps that come meanwhile into one chunk."""
        ev = await self.next()
        if not isinstance(ev, Delta):
            return ev
        loop = asyncio.get_running_loop()
        wait = self.sent_at + self.server.chunk_gap() - loop.time()
        if wait > 0 and self.queue.empty():
            self._pacing = loop.create_future()
            timer = loop.call_later(wait, _wake, self._pacing)
            try:
                await self._pacing
            finally:
                timer.cancel()
                self._pacing = None
        self.sent_at = loop.time()
        ids, lps = list(ev.token_ids), list(ev.logprobs) if ev.logprobs is not None else None
        while not self.queue.empty():
            more = self.queue.get_nowait()
            if not isinstance(more, Delta):
                self._held = more  # (the end: next() hands it out)
                break
            ids += more.token_ids
            if lps is not None:
                lps += more.logprobs
        return Delta(ids, lps)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.server.pending -= 1
        self.server.metrics.pending.set(self.server.pending)
        if not self.done:
            self.server.driver.abort(self.request_id)


# a pydantic location's union-member tags ("str", "list[int]", "function-after[...]"): not part of the field path
_MEMBER_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "TextPart", "ChatMessage"}

# the union-typed fields, in words (pydantic reports each member's failure; the first one misleads)
_UNION_TYPES = {
    "prompt": "a string, a list of token ids, or a list of one of those",
    "stop": "a string or a list of strings",
    "content": "a string, a list of text parts ({\"type\": \"text\", \"text\": ...}) or null",
}


def _field_error(e: ValidationError) -> tuple[str, str | None]:
    """A validation error -> (one line for the client, the top-level field). A union field's
    message says what the field takes, not why its first member refused the value; a validator's
    own message (ValueError) comes through as it is."""
    errs = e.errors(include_url=False, include_input=False)
    own = [x for x in errs if x["type"] == "value_error"]
    err = own[0] if own else errs[0]
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and (x in _MEMBER_TAGS or "[" in x))]
    param, where = (loc[0] if loc else None), ".".join(loc) or "body"
    if own:  # (a validator's message: the field's own words)
        return f"invalid field {where}: {err['msg'].removeprefix('Value error, ')}", param
    if loc and loc[-1] in _UNION_TYPES and len(errs) > 1:
        return f"invalid field {where}: must be {_UNION_TYPES[loc[-1]]}", param
    if err["type"] == "missing":
        return f"missing field {where}", param
    return f"invalid field {where}: {err['msg']}", param


def valid_text(text: str, param: str) -> str:
    """text, if it is valid Unicode: JSON's escapes can carry a lone UTF-16 surrogate ("\\ud800"),
    which no tokenizer encodes (it failed inside the tokenizer: a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at character "
                            f"{e.start}; send valid Unicode text", param=param, code="invalid_value") from None
    return text


def clip(value: str, limit: int = 64) -> str:
    """A client's string echoed in an error message, cut short: an error body stays small (<= 4 KB)."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value)} characters)"


class Server:
    """The state behind the routes: engines (one per served method, sharing the models), the driver,
    the tokenizer and chat template, the bounded-queue count (event-loop thread only)."""

    def __init__(self, target, draft, tokenizer, config: ServerConfig = ServerConfig(),
                 engine_config: EngineConfig = EngineConfig(), chat_template: ChatTemplate | None = None,
                 engine_process: EngineSpec | None = None, engine_threads: int | None = None):
        """engine_process: run the engines in a process of their own, built from this spec
        (tandem.serve.engine_process; target and draft are then None: this process loads no model).
        engine_threads: torch's intra-op threads for the engine thread (driver.spare_main_thread)."""
        config.validate()
        self.config, self.engine_config, self.tokenizer = config, engine_config, tokenizer
        self.vocab_size = tokenizer.get_vocab_size()  # token-id prompts are ids the tokenizer can decode
        self.chat_template = chat_template or ChatTemplate(BUILTIN_TEMPLATE, builtin=True)
        self.metrics = ServerMetrics()
        self.engines: dict[str, LogprobEngine] = {}  # (empty with an engine process)
        if engine_process is not None:
            self.driver = ProcessDriver(engine_process, self.metrics)
            self.context_window = min(self.driver.context_windows.values())
        else:
            self.engines = {m: LogprobEngine(target, draft if m != "ar" else None, tokenizer,
                                             engine_config_for(engine_config, m)) for m in config.methods}
            self.context_window = min(e.context_window for e in self.engines.values())
            self.driver = EngineDriver(self.engines, self.metrics, threads=engine_threads)
            if config.inject_faults:
                for e in self.engines.values():
                    e.fault_hook = inject_faults
        self.pending = 0
        self.streams = 0  # streamed requests open (event-loop thread only): they share max_chunk_rate
        self.created = int(time.time())
        self.warned_fields: set[str] = set()  # unknown request fields already logged

    def chunk_gap(self) -> float:
        """Seconds a stream waits between two chunks: the open streams share max_chunk_rate. Every
        chunk is a write to its own socket; on the H100 machine's host the server process ran out
        of one core at ~10,000 chunks a second (64 streams of `ar`, 2026-12-07), then answered the
        requests' ends late and the engine ran with fewer requests than the clients kept open."""
        rate = self.config.max_chunk_rate
        return self.streams / rate if rate > 0 else 0.0

    # ---- checks --------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key; send 'Authorization: Bearer KEY'", code="invalid_api_key")

    async def parse(self, request: Request, schema: type[BaseModel]):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            body = schema.model_validate(data)
        except ValidationError as e:
            raise APIError(400, *_field_error(e), code="invalid_value") from None
        refused = unsupported(body)
        if refused is not None:
            name, neutral = refused
            raise APIError(400, f"{name} is not supported by this server (send {neutral} or leave it out)",
                           param=name, code="unsupported_value")
        new = [n for n in unknown_fields(body) if n not in self.warned_fields]
        if new:  # (once per field name: a client sends the same fields with every request)
            self.warned_fields.update(new)
            log.warning("ignoring request field(s) this server does not know: %s", ", ".join(sorted(new)))
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                           code="invalid_value")
        return body

    def sampling(self, body, prompt_len: int, max_tokens: int | None, top_logprobs: int | None,
                 max_name: str = "max_tokens") -> tuple[SamplingParams, str]:
        """Bounds of the shared fields -> the engine's SamplingParams and the method. max_name: the
        field the client set max_tokens by (chat's max_completion_tokens)."""
        c = self.config
        if body.model is not None and body.model != c.served_model_name:
            raise APIError(404, f"model {clip(body.model)} is not served here; this server serves "
                                f"{c.served_model_name!r}", param="model", code="model_not_found")
        if not 1 <= body.n <= c.max_n:
            raise APIError(400, f"n must be in 1..{c.max_n} (got {body.n})", param="n", code="invalid_value")
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
            if getattr(body, name) != neutral:
                raise APIError(400, f"{name} is not supported (only 0)", param=name, code="unsupported_value")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_value")
        method = body.method or c.methods[0]
        if method not in c.methods:
            raise APIError(400, f"method {clip(method)} is not served here; choose one of {', '.join(c.methods)}",
                           param="method", code="unsupported_value")
        if prompt_len >= self.context_window:
            raise APIError(400, f"the prompt is {prompt_len} tokens but the context window is "
                                f"{self.context_window}; shorten it", param="messages" if isinstance(
                               body, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
        cap = min(c.max_tokens_limit, self.context_window)
        if max_tokens is None:
            max_tokens = min(c.max_tokens_limit, self.context_window - prompt_len)
        if not 1 <= max_tokens <= cap:
            raise APIError(400, f"{max_name} must be in 1..{cap} (got {max_tokens})", param=max_name,
                           code="invalid_value")
        if prompt_len + max_tokens > self.context_window:  # (as vLLM: refused, not cut short without a word)
            raise APIError(400, f"the context window is {self.context_window} tokens, and the prompt's {prompt_len} "
                                f"plus {max_name}={max_tokens} ask for {prompt_len + max_tokens}; lower {max_name} to "
                                f"at most {self.context_window - prompt_len} or shorten the prompt", param=max_name,
                           code="context_length_exceeded")
        if not 0 <= body.temperature <= 2:
            raise APIError(400, f"temperature must be in [0, 2] (got {body.temperature})", param="temperature",
                           code="invalid_value")
        if not 0 < body.top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1] (got {body.top_p})", param="top_p", code="invalid_value")
        stop = [valid_text(x, "stop") for x in ([body.stop] if isinstance(body.stop, str) else list(body.stop or []))]
        if len(stop) > c.max_stop:
            raise APIError(400, f"at most {c.max_stop} stop strings (got {len(stop)})", param="stop",
                           code="invalid_value")
        if any(not 1 <= len(s) <= c.max_stop_chars for s in stop):
            raise APIError(400, f"each stop string must have 1..{c.max_stop_chars} characters", param="stop",
                           code="invalid_value")
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        return SamplingParams(max_tokens=max_tokens, temperature=float(body.temperature), top_p=float(body.top_p),
                              seed=seed, stop=tuple(stop), ignore_eos=body.ignore_eos), method

    # ---- running a request ---------------------------------------------------------------
    async def open(self, prompt_ids: list[int], params: SamplingParams, method: str,
                   top_logprobs: int | None, user: str | None = None) -> RequestHandle:
        c = self.config
        if not self.driver.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        if self.pending >= c.max_pending:
            self.metrics.requests.labels("rejected").inc()
            raise APIError(503, f"the server is at capacity ({c.max_pending} requests in flight); retry later",
                           code="server_busy", headers={"Retry-After": str(c.retry_after_s)})
        prefix = ""
        if c.inject_faults:  # the reliability harness marks the requests to fault (ServerConfig)
            prefix = {FAULT_USER: FAULT_PREFIX, KILL_USER: KILL_PREFIX}.get(user or "", "")
        handle = RequestHandle(self, f"{prefix}{uuid.uuid4().hex}")
        loop = asyncio.get_running_loop()
        self.pending += 1
        self.metrics.pending.set(self.pending)
        job = Job(handle.request_id, prompt_ids, params, method, top_logprobs, loop=loop, put=handle.put)
        try:
            await asyncio.wrap_future(self.driver.submit(job))
        except ConfigError as e:
            handle.done = True
            handle.close()
            raise APIError(400, str(e), code="invalid_value") from None
        except BaseException:
            handle.close()
            raise
        return handle

    async def open_all(self, prompt_ids: list[int], params: SamplingParams, n: int, method: str,
                       top_logprobs: int | None, user: str | None = None) -> list[RequestHandle]:
        """n requests for one prompt (choice i samples with seed + i), each counted against
        --max-pending; if one cannot open, those already open are closed."""
        handles: list[RequestHandle] = []
        try:
            for i in range(n):
                handles.append(await self.open(prompt_ids, replace(params, seed=params.seed + i), method,
                                               top_logprobs, user))
        except BaseException:
            for h in handles:
                h.close()
            raise
        return handles

    async def collect_all(self, request: Request, handles: list[RequestHandle]) -> list[Finished]:
        """collect() for every choice; the first failure aborts the others."""
        if len(handles) == 1:
            return [await self.collect(request, handles[0])]
        tasks = [asyncio.ensure_future(self.collect(request, h)) for h in handles]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # (a choice that failed leaves the others: cancelled, so each aborts)
                t.cancel()

    async def collect(self, request: Request, handle: RequestHandle) -> Finished:
        """Wait for the end of a non-streamed request; abort it if the client goes away.

        The disconnect poll runs on a clock, not only when no event came: a decoding request's
        events arrive every step, so polling only on a quiet spell never polled at all."""
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(handle.next(), max(next_poll - loop.time(), 0.001))
                except asyncio.TimeoutError:
                    ev = None
                if loop.time() >= next_poll:
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    next_poll = loop.time() + DISCONNECT_POLL_S
                if isinstance(ev, Finished):
                    return ev
                if isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, code=ev.code)
        finally:
            handle.close()


def records(kind: str, rid: str, created: int, model: str):
    """record(choices, use=OMIT): a response record of `kind` ("text_completion",
    "chat.completion.chunk") holding `choices`; `use` its usage (OMIT: no key, None: null)."""
    def record(choices: list, use=OMIT) -> dict:
        out = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
        if use is not OMIT:
            out["usage"] = use
        return out

    return record


def usage(fins: list[Finished]) -> dict:
    """A request's usage over its choices (the prompt counted once, as OpenAI counts it)."""
    outs = [fin.output for fin in fins]
    n, p = sum(len(o.token_ids) for o in outs), len(outs[0].prompt_token_ids)
    passes = sum(o.figures.target_passes for o in outs)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            # extension: the request's speculation (tau: tokens per target verify pass, bonus included)
            "speculative": {"method": fins[0].method, "draft_tokens": sum(o.figures.draft_tokens for o in outs),
                            "accepted_tokens": sum(o.figures.accepted_tokens for o in outs),
                            "target_passes": passes, "tau": round(n / max(1, passes), 4)}}


def create_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.driver.start()
        try:
            yield
        finally:
            server.driver.stop()

    app = FastAPI(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=server.config.max_body_bytes)
    tok = server.tokenizer
    fmt = LogprobFormat(tok)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = {404: "no such route", 405: "method not allowed on this route"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(e.status_code, msg), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, "internal server error", code="internal_error"), status_code=500)

    @app.get("/health")
    async def health():
        if not server.driver.alive:
            return JSONResponse(error_body(503, "the engine loop is not running", code="engine_unavailable"),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        c = server.config
        return {"id": c.served_model_name, "object": "model", "created": server.created, "owned_by": "tandem",
                "max_model_len": server.context_window, "methods": list(c.methods)}

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        server.authorize(request)
        if model != server.config.served_model_name:
            raise APIError(404, f"model {clip(model)} is not served here; this server serves "
                                f"{server.config.served_model_name!r}", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.authorize(request)
        body: CompletionRequest = await server.parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a list of prompts
            if len(prompt) != 1:
                raise APIError(400, "give one prompt per request (a string or token ids, or a list of one)",
                               param="prompt", code="unsupported_value")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if isinstance(prompt, list) and not all(0 <= t < server.vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {server.vocab_size})", param="prompt",
                           code="invalid_value")
        for name, bad in (("echo", body.echo), ("best_of", body.best_of not in (None, 1)),
                          ("suffix", body.suffix is not None)):
            if bad:
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_value")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs must be in 0..{MAX_COMPLETION_LOGPROBS}", param="logprobs",
                           code="invalid_value")
        ids = list(prompt) if isinstance(prompt, list) else tok.encode(valid_text(prompt, "prompt")).ids  # as `tandem generate` encodes
        params, method = server.sampling(body, len(ids), body.max_tokens, body.logprobs)
        handles = await server.open_all(ids, params, body.n, method, body.logprobs, body.user)
        rid, created, name = f"cmpl-{handles[0].request_id}", int(time.time()), server.config.served_model_name
        offsets = [TextOffsets() for _ in handles]  # (each token's place in its choice's text, across chunks)

        def choice(i: int, text: str, finish: str | None, lps, stop: str | None = None) -> dict:
            return {"index": i, "text": text,
                    "logprobs": fmt.completion(lps, offsets[i]) if lps is not None else None, "finish_reason": finish,
                    "stop_reason": stop}  # (vLLM's: the stop string that ended it; null for an EOS)

        record = records("text_completion", rid, created, name)

        if not body.stream:
            fins = await server.collect_all(request, handles)
            return record([choice(i, fin.output.text, FINISH_REASONS.get(fin.output.finish_reason), fin.logprobs,
                                  fin.output.stop_reason) for i, fin in enumerate(fins)], usage(fins))
        return stream(handles, params, body, record, choice, len(ids))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        server.authorize(request)
        body: ChatCompletionRequest = await server.parse(request, ChatCompletionRequest)
        top = None
        if body.logprobs:
            top = body.top_logprobs or 0
            if not 0 <= top <= server.config.max_top_logprobs:
                raise APIError(400, f"top_logprobs must be in 0..{server.config.max_top_logprobs}",
                               param="top_logprobs", code="invalid_value")
        elif body.top_logprobs is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        messages = [{"role": m.role, "content": valid_text(m.text(), "messages"), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            text = server.chat_template.render(messages, body.add_generation_prompt, body.chat_template_kwargs)
        except TemplateError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        ids = tok.encode(text, add_special_tokens=False).ids  # the template wrote any special tokens
        if not ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages", code="invalid_value")
        named = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params, method = server.sampling(body, len(ids), getattr(body, named), top, named)
        handles = await server.open_all(ids, params, body.n, method, top, body.user)
        rid, created, name = f"chatcmpl-{handles[0].request_id}", int(time.time()), server.config.served_model_name

        if not body.stream:
            fins = await server.collect_all(request, handles)
            return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": fin.output.text},
                                 "logprobs": fmt.chat(fin.logprobs) if fin.logprobs is not None else None,
                                 "finish_reason": FINISH_REASONS.get(fin.output.finish_reason),
                                 "stop_reason": fin.output.stop_reason}
                                for i, fin in enumerate(fins)],
                    "usage": usage(fins)}

        record = records("chat.completion.chunk", rid, created, name)

        def choice(i: int, text: str, finish: str | None, lps, stop: str | None = None) -> dict:
            return {"index": i, "delta": {"content": text}, "logprobs": fmt.chat(lps) if lps is not None else None,
                    "finish_reason": finish, "stop_reason": stop}

        # (each choice's role first, in a chunk of its own, as OpenAI and vLLM send it: an output that
        # stops at once has no text chunk to carry it)
        first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(len(handles))]
        return stream(handles, params, body, record, choice, len(ids), first)

    def stream(handles: list[RequestHandle], params: SamplingParams, body, record, choice, prompt_len: int,
               first: list[dict] | None = None) -> ClosingStream:
        """Server-sent events: `first` (chat: each choice's role), a chunk per step that released
        text (or logprobs; a stream behind the engine joins its queued steps into one chunk), a last
        chunk per choice with its finish_reason, an optional usage chunk, then `data: [DONE]`. With
        include_usage every other chunk has "usage": null (OpenAI's shape); with
        `continuous_usage_stats` too (vLLM's extension) every chunk carries the token counts so far
        (over every choice) instead. n choices (n requests) are interleaved as their steps come."""
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)

        def counts(n: int):
            if continuous:
                return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
            return None if include_usage else OMIT

        # the common chunk of each choice (text, no logprobs) from a template: the same bytes as frame()
        later = [ChunkTemplate(record([choice(i, Slot("text"), None, None)],
                                      {"prompt_tokens": prompt_len, "completion_tokens": Slot("n"),
                                       "total_tokens": Slot("total")} if continuous else counts(0)))
                 for i in range(len(handles))]

        async def merged():
            """(choice, event) of every handle until each ended (one handle: straight from it)."""
            if len(handles) == 1:
                while True:
                    ev = await handles[0].next_merged()
                    yield 0, ev
                    if not isinstance(ev, Delta):
                        return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, h: RequestHandle) -> None:
                while True:
                    ev = await h.next_merged()
                    queue.put_nowait((i, ev))
                    if not isinstance(ev, Delta):
                        return

            tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
            try:
                for _ in range(len(handles)):
                    while True:
                        i, ev = await queue.get()
                        yield i, ev
                        if not isinstance(ev, Delta):
                            break
            finally:
                for t in tasks:
                    t.cancel()

        async def events():
            for c in first or ():
                yield frame(record([c], counts(0)))
            streamers = [StopStreamer(IncrementalDecode(tok.decode), params.stop) for _ in handles]
            made = [0] * len(handles)  # each choice's tokens so far (at its end: its output's, cut at a stop)
            tokens, ended = 0, []
            tail = b""  # a choice's last chunk, sent with whatever comes next (the end: one write, not three)
            async for i, ev in merged():
                if isinstance(ev, Delta):
                    made[i] += len(ev.token_ids)
                    tokens += len(ev.token_ids)
                    text = streamers[i].push(ev.token_ids)
                    if ev.logprobs is None:
                        if text:
                            yield tail + later[i].fill(text=text, n=tokens, total=prompt_len + tokens)
                            tail = b""
                    elif text or ev.logprobs:
                        yield tail + frame(record([choice(i, text, None, ev.logprobs)], counts(tokens)))
                        tail = b""
                elif isinstance(ev, Finished):
                    ended.append(ev)
                    tokens += len(ev.output.token_ids) - made[i]
                    rest = streamers[i].finish(ev.output.text)
                    tail += frame(record([choice(i, rest, FINISH_REASONS.get(ev.output.finish_reason), None,
                                                 ev.output.stop_reason)], counts(tokens)))
                else:  # (one choice failed: the stream ends; closing it aborts the others)
                    close()  # (before the last write: see below)
                    yield tail + frame(error_body(ev.status, ev.message, code=ev.code)) + DONE
                    return
            # the requests are done: their places in the bounded queue go before the last write, as a
            # client that reads [DONE] may send its next request at once (a soak of 8 streams back to
            # back on a server admitting 8 got 503 for 90 of 1,084 requests, the places still held
            # while the response closed)
            close()
            yield tail + (frame(record([], usage(ended))) if include_usage else b"") + DONE

        server.streams += len(handles)
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                server.streams -= len(handles)
            for h in handles:
                h.close()

        return ClosingStream(events(), close, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app
