"""`tandem serve` end to end: a real uvicorn server on 127.0.0.1 (a free port), driven over loopback
with httpx. Greedy outputs equal `tandem generate --method ar`'s; streams equal non-streamed
text; every refusal has its status and OpenAI-shaped body; a disconnect leaves the pool clean."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tandem.config import GenerationConfig  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.runtime.pair import bundled_available, load_pair  # noqa: E402
from tandem.serve.chat_template import ChatTemplate, TemplateError  # noqa: E402
from tandem.serve.config import ServerConfig  # noqa: E402

if not bundled_available():
    pytest.skip("the bundled pair is not in this checkout", allow_module_level=True)

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(", "# sort a list\n", "def main():",
           "x = [", "while True:"]


class LiveServer:
    """uvicorn in a thread, bound to 127.0.0.1 on a port the OS picks; `stop()` takes the path
    SIGTERM takes in `tandem serve` (tandem.serve.runner)."""

    def __init__(self, server):
        from tandem.serve.app import create_app
        from tandem.serve.runner import make_server

        self.state = server
        self.uvicorn = make_server(create_app(server), server, "127.0.0.1", 0, log_level="warning")
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        host, self.port = self.uvicorn.servers[0].sockets[0].getsockname()[:2]
        assert host == "127.0.0.1"
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def pair():
    return load_pair(None, None, "cpu", "float32")


def make_server(pair, engine: dict | None = None, **config):
    from tandem.serve.app import Server

    cfg = ServerConfig(**config)
    ecfg = EngineConfig(num_blocks=256, max_num_seqs=8, debug_check=True, **(engine or {}))
    return LiveServer(Server(pair.target, pair.draft, pair.tokenizer, cfg, ecfg,
                             ChatTemplate.for_checkpoint(pair.target_dir)))


@pytest.fixture(scope="module")
def live(pair):
    s = make_server(pair, api_key=KEY, methods=("tree", "ar"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def solo(pair):
    """Each prompt's solo greedy `ar` output text (single-request loop), 8 new tokens."""
    from tandem.runtime.generate import Generator

    g = Generator(pair.target, None, pair.tokenizer)
    gen = GenerationConfig(max_new_tokens=8)
    return {p: pair.tokenizer.decode(g.generate(pair.tokenizer.encode(p).ids, "ar", gen=gen).token_ids)
            for p in PROMPTS}


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": "tandem", "temperature": 0, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(response) -> list:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def wait_clean(server, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(e.requests or e.has_unfinished() for e in server.engines.values()) or server.pending:
        assert time.monotonic() < deadline, "requests still in the engine"
        time.sleep(0.02)
    for e in server.engines.values():
        assert e.pool.check() == [] and e.pool.num_free == e.pool.num_blocks and e.pool.seqs == {}


