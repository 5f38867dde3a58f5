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


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "1,zero"], "--concurrency takes integers"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--request-rate", "-1"], "--request-rate must be > 0"),
    (["--url", "http://10.1.2.3:8000"], "is not loopback; pass --allow-remote"),
    (["--api-key", "k"], "--api-key goes with --url"),
    (["--methods", "hf"], "--online serves ar, chain, tree"),
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
    md = (out / "results.md").read_text()
    assert md.count("\n| tree |") == 2 and "TTFT p50/p99 ms" in md
    assert "results.md" in res["files"] and ("online_latency.png" not in res["files"]
                                              or (out / "online_latency.png").stat().st_size > 0)
    assert "| ar | 3 | 3 | 0 |" in capsys.readouterr().out


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
