"""`tandem bench --online`: the in-process server on 127.0.0.1 loaded over loopback; bounded counts,
the figures in results.json / results.md / PNG; bad flags refused in one line."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from tandem.bench.online import Load, Sample, parse_levels, pct, run_level, summarize  # noqa: E402
from tandem.config import ConfigError  # noqa: E402
from tandem.runtime.pair import bundled_available  # noqa: E402

PROMPTS = ["def fib(n):", "import os\n", "class Stack:"]


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(path)


def test_percentiles_and_summary_count_errors_and_skips():
    assert pct([], 50) is None and pct([3.0, 1.0, 2.0], 50) == 2.0 and pct([1.0, 2.0, 3.0], 99) == 3.0
    samples = [Sample(ttft=0.1, e2e=0.5, tokens=8, itl=(0.05, 0.07)), Sample(ttft=0.3, e2e=0.9, tokens=4, itl=(0.2,)),
               Sample(error="HTTP 503"), Sample(error="HTTP 503"), None]
    lv = summarize("tree", 4, None, samples, wall=2.0)
    assert (lv.sent, lv.completed, lv.skipped, lv.errors) == (4, 2, 1, {"HTTP 503": 2})
    assert lv.requests_per_s == 1.0 and lv.output_tokens_per_s == 6.0
    assert lv.ttft_ms == {"p50": 100.0, "p99": 300.0} and lv.e2e_ms == {"p50": 500.0, "p99": 900.0}
    assert lv.itl_ms["p50"] == 70.0 and lv.itl_ms["p99"] == 200.0


def test_concurrency_levels_parse_from_any_registration():
    assert parse_levels(None) == [1, 4, 8] and parse_levels("1,8,32") == [1, 8, 32] and parse_levels(16) == [16]
    assert parse_levels([2, 4]) == [2, 4]
    for bad, msg in (("1,x", "takes integers"), ("0", ">= 1"), ("", ">= 1")):
        with pytest.raises(ConfigError, match=msg):
            parse_levels(bad)


def test_an_unreachable_server_is_counted_as_errors_not_raised():
    # port 9 (discard) on loopback: nothing listens in the test environment
    load = Load("http://127.0.0.1:9", None, max_tokens=4, requests=3, max_seconds=5, request_rate=None)
    lv = asyncio.run(run_level(load, PROMPTS, "ar", 2))
    assert lv.completed == 0 and lv.sent == 3 and sum(lv.errors.values()) == 3 and lv.ttft_ms["p50"] is None


def test_a_chunk_of_k_tokens_counts_k_inter_token_gaps():
    """The tally reads each chunk's running usage: k tokens in a chunk share its gap (1/k each);
    a chunk without text adds nothing until text comes; the first chunk's time is the TTFT."""
    from tandem.bench.online import _Tally

    def ev(text, n, finish=None):
        return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}],
                           "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}}).encode()

    t = _Tally(t0=10.0)
    for data, now in ((ev("a", 1), 10.5), (ev("bcd", 4), 10.8), (ev("", 5), 10.9), (ev("ef", 6), 11.2),
                      (ev("", 6, "length"), 11.3), (b'{"choices": [], "usage": {"completion_tokens": 6}}', 11.3),
                      (b"[DONE]", 11.3)):
        t.event(data, now)
    s = t.sample(end=11.4)
    assert t.done and s.tokens == 6 and s.chunks == 3 and s.error is None
    assert s.ttft == pytest.approx(0.5) and s.e2e == pytest.approx(1.4)
    assert s.itl == pytest.approx((0.1, 0.1, 0.1, 0.2, 0.2))  # 3 tokens over 0.3 s, then 2 over 0.4 s
    bare = _Tally(t0=0.0)  # a server that sends usage only at the end: one token per text chunk
    for data, now in ((b'{"choices": [{"text": "a"}]}', 1.0), (b'{"choices": [{"text": "bc"}]}', 1.5)):
        bare.event(data, now)
    assert bare.sample(end=2.0).itl == (0.5,)