# ---- outputs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["tree", "ar"])
def test_greedy_completion_equals_tandem_generate_ar(client, live, capsys, method):
    from tandem.cli import main

    assert main(["generate", PROMPTS[0], "--method", "ar", "--max-new-tokens", "8", "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    out = complete(client, prompt=PROMPTS[0], method=method)
    ch = out["choices"][0]
    assert out["object"] == "text_completion" and out["model"] == "tandem"
    assert ch["text"] == ref["text"] and ch["finish_reason"] == {"eos": "stop"}.get(ref["finish_reason"],
                                                                                     ref["finish_reason"])
    u = out["usage"]
    assert u["completion_tokens"] == len(ref["token_ids"]) and u["prompt_tokens"] == ref["prompt_tokens"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    spec = u["speculative"]
    assert spec["method"] == method and spec["target_passes"] >= 1
    assert spec["tau"] == pytest.approx(u["completion_tokens"] / spec["target_passes"], abs=1e-4)
    if method == "ar":
        assert spec["draft_tokens"] == spec["accepted_tokens"] == 0 and spec["tau"] == 1.0
    else:
        assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["ar", "tree"])
def test_logprobs_come_from_the_target_and_match_the_greedy_tokens(client, method):
    out = complete(client, prompt=PROMPTS[1], method=method, logprobs=3)
    lp = out["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert len(lp["token_logprobs"]) == out["usage"]["completion_tokens"] == 8
    for tok, own, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert own <= 0 and len(top) == 3
        best = max(top, key=top.get)  # greedy: the chosen token is the target's argmax
        assert best == tok and top[best] == pytest.approx(own, abs=1e-5)
    assert lp["text_offset"][0] == 0


def test_chat_renders_the_template_and_equals_the_solo_output(client, live, pair):
    from tandem.runtime.generate import Generator

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fib please"}]
    r = client.post("/v1/chat/completions", json={"model": "tandem", "messages": messages, "temperature": 0,
                                                  "max_tokens": 8, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    text = live.state.chat_template.render(messages)
    assert text == "# system: You write Python.\n# user: fib please\n# assistant:\n"  # the built-in template
    ids = pair.tokenizer.encode(text, add_special_tokens=False).ids
    ref = Generator(pair.target, None, pair.tokenizer).generate(ids, "ar", gen=GenerationConfig(max_new_tokens=8))
    ch = out["choices"][0]
    assert out["object"] == "chat.completion" and ch["message"]["role"] == "assistant"
    assert ch["message"]["content"] == pair.tokenizer.decode(ref.token_ids)
    assert out["usage"]["prompt_tokens"] == len(ids)
    content = ch["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == ch["message"]["content"]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"] for c in content)


def test_a_checkpoint_template_is_read_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
                         "{{ raise_exception('no tools') }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}))
    t = ChatTemplate.for_checkpoint(tmp_path)
    assert not t.builtin
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi</s>[assistant]"
    with pytest.raises(TemplateError, match="no tools"):
        t.render([{"role": "tool", "content": "x"}])
    assert ChatTemplate.for_checkpoint(tmp_path / "missing").builtin


def test_streaming_deltas_join_to_the_text_with_usage_and_stop_strings(client, pair):
    ref = complete(client, prompt=PROMPTS[0], max_tokens=12, method="tree")
    text = ref["choices"][0]["text"]
    for method in ("tree", "ar"):
        body = {"model": "tandem", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True,
                "method": method, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        chunks, usage = events[:-1], events[-1]
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        assert [c["choices"][0]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1
        assert chunks[-1]["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    # a stop string from the middle of the text: cut before it, in both modes
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text[:text.find(stop)]
    plain = complete(client, prompt=PROMPTS[0], max_tokens=12, stop=[stop, "@@never@@"])
    assert plain["choices"][0]["text"] == cut and plain["choices"][0]["finish_reason"] == "stop"
    # a prompt of token ids (OpenAI's array form, or a list of one) decodes as its text does
    ids = pair.tokenizer.encode(PROMPTS[0]).ids
    for prompt in (ids, [ids]):
        got = complete(client, prompt=prompt, max_tokens=12)
        assert got["choices"][0]["text"] == text and got["usage"]["prompt_tokens"] == len(ids)
    for prompt, msg in (([10 ** 9], "prompt token ids must be in [0,"), ([ids, ids], "give one prompt per request"),
                        ([], "the prompt is empty")):
        r = client.post("/v1/completions", json={"model": "tandem", "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400 and msg in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
    # usage and logprobs count the tokens up to the one that completed the stop, whatever the method
    cuts = [complete(client, prompt=PROMPTS[0], max_tokens=12, stop=stop, method=m, logprobs=0) for m in ("ar", "tree")]
    counts = [{k: c["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} for c in cuts]
    assert counts[0] == counts[1] and cuts[0]["choices"][0]["text"] == cuts[1]["choices"][0]["text"]
    assert all(len(c["choices"][0]["logprobs"]["tokens"]) == c["usage"]["completion_tokens"] for c in cuts)
    with client.stream("POST", "/v1/completions",
                       json={"model": "tandem", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                             "stream": True, "stop": stop}) as r:
        chunks = sse_events(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_continuous_usage_gives_every_chunk_the_token_counts_so_far(client):
    """stream_options continuous_usage_stats (vLLM's extension, with include_usage): each chunk's
    usage counts the tokens streamed so far; the chunks still join to the non-streamed text."""
    ref = complete(client, prompt=PROMPTS[1], max_tokens=24, method="ar", ignore_eos=True)
    for route, text_of in (("/v1/completions", lambda c: c["choices"][0]["text"]),
                           ("/v1/chat/completions", lambda c: c["choices"][0]["delta"].get("content", ""))):
        body = {"model": "tandem", "max_tokens": 24, "temperature": 0, "stream": True, "method": "ar",
                "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        body.update({"prompt": PROMPTS[1]} if route == "/v1/completions" else
                    {"messages": [{"role": "user", "content": "a loop"}]})
        with client.stream("POST", route, json=body) as r:
            events = sse_events(r)
        chunks, final = events[:-1], events[-1]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == final["usage"]["completion_tokens"] == 24
        p = final["usage"]["prompt_tokens"]
        assert all(c["usage"] == {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
                   for c, n in zip(chunks, counts))
        if route == "/v1/completions":
            assert "".join(text_of(c) for c in chunks) == ref["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4, "stream": True,
                                                        "stream_options": {"continuous_usage_stats": True}}) as r:
        assert all("usage" not in c for c in sse_events(r))  # (only with include_usage, as vLLM)


def test_a_chunk_template_gives_the_bytes_of_json_dumps():
    from tandem.serve.sse import ChunkTemplate, Slot, frame

    def record(text, n, total):
        return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
                "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": total}}

    t = ChunkTemplate(record(Slot("text"), Slot("n"), Slot("total")))
    for text, n in (("", 0), ("def f(x):\n\treturn \"x\"", 12), ("\u00e9\ufffd\U0001F600\x00\\", 4096)):
        assert t.fill(text=text, n=n, total=n + 3) == frame(record(text, n, n + 3))
        assert frame(record(text, n, n + 3)) == b"data: " + json.dumps(record(text, n, n + 3)).encode() + b"\n\n"


def test_incremental_detokenization_equals_decoding_the_whole_output(pair):
    """IncrementalDecode over a growing list equals the tokenizer's decode of the whole list at
    every push (random ids: split multi-byte characters, special tokens, 1..5 tokens a push)."""
    import random

    from tandem.serve.detokenize import IncrementalDecode

    tok, rng = pair.tokenizer, random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(100):
        ids, dec = [], IncrementalDecode(tok.decode)
        for _ in range(rng.randint(1, 40)):
            ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            assert dec(ids) == tok.decode(ids)


def test_chat_streaming_equals_chat_text(client):
    body = {"messages": [{"role": "user", "content": "a loop"}], "temperature": 0, "max_tokens": 8}
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = sse_events(r)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == full


def test_eight_concurrent_requests_each_equal_their_solo_output(live, solo):
    async def one(c, i, p):
        body = {"model": "tandem", "prompt": p, "max_tokens": 8, "temperature": 0, "method": ("tree", "ar")[i % 2]}
        if i % 3 == 0:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
            return "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
        r = await c.post("/v1/completions", json=body)
        return r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(one(c, i, p) for i, p in enumerate(PROMPTS)))

    assert asyncio.run(main()) == [solo[p] for p in PROMPTS]
    wait_clean(live.state)


def test_models_health_and_metrics(client, live):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tandem"] and models["data"][0]["methods"] == ["tree", "ar"]
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}  # no key needed
    complete(client, prompt=PROMPTS[2], method="tree")
    complete(client, prompt=PROMPTS[2], method="ar")  # (the ar engine's step metric: this test's own steps)
    m = httpx.get(live.url + "/metrics").text
    for needle in ('tandem_requests_total{outcome="completed"}', 'tandem_request_tau_bucket{le="1.0",method="tree"}',
                   'tandem_kv_blocks_in_use{method="tree"}', 'tandem_steps_total{method="tree",speculative="true"}',
                   "tandem_queue_depth", 'tandem_step_seconds_count{method="ar"}', "tandem_generation_tokens_total",
                   "tandem_engine_alive 1.0"):
        assert needle in m, needle


# ---- refusals -------------------------------------------------------------------------------------
def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and (code is None or err["code"] == code)
    assert "Traceback" not in r.text and "/tandem/" not in r.text and len(r.content) < 4096
    return err


def test_inference_routes_need_the_api_key(live):
    for route, method in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, live.url + route, headers=headers, json={"prompt": "x"})
            assert assert_error(r, 401, code="invalid_api_key")["type"] == "authentication_error"


def test_a_body_over_one_mib_gets_413_before_parsing(client):
    r = client.post("/v1/completions", content=b"{" + b" " * (1 << 20) + b"}",
                    headers={"Content-Type": "application/json"})
    assert_error(r, 413)


BAD = [
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    ({"max_tokens": 4}, 400, "prompt", "invalid_value"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "x", "max_tokens": 10 ** 9}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ({"prompt": "x", "stop": [""]}, 400, "stop", "invalid_value"),
    ({"prompt": "x", "stop": 3}, 400, "stop", "invalid_value"),
    ({"prompt": "x", "n": 17}, 400, "n", "invalid_value"),
    ({"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ({"prompt": "x", "model": "../../etc/passwd"}, 404, "model", "model_not_found"),
    ({"prompt": "x", "method": "async"}, 400, "method", "unsupported_value"),
    # a name echoed in full made a 5 KB error body (found by the reliability harness): it is clipped
    ({"prompt": "x", "model": "m" * 5000}, 404, "model", "model_not_found"),
    ({"prompt": "x", "method": "m" * 5000}, 400, "method", "unsupported_value"),
    ({"prompt": "def " * 600}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"prompt": "x", "logprobs": 6}, 400, "logprobs", "invalid_value"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "unsupported_value"),
    ({"prompt": ""}, 400, "prompt", "invalid_value"),
]


@pytest.mark.parametrize("body,status,param,code", BAD)
def test_bad_completion_requests_get_openai_shaped_errors(client, live, body, status, param, code):
    if isinstance(body, bytes):
        r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post("/v1/completions", json=body)
    assert_error(r, status, param, code)


def test_bad_chat_requests_and_unknown_routes(client):
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}),
                 400, "messages")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 99}),
                 400, "n", "invalid_value")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "top_logprobs": 2}), 400, "top_logprobs")
    assert_error(client.get("/v1/nothing"), 404)


