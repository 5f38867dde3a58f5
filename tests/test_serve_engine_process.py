"""`tandem serve --engine-process`: the engines in a process of their own (spawned), the server
process keeping the routes and the streams. A real server on loopback, the bundled pair."""
from __future__ import annotations

import json
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_serve import PROMPTS, LiveServer, sse_events, solo  # noqa: E402,F401
from tandem.config import ConfigError  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.runtime.pair import BUNDLED_TARGET, bundled_available, load_pair  # noqa: E402
from tandem.serve.chat_template import ChatTemplate  # noqa: E402
from tandem.serve.config import ServerConfig  # noqa: E402
from tandem.serve.driver import KILL_USER  # noqa: E402

if not bundled_available():
    pytest.skip("the bundled pair is not in this checkout", allow_module_level=True)


def process_server(**config):
    from tandem.models.loader import load_tokenizer
    from tandem.serve.app import Server
    from tandem.serve.engine_process import EngineSpec

    cfg = ServerConfig(**{"methods": ("tree", "ar"), **config})
    ecfg = EngineConfig(num_blocks=256, max_num_seqs=8, debug_check=True)
    spec = EngineSpec(None, None, "cpu", "float32", cfg.methods, ecfg, cfg.inject_faults)
    return LiveServer(Server(None, None, load_tokenizer(BUNDLED_TARGET), cfg, ecfg,
                             ChatTemplate.for_checkpoint(BUNDLED_TARGET), engine_process=spec))


@pytest.fixture(scope="module")
def pair():
    return load_pair(None, None, "cpu", "float32")


@pytest.fixture(scope="module")
def live():
    s = process_server()
    yield s
    s.stop()


def test_outputs_streams_and_metrics_come_through_the_engine_process(live, solo):
    """Greedy texts (tree and ar, streamed and not, 8 requests at once) equal the single-request
    loop's; the stream's deltas join to the text with one finish_reason; /metrics counts the
    engine process's tokens and steps; this process holds no model."""
    import concurrent.futures as cf

    assert live.state.engines == {} and live.state.driver.process.is_alive()

    def one(i):
        body = {"model": "tandem", "prompt": PROMPTS[i], "max_tokens": 8, "temperature": 0,
                "method": ("tree", "ar")[i % 2]}
        with httpx.Client(base_url=live.url, timeout=120) as c:
            if i % 4 < 2:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]
            with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                ev = sse_events(r)
            text = "".join(e["choices"][0]["text"] for e in ev if e["choices"])
            assert [e["choices"][0]["finish_reason"] for e in ev if e["choices"]][-1] == "length"
            assert sum(1 for e in ev if e["choices"] and e["choices"][0]["finish_reason"]) == 1
            return text, ev[-1]["usage"]["completion_tokens"]

    with cf.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(8)))
    assert [t for t, _ in outs] == [solo[p] for p in PROMPTS]
    metrics = httpx.get(f"{live.url}/metrics").text
    gen = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("tandem_generation_tokens_total"))
    assert gen >= sum(n for _, n in outs) and 'tandem_steps_total{method="tree",speculative="true"}' in metrics
    assert "tandem_engine_alive 1.0" in metrics


def test_a_dead_engine_process_loop_fails_health_and_new_requests_cleanly():
    """The engine loop stopped (an injected fault) -> /health 503 within a second, a new request
    gets an OpenAI-shaped 503, and stopping the server ends the engine process."""
    s = process_server(inject_faults=True)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "user": KILL_USER})
            assert r.status_code in (400, 500, 503)
            deadline = time.monotonic() + 1.0
            while c.get("/health").status_code != 503:
                assert time.monotonic() < deadline, "/health still 200"
                time.sleep(0.02)
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        s.stop()
    s.state.driver.process.join(10)
    assert not s.state.driver.process.is_alive()