def test_the_client_parses_chunked_sse_split_anywhere_keeps_alive_and_counts_failures():
    """A hand-written HTTP/1.1 server: a chunked SSE body sent a few bytes at a time (the framing
    and the events split at arbitrary points), a second request on the same connection, a 503
    with a length-delimited body, and a stream cut before [DONE]."""
    from tandem.bench.online import Client

    events = [{"choices": [{"text": "ab"}], "usage": {"completion_tokens": 1}},
              {"choices": [{"text": "c"}], "usage": {"completion_tokens": 3}},
              {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 3}},
              {"choices": [], "usage": {"completion_tokens": 3}}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 50]), body[i:i + 50]) for i in range(0, len(body), 50))
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunked
    replies = [ok + b"0\r\n\r\n", ok + b"0\r\n\r\n",
               b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 9\r\nconnection: close\r\n\r\n{\"e\": 1}\n",
               ok[:-len(chunked)] + chunked[:len(chunked) // 2]]
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        while replies:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            assert json.loads(await reader.readexactly(length))["stream"] is True
            reply = replies.pop(0)
            for i in range(0, len(reply), 7):  # a few bytes a write
                writer.write(reply[i:i + 7])
                await writer.drain()
                await asyncio.sleep(0)
            if b"503" in reply[:12] or not replies:
                break
        writer.close()

    async def go():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = Client(f"http://127.0.0.1:{port}", "k", timeout=10)
        out = [await client.stream({"prompt": "x", "stream": True}) for _ in range(4)]
        client.close()
        server.close()
        return out

    first, second, busy, cut = asyncio.run(go())
    for s in (first, second):
        assert s.error is None and s.tokens == 3 and s.chunks == 2 and len(s.itl) == 2
    assert busy.error == "HTTP 503" and cut.error == "RemoteProtocolError"
    assert len(connections) == 2  # the first two on one kept-alive connection, the rest on a second


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "1,zero"], "--concurrency takes integers"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--request-rate", "-1"], "--request-rate must be > 0"),
    (["--url", "http://10.1.2.3:8000"], "is not loopback; pass --allow-remote"),
    (["--api-key", "k"], "--api-key goes with --url"),
    (["--methods", "hf"], "--online serves ar, chain, tree"),
    (["--methods", "ar", "--long-prefill-token-threshold", "-1"], "long_prefill_token_threshold must be >= 0"),
])
def test_bad_online_flags_get_one_line_and_status_2(capsys, tmp_path, workload, args, message):
    from tandem.cli import main

    assert main(["bench", "--online", "--workload", workload, "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.skipif(not bundled_available(), reason="the bundled pair is not in this checkout")
def test_bench_online_loads_the_in_process_server_and_writes_its_report(tmp_path, workload, capsys):
    from tandem.cli import main

    out = tmp_path / "o"
    assert main(["bench", "--online", "--workload", workload, "--num-prompts", "3", "--methods", "ar,tree",
                 "--concurrency", "1,3", "--requests", "3", "--max-new-tokens", "6", "--ignore-eos",
                 "--request-rate", "50", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["concurrency"] == [1, 3] and res["config"]["request_rate"] == 50.0
    assert [(r["method"], r["concurrency"]) for r in res["levels"]] == [("ar", 1), ("ar", 3), ("tree", 1), ("tree", 3)]
    for r in res["levels"]:
        assert r["completed"] == r["sent"] == 3 and r["errors"] == {} and r["skipped"] == 0
        assert r["output_tokens_per_s"] == pytest.approx(3 * 6 / r["wall_s"], rel=0.01)  # exact counts (ignore_eos)
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert r["itl_ms"]["p50"] is not None and r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
        # the served engine's own steps over the level (the server's step histogram): `ar` makes a token a
        # request a step, so 3 requests of 6 tokens take 18 steps one at a time and at least 6 together
        steps = r["engine_steps_per_s"] * r["wall_s"]
        assert steps >= (18 / r["concurrency"] if r["method"] == "ar" else 1) - 0.5, (r["method"], steps)
        assert 0 < r["engine_step_ms"] and 0 < r["engine_busy"] <= 1
    md = (out / "results.md").read_text()
    assert md.count("\n| tree |") == 2 and "TTFT p50/p99 ms" in md
    assert "results.md" in res["files"] and ("online_latency.png" not in res["files"]
                                              or (out / "online_latency.png").stat().st_size > 0)
    assert "| ar | 3 | 3 | 0 |" in capsys.readouterr().out


@pytest.mark.skipif(not bundled_available(), reason="the bundled pair is not in this checkout")
def test_default_beside_named_methods_sends_no_method_field(tmp_path, workload):
    """--methods default,ar against a running server: `default` requests carry no method (the
    server's own, tree here), the ar ones name it; none fails."""
    from tandem.bench.online import LocalServer
    from tandem.cli import main
    from tandem.engine.config import EngineConfig
    from tandem.runtime.pair import load_pair
    from tandem.serve.app import Server
    from tandem.serve.config import ServerConfig

    pair = load_pair(None, None, "cpu", "float32")
    with LocalServer(Server(pair.target, pair.draft, pair.tokenizer, ServerConfig(methods=("tree", "ar")),
                            EngineConfig(num_blocks=64))) as s:
        out = tmp_path / "o"
        assert main(["bench", "--online", "--url", s.url, "--methods", "default,ar", "--workload", workload,
                     "--num-prompts", "2", "--concurrency", "1", "--requests", "2", "--max-new-tokens", "4",
                     "--no-plots", "--out", str(out)]) == 0
        served = s.state.metrics.tau  # (per method: the default's requests ran as tree)
        assert {m for m in ("tree", "ar") if served.labels(m)._sum.get() > 0} == {"tree", "ar"}
    res = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["completed"], r["errors"]) for r in res["levels"]] == [("default", 2, {}), ("ar", 2, {})]


@pytest.mark.skipif(not bundled_available(), reason="the bundled pair is not in this checkout")
def test_a_max_seconds_bound_skips_the_requests_not_started():
    """A deadline shorter than one request: the first runs, the rest are skipped, not sent; the
    server stops with its engine thread."""
    from tandem.bench.online import LocalServer
    from tandem.engine.config import EngineConfig
    from tandem.runtime.pair import load_pair
    from tandem.serve.app import Server
    from tandem.serve.config import ServerConfig

    pair = load_pair(None, None, "cpu", "float32", need_draft=False)
    with LocalServer(Server(pair.target, None, pair.tokenizer, ServerConfig(methods=("ar",)),
                            EngineConfig(num_blocks=64))) as s:
        load = Load(s.url, None, max_tokens=64, requests=4, max_seconds=0.05, request_rate=None, ignore_eos=True)
        lv = asyncio.run(run_level(load, PROMPTS, "ar", 1))
    assert (lv.sent, lv.completed, lv.skipped) == (1, 1, 3)
    assert not s.thread.is_alive() and not s.state.driver.thread.is_alive()