# ---- disconnects, overload, a dead engine -------------------------------------------------------------
def test_a_client_disconnect_mid_stream_aborts_and_frees_the_blocks(live):
    server = live.state
    aborted = server.metrics.requests.labels("aborted")._value.get()
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
                                                       "stream": True, "ignore_eos": True, "method": "tree"}) as r:
            lines = r.iter_lines()
            got = [ln for ln in (next(lines) for _ in range(4)) if ln.startswith("data: ")]
            assert got and any(e.requests for e in server.engines.values())
    t0 = time.monotonic()
    wait_clean(server, timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    assert server.metrics.requests.labels("aborted")._value.get() == aborted + 1
    complete(httpx.Client(base_url=live.url, headers=AUTH, timeout=60), prompt=PROMPTS[3])  # still serving


def test_a_full_queue_gets_503_with_retry_after_then_health_503_once_the_engine_is_gone(pair):
    s = make_server(pair, methods=("ar",), max_pending=1)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = r.iter_lines()  # NOTE: keep it: a dropped iterator closes the stream (a disconnect)
                assert next(lines).startswith("data: ")
                busy = c.post("/v1/completions", json=body)
                assert_error(busy, 503, code="server_busy")
                assert busy.headers["retry-after"] == "1"
            wait_clean(s.state)
            assert complete(c, prompt=PROMPTS[1])["choices"][0]["finish_reason"] in ("length", "stop")
            assert s.state.metrics.requests.labels("rejected")._value.get() == 1
            s.state.driver.stop()
            t0 = time.monotonic()
            assert_error(c.get("/health"), 503, code="engine_unavailable")
            assert_error(c.post("/v1/completions", json=body), 503, code="engine_unavailable")
            assert time.monotonic() - t0 < 1.0
    finally:
        s.stop()


@pytest.mark.parametrize("args,message", [(["--methods", "ar,warp"], "unknown method 'warp' in --methods"),
                                          (["--max-pending", "0"], "--max-pending must be >= 1"),
                                          (["--methods", "ar,ar"], "names a method twice"),
                                          (["--long-prefill-token-threshold", "-1"],
                                           "long_prefill_token_threshold must be >= 0"),
                                          (["--methods", ""], "serve at least one method"),
                                          (["--max-chunk-rate", "-5"], "--max-chunk-rate must be >= 0"),
                                          (["--methods", "ar", "--adaptive-draft"],
                                           "--adaptive-draft need a speculative method")])
def test_serve_cli_refuses_bad_flags_in_one_line(capsys, args, message):
    from tandem.cli import main

    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_serve_refuses_a_busy_port_and_an_unresolvable_host_in_one_line_before_loading(capsys, monkeypatch):
    import socket

    from tandem.cli import main
    from tandem.runtime import pair

    monkeypatch.setattr(pair, "load_pair", lambda *a, **k: pytest.fail("loaded the models before the address check"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err == (f"tandem: error: port {port} on 127.0.0.1 is in use; pick another with --port (0 picks a "
                       f"free one)\n")
    assert main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: --host 'no-such-host.invalid' does not resolve") and err.count("\n") == 1


def test_an_exception_in_an_engine_step_fails_its_requests_only_and_the_server_keeps_serving(live, client):
    engine = live.state.engines["tree"]
    real_step = engine.step

    def faulty_step():  # fault injection: the next tree step raises once
        engine.step = real_step
        raise RuntimeError("injected fault")

    engine.step = faulty_step
    try:
        r = client.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 8, "temperature": 0,
                                                 "method": "tree"})
    finally:
        engine.step = real_step
    err = assert_error(r, 500, code="engine_error")
    assert "injected" not in err["message"]  # the exception is logged, not sent
    wait_clean(live.state)
    assert httpx.get(live.url + "/health").status_code == 200
    for method in ("tree", "ar"):
        assert complete(client, prompt=PROMPTS[4], method=method)["usage"]["completion_tokens"] == 8


def test_batch_parallel_server_gives_the_solo_outputs(pair, solo):
    """`tandem serve --batch-parallel --row-selection`: concurrent requests on the tree engine (two
    batches alternating, one shared node budget) still return each prompt's solo greedy text, and
    the ar engine beside it runs plainly."""
    from concurrent.futures import ThreadPoolExecutor

    s = make_server(pair, engine={"batch_parallel": True, "row_selection": True}, methods=("tree", "ar"))
    try:
        assert s.state.engines["tree"].config.batch_parallel and not s.state.engines["ar"].config.batch_parallel
        with httpx.Client(base_url=s.url, timeout=60) as c, ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda p: complete(c, prompt=p, method="tree")["choices"][0]["text"],
                                 PROMPTS * 2))
        assert outs == [solo[p] for p in PROMPTS * 2]
        assert s.state.engines["tree"].counters.batch_parallel_steps > 0
        wait_clean(s.state)
    finally:
        s.stop()