def test_stopping_the_server_ends_in_flight_streams_with_503_and_the_process_exits():
    """The server's shutdown path stops the engine process: a stream still running ends with the
    server_shutting_down error event and [DONE], and the process exits cleanly."""
    s = process_server()
    with httpx.Client(base_url=s.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
                                                      "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            s.state.driver.stop()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
    s.stop()
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "server_shutting_down"
    assert s.state.driver.process.exitcode == 0


def test_an_engine_process_that_cannot_build_its_engines_is_one_clear_error(tmp_path):
    from tandem.models.loader import load_tokenizer
    from tandem.serve.app import Server
    from tandem.serve.engine_process import EngineSpec

    cfg = ServerConfig(methods=("tree",))
    spec = EngineSpec(None, str(tmp_path / "nowhere"), "cpu", "float32", cfg.methods, EngineConfig())
    with pytest.raises(ConfigError, match="the engine process could not start: .*nowhere"):
        Server(None, None, load_tokenizer(BUNDLED_TARGET), cfg, EngineConfig(), engine_process=spec)


def test_the_engine_processs_metric_calls_replay_on_the_servers_registry():
    """Counters and histograms are replayed call for call; a gauge is sent when it changed only
    (an idle engine loop sends nothing)."""
    from tandem.serve.engine_process import _Recorder, replay
    from tandem.serve.metrics import ServerMetrics

    rec, m = _Recorder(), ServerMetrics()
    rec.generation_tokens.inc(5)
    rec.steps.labels("tree", "true").inc()
    rec.tau.labels("tree").observe(3.5)
    rec.kv_blocks.labels("tree").set(7)
    rec.kv_blocks.labels("tree").set(9)
    replay(m, rec.take())
    rec.kv_blocks.labels("tree").set(9)
    assert rec.take() == []  # unchanged gauge: nothing to send
    text = m.render().decode()
    assert "tandem_generation_tokens_total 5.0" in text and 'tandem_kv_blocks_in_use{method="tree"} 9.0' in text
    assert 'tandem_steps_total{method="tree",speculative="true"} 1.0' in text
    assert 'tandem_request_tau_count{method="tree"} 1.0' in text


def test_a_client_that_disconnects_mid_stream_frees_its_blocks_in_the_engine_process(live):
    """The disconnect aborts the request in the engine process within a second: its pool report
    (taken there between two steps) shows no request, no open sequence, every block free and no
    problem from check()."""
    with httpx.Client(base_url=live.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0,
                                                      "stream": True, "ignore_eos": True, "method": "tree"}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            busy = live.state.driver.pools().result(10)
            assert busy["tree"]["requests"] == 1 and busy["tree"]["free"] < busy["tree"]["blocks"]
    deadline = time.monotonic() + 1.0
    while True:
        report = live.state.driver.pools().result(10)
        if all(p["requests"] == 0 for p in report.values()):
            break
        assert time.monotonic() < deadline, report
        time.sleep(0.02)
    for p in report.values():
        assert p["problems"] == [] and p["free"] == p["blocks"] and p["sequences"] == 0


def test_a_wrong_target_folder_gets_the_same_error_with_or_without_an_engine_process(tmp_path):
    """--engine-process loads no model in the server process, yet a wrong --target is refused
    there, before any process starts, with the message the in-process server gives."""
    import argparse

    from tandem.serve.cli import process_server

    args = argparse.Namespace(target=str(tmp_path / "nowhere"), draft=None, device="cpu", dtype="float32")
    with pytest.raises(ConfigError) as e:
        process_server(args, ServerConfig(methods=("ar",)), EngineConfig())
    with pytest.raises(ConfigError) as same:
        load_pair(str(tmp_path / "nowhere"), None, "cpu", "float32", need_draft=False)
    assert str(e.value) == str(same.value) and "does not exist" in str(e.value)


def test_a_stream_gives_back_its_place_before_its_last_write():
    """8 clients streaming back to back on a server admitting 8 (the reliability soak's shape) all
    get in: a stream gives back its place in the bounded queue before its last write. After it,
    a client's next request on its keep-alive connection could arrive while the place was still
    held (server_busy for 18 of 298 requests in a 40 s soak here; 90 of 1,084 in the full run)."""
    from concurrent.futures import ThreadPoolExecutor

    s = process_server(max_pending=8)

    def client(k: int) -> list:
        statuses = []
        with httpx.Client(base_url=s.url, timeout=120) as c:  # (one keep-alive connection, as the soak's)
            for i in range(24):
                body = {"prompt": PROMPTS[(k + i) % len(PROMPTS)], "max_tokens": 16, "temperature": 0,
                        "stream": True, "method": "tree"}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    code = r.status_code
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                    statuses.append(code if code != 200 or lines[-1] == "data: [DONE]" else "no [DONE]")
        return statuses

    try:
        with ThreadPoolExecutor(8) as ex:
            statuses = [st for sts in ex.map(client, range(8)) for st in sts]
        assert statuses == [200] * 192, [st for st in statuses if st != 200]
    finally:
        s.stop()