def test_serve_refuses_batch_parallel_without_a_speculative_method(capsys):
    from tandem.cli import main

    assert main(["serve", "--methods", "ar", "--batch-parallel", "--port", "0"]) == 2
    assert "need a speculative method" in capsys.readouterr().err


# ---- shutdown ---------------------------------------------------------------------------------------
def stream_in_thread(url: str, body: dict, started: threading.Event, out: list) -> threading.Thread:
    """A streamed completion in a thread: `started` once its first chunk arrived; `out` gets the
    events (the last one `[DONE]`) or the transport error."""
    def go():
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            started.set()
                            out.append(line[len("data: "):])
        except httpx.HTTPError as e:
            out.append(e)
        finally:
            started.set()

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


def assert_stopped_clean(s: LiveServer) -> None:
    s.thread.join(30)
    assert not s.thread.is_alive() and not s.state.driver.thread.is_alive()
    for e in s.state.engines.values():
        assert not e.requests and not e.has_unfinished()
        assert e.pool.check() == [] and e.pool.num_free == e.pool.num_blocks and e.pool.seqs == {}
    with pytest.raises(httpx.ConnectError):  # no longer listening
        httpx.get(s.url + "/health", timeout=5)


def test_shutdown_lets_in_flight_requests_finish_and_stops_the_engine_clean(pair):
    s = make_server(pair, methods=("tree", "ar"))
    body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    runs = []
    for i, method in enumerate(("tree", "ar", "tree")):
        started, out = threading.Event(), []
        runs.append((stream_in_thread(s.url, {**body, "prompt": PROMPTS[i], "method": method}, started, out),
                     started, out))
    for _, started, _ in runs:
        assert started.wait(30)
    s.uvicorn.should_exit = True  # what uvicorn's SIGTERM handler sets
    for th, _, out in runs:
        th.join(60)
        assert out[-1] == "[DONE]", out[-3:]
        events = [json.loads(e) for e in out[:-1]]
        assert events[-1]["usage"]["completion_tokens"] == 16
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert s.state.metrics.requests.labels("completed")._value.get() == 3
    assert_stopped_clean(s)


def test_shutdown_past_the_grace_ends_in_flight_requests_with_a_clear_503(pair):
    s = make_server(pair, methods=("ar",), shutdown_grace_s=0.3)
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    started, out = threading.Event(), []
    th = stream_in_thread(s.url, body, started, out)
    plain: list = []
    pt = threading.Thread(target=lambda: plain.append(httpx.post(s.url + "/v1/completions", json=body, timeout=60)))
    pt.start()
    assert started.wait(30)
    while s.state.pending < 2:
        time.sleep(0.01)
    t0 = time.monotonic()
    s.uvicorn.should_exit = True
    th.join(30)
    pt.join(30)
    assert time.monotonic() - t0 < 5.0  # the grace, not the 400 tokens
    assert out[-1] == "[DONE]"
    err = json.loads(out[-2])["error"]
    assert err["code"] == "server_shutting_down" and "shutting down" in err["message"]
    assert_error(plain[0], 503, code="server_shutting_down")
    assert s.state.metrics.requests.labels("failed")._value.get() == 2
    assert_stopped_clean(s)


def test_sigterm_on_tandem_serve_drains_and_exits_by_the_signal():
    """The real process (tandem.serve.reliability.check_sigterm): `tandem serve` gets SIGTERM with
    two streams in flight; each stream ends with the 503 event and `[DONE]`, the app's shutdown
    completes with no traceback, and the process ends by SIGTERM (uvicorn re-raises the signal
    after a clean shutdown, so a supervisor sees why it stopped)."""
    from tandem.serve import reliability as rel

    res = rel.check_sigterm(max_tokens=400, grace_s=0.3)
    assert res.passed, (res.figure, res.details)
    assert "exit by SIGTERM after a clean shutdown: True" in res.figure
    assert res.figure.endswith("streams ended: 503 server_shutting_down, 503 server_shutting_down")


# ---- the official client ----------------------------------------------------------------------------
def test_the_official_openai_client_gets_a_completion_and_a_streamed_chat(live, client, solo):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = oc.completions.create(model="tandem", prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                extra_body={"method": "tree"})
    assert out.choices[0].text == solo[PROMPTS[2]] and out.usage.completion_tokens == 8
    messages = [{"role": "user", "content": "a loop"}]
    full = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 8})
    chunks = list(oc.chat.completions.create(model="tandem", messages=messages, max_tokens=8, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.json()["choices"][0]["message"]["content"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == full.json()["usage"]["completion_tokens"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_stream_behind_the_engine_gets_its_queued_deltas_as_one():
    """RequestHandle.next_merged joins the Deltas queued behind the first (token ids and logprobs
    in order) and leaves the end event for the next call."""
    import asyncio

    from tandem.serve.app import RequestHandle
    from tandem.serve.driver import Delta, Failed

    class NoGap:  # (the server's one method a handle reads: no pacing)
        def chunk_gap(self):
            return 0.0

    async def go():
        h = RequestHandle(NoGap(), "r")
        for ev in (Delta([1], ["a"]), Delta([2, 3], ["b", "c"]), Failed("gone"), Delta([9], ["z"])):
            h.queue.put_nowait(ev)
        first = await h.next_merged()
        end = await h.next_merged()
        return first, end, h.done, h.queue.qsize()

    first, end, done, left = asyncio.run(go())
    assert first == Delta([1, 2, 3], ["a", "b", "c"]) and end == Failed("gone") and done and left == 1


def test_a_paced_stream_joins_the_steps_between_its_chunks_and_never_holds_its_end():
    """With a chunk gap (Server.chunk_gap: the open streams share --max-chunk-rate) a stream's
    Delta waits until the gap has passed since its last chunk, joining the Deltas that come
    meanwhile; the request's end cuts the wait short (the last tokens go out at once)."""
    import asyncio
    import time as clock

    from tandem.serve.app import RequestHandle
    from tandem.serve.driver import Delta, Failed

    class Gap:
        def chunk_gap(self):
            return 0.2

    async def go(end: bool):
        loop = asyncio.get_running_loop()
        h = RequestHandle(Gap(), "r")
        h.put(Delta([1], None))
        t0 = clock.monotonic()
        first = await h.next_merged()  # (no chunk before: at once)
        loop.call_later(0.02, h.put, Delta([2], None))
        loop.call_later(0.04, h.put, Failed("gone") if end else Delta([3], None))
        second = await h.next_merged()
        return first, second, clock.monotonic() - t0, h.queue.qsize() + (h._held is not None)

    first, second, took, left = asyncio.run(go(end=False))
    assert first == Delta([1], None) and second == Delta([2, 3], None) and took >= 0.19 and left == 0
    first, second, took, left = asyncio.run(go(end=True))
    assert first == Delta([1], None) and second == Delta([2], None) and took < 0.15 and left == 1


# ---- the OpenAI surface, as clients written for OpenAI and vLLM use it -------------------------------
ACCENTS = "# é è ê ë é è ê ë é è ê ë é è"  # the bundled model continues it with split characters


def test_logprobs_of_tokens_inside_a_character_carry_their_own_bytes(client):
    """The bundled tokenizer splits "é" into two byte tokens, each of which decodes alone to U+FFFD:
    keyed by that text, a token's top-5 entries overwrote each other and its own logprob was
    replaced by another's. Each token now shows its bytes ("bytes:\\xc3" where they are not UTF-8
    alone), chat's `bytes` are the token's real bytes (they join to the text), and each offset is
    where the token's character starts in the text."""
    out = complete(client, prompt=ACCENTS, max_tokens=12, logprobs=5, method="ar")
    text, lp = out["choices"][0]["text"], out["choices"][0]["logprobs"]
    assert any(t.startswith("bytes:") for t in lp["tokens"]), lp["tokens"]  # (the case under test happened)
    for tok, own, top, at in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]):
        assert len(top) == 5 and top[tok] == pytest.approx(own, abs=1e-5) and own == max(top.values())
        if tok.startswith("bytes:"):  # a byte of the character at `at`
            raw = bytes(int(h, 16) for h in tok[len("bytes:"):].split("\\x")[1:])
            assert raw in text[at].encode("utf-8")
        else:
            assert text[at:at + len(tok)] == tok
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ACCENTS}], "max_tokens": 12,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 3})
    ch = r.json()["choices"][0]
    content = ch["logprobs"]["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == ch["message"]["content"].encode("utf-8")
    assert all(len({e["token"] for e in c["top_logprobs"]}) == 3 for c in content)


def test_prompt_plus_max_tokens_over_the_context_window_is_refused_as_vllm_does(client, live):
    ctx = live.state.context_window
    ids = [300] * (ctx - 100)
    err = assert_error(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 101}), 400, "max_tokens",
                       "context_length_exceeded")
    assert f"lower max_tokens to at most 100" in err["message"] and str(ctx) in err["message"]
    assert complete(client, prompt=ids, max_tokens=100, ignore_eos=True)["usage"]["completion_tokens"] == 100
    msg = [{"role": "user", "content": "hi"}]
    err = assert_error(client.post("/v1/chat/completions", json={"messages": msg, "max_completion_tokens": 0}), 400,
                       "max_completion_tokens", "invalid_value")  # (the field the client sent, not max_tokens)
    assert err["message"].startswith("max_completion_tokens must be in 1..")


@pytest.mark.parametrize("field,value", [("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2), ("min_tokens", 10),
                                         ("stop_token_ids", [1]), ("response_format", {"type": "json_object"}),
                                         ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("tool_choice", "required"), ("guided_json", {"type": "object"}),
                                         ("use_beam_search", True)])
def test_fields_the_server_does_not_implement_are_refused_unless_neutral(client, field, value):
    """vLLM's sampling extensions, tools and structured output would change the output: a value
    other than the neutral one gets 400 naming the field (they were silently ignored)."""
    for route, body in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        err = assert_error(client.post(route, json={**body, "max_tokens": 2, field: value}), 400, field,
                           "unsupported_value")
        assert err["message"].startswith(f"{field} is not supported")


def test_neutral_values_nulls_and_unknown_fields_pass(client, live, caplog):
    """Neutral values of the refused fields pass, null means the default for the fields OpenAI
    types "X or null", and a field no one defines is ignored with one warning in the log."""
    ref = complete(client, prompt=PROMPTS[3])["choices"][0]["text"]
    extras = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1, "response_format": {"type": "text"},
              "tool_choice": "none", "skip_special_tokens": True, "n": None, "top_p": None, "stream": None,
              "presence_penalty": None, "frequency_penalty": None, "echo": None, "logprobs": None,
              "my_custom_field": 1}
    with caplog.at_level("WARNING", logger="tandem.serve"):
        assert complete(client, prompt=PROMPTS[3], **extras)["choices"][0]["text"] == ref
        complete(client, prompt=PROMPTS[3], my_custom_field=2)
    warned = [r.getMessage() for r in caplog.records if "my_custom_field" in r.getMessage()]
    assert len(warned) == 1 and "ignoring request field(s)" in warned[0]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                  "temperature": None, "logprobs": None, "stream": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route,body,param,words", [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature",
     "invalid field temperature: Input should be a valid number"),
    ("/v1/completions", {"prompt": 5}, "prompt", "must be a string, a list of token ids, or a list of one of those"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "stop", "must be a string or a list of strings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "only text content parts are supported (got 'image_url')"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages", "tool calls are not supported"),
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt", "lone UTF-16 surrogate (\\ud800) at character 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages",
     "lone UTF-16 surrogate"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed with stream: true"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usag": True}}, "stream_options",
     "Extra inputs are not permitted"),
])
def test_bad_fields_get_a_message_about_the_field(client, route, body, param, words):
    raw = json.dumps({"max_tokens": 2, **body})  # (ASCII escapes: "\ud800" as JSON carries it)
    err = assert_error(client.post(route, content=raw, headers={"Content-Type": "application/json"}), 400, param)
    assert words in err["message"], err["message"]


def test_a_tiny_temperature_or_top_p_is_the_greedy_output_not_a_500(client):
    greedy = complete(client, prompt=PROMPTS[4])["choices"][0]["text"]
    for extra in ({"temperature": 1e-38}, {"temperature": 1.0, "top_p": 1e-46}):
        for method in ("ar", "tree"):
            assert complete(client, prompt=PROMPTS[4], method=method, **extra)["choices"][0]["text"] == greedy


def test_a_chat_stream_starts_with_the_role_and_usage_is_null_until_the_last_chunk(client):
    """The role comes first, in a chunk of its own, even for an output stopped at once; with
    include_usage every other chunk carries "usage": null (OpenAI's shape)."""
    msg = [{"role": "user", "content": "hi"}]
    for stop, usage in (("#", True), ("@@never@@", False)):
        body = {"messages": msg, "max_tokens": 6, "temperature": 0, "stream": True, "stop": stop,
                "stream_options": {"include_usage": usage}}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = sse_events(r)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in e["choices"][0]["delta"] for e in events[1:] if e["choices"])
        if usage:
            assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] >= 0
        else:
            assert all("usage" not in e for e in events)


def test_a_model_is_retrieved_by_its_id(client):
    card = client.get("/v1/models/tandem").json()
    assert card["id"] == "tandem" and card["object"] == "model"
    err = assert_error(client.get("/v1/models/gpt-9"), 404, "model", "model_not_found")
    assert err["type"] == "invalid_request_error"


def test_chat_add_generation_prompt_and_template_kwargs(client, live, pair):
    """vLLM's chat extensions: add_generation_prompt false leaves the assistant's turn out of the
    prompt; chat_template_kwargs reach the template as variables (never replacing its own)."""
    msg = [{"role": "user", "content": "fib please"}]
    r = client.post("/v1/chat/completions", json={"messages": msg, "max_tokens": 6, "temperature": 0,
                                                  "add_generation_prompt": False})
    text = live.state.chat_template.render(msg, add_generation_prompt=False)
    assert text == "# user: fib please\n"
    ref = complete(client, prompt=pair.tokenizer.encode(text, add_special_tokens=False).ids, max_tokens=6)
    assert r.json()["choices"][0]["message"]["content"] == ref["choices"][0]["text"]
    t = ChatTemplate("{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}")
    assert t.render(msg, extra={"enable_thinking": True}) == "<think>fib please"
    assert t.render(msg, extra={"enable_thinking": False, "messages": []}) == "fib please"


def test_logprob_offsets_index_the_decoded_text(pair):
    """LogprobFormat on its own: over split characters and a closing EOS (which the text leaves
    out), each offset is where its token's character starts in the decoded text."""
    from tandem.serve.logprobs import LogprobFormat, TokenLogprob

    tok = pair.tokenizer
    eos = pair.target.config.eos_token_ids[0]
    ids = tok.encode("x = 'é€' # ok").ids + [eos]
    text = tok.decode(ids)
    lp = LogprobFormat(tok).completion([TokenLogprob(t, -1.0, ((t, -1.0),)) for t in ids])
    assert lp["tokens"][-1] == tok.id_to_token(eos) and lp["text_offset"][-1] == len(text)
    for s, at in zip(lp["tokens"][:-1], lp["text_offset"]):
        if s.startswith("bytes:"):
            assert text[at] in "é€"
        else:
            assert text[at:at + len(s)] == s
    assert [list(t)[0] for t in lp["top_logprobs"]] == lp["tokens"]


def test_n_choices_each_sample_with_its_own_seed(client):
    """n > 1 (pass@k harnesses send it): n requests, choice i sampling with seed + i, so choice i
    equals an n = 1 request with that seed; greedy choices are all alike; usage counts the prompt
    once; a stream interleaves the choices by index, each with its role and finish chunk."""
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.5, "seed": 11, "ignore_eos": True}
    out = client.post("/v1/completions", json={**body, "n": 3}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for i, c in enumerate(out["choices"]):
        assert c["text"] == complete(client, **{**body, "seed": 11 + i})["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 18 and out["usage"]["prompt_tokens"] == complete(
        client, **body)["usage"]["prompt_tokens"]
    greedy = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
                                                  "n": 2}).json()["choices"]
    assert greedy[0]["text"] == greedy[1]["text"]
    msg = {"messages": [{"role": "user", "content": "a loop"}], "max_tokens": 6, "temperature": 1.5, "seed": 5,
           "ignore_eos": True}
    full = client.post("/v1/chat/completions", json={**msg, "n": 2}).json()
    with client.stream("POST", "/v1/chat/completions",
                       json={**msg, "n": 2, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    roles = [e["choices"][0]["index"] for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1]
    for i in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == full["choices"][i]["message"]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 12 == full["usage"]["completion_tokens"]


def test_the_sampled_token_is_in_its_top_logprobs_and_choices_carry_the_stop_reason(client):
    """OpenAI's legacy logprobs give up to logprobs + 1 entries: the sampled token always among
    them (a harness reads top_logprobs[i][tokens[i]]); vLLM's stop_reason names the stop string
    that ended a choice (null for an EOS or a length end)."""
    out = complete(client, prompt=PROMPTS[0], max_tokens=8, temperature=1.5, seed=3, logprobs=0, ignore_eos=True)
    lp = out["choices"][0]["logprobs"]
    assert all(top == {tok: own} for tok, own, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    assert out["choices"][0]["stop_reason"] is None and out["choices"][0]["finish_reason"] == "length"
    text = complete(client, prompt=PROMPTS[0], max_tokens=12)["choices"][0]["text"]
    stop = text[4:7]
    cut = complete(client, prompt=PROMPTS[0], max_tokens=12, stop=["@@never@@", stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 12,
                                                  "temperature": 0, "stop": [stop]})
    ch = r.json()["choices"][0]
    assert ch["stop_reason"] == (stop if ch["finish_reason"] == "stop" else None)


def test_a_server_without_methods_serves_tree_first_on_a_gpu_and_ar_first_on_the_cpu():
    from tandem.serve.config import default_methods

    assert default_methods(None, None, "cuda") == ("tree", "ar")
    assert default_methods(None, None, "cpu") == ("ar", "tree")
    assert default_methods("t", "d", "cpu") == default_methods(None, "d", "cpu") == ("tree", "ar")  # (a draft given)
    assert default_methods("t", None, "cuda") == ("ar",)
