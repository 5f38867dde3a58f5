"""`tandem bench`: outputs and their documented keys, the ar check (planted divergence), statistics, workloads.

The harness runs on the bundled pair when it exists, else on a tiny random pair (draft = target,
so speculation accepts a lot and the commit path is exercised). The planted-divergence test
always uses the tiny pair: it monkeypatches `Generator.generate` to perturb one token of one
method's output, so the harness's real checking code must find it.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tandem import cli
from tandem.bench import harness, stats, workloads
from tandem.config import ConfigError
from tandem.runtime.generate import Generator
from tandem.runtime.pair import bundled_available

RESULT_KEYS = {"environment", "config", "prompts", "requests", "summary", "speedup", "check", "tau_by_nodes", "files"}
REQUEST_KEYS = {"method", "prompt_index", "token_ids", "new_tokens", "seconds", "ttft", "decode_tokens_per_s",
                "tokens_per_s", "tau", "target_passes", "accept_lengths", "per_depth", "finish_reason"}
SUMMARY_KEYS = {"requests", "new_tokens", "decode_tokens_per_s", "tokens_per_s", "ttft_s", "tau", "tau_per_request",
                "accept_length_hist", "per_depth"}
ENV_KEYS = {"device", "gpu", "torch", "transformers", "git_commit", "date", "command"}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    from conftest import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("pair") / "target", "llama_untied", seed=0)


def _pair_args(tiny: Path, prefer_bundled: bool) -> list[str]:
    if prefer_bundled and bundled_available():
        return []
    return ["--target", str(tiny), "--draft", str(tiny)]


def _prompts_file(tmp_path: Path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"id": "add", "prompt": "def add(a, b):\n"}) + "\n"
                 + json.dumps({"id": "stack", "prompt": "class Stack:\n    def push(self, x):\n"}) + "\n")
    return f


def test_bench_writes_results(tiny_pair, tmp_path, capsys):
    out = tmp_path / "out"
    # NOTE: a JSONL workload, so the README's test command passes without ../shared; the dataset
    # formats themselves are tested below against ../shared/datasets where it exists (CI).
    rc = cli.main(["bench", *_pair_args(tiny_pair, prefer_bundled=True), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "2",
                   "--max-new-tokens", "16", "--methods", "ar,chain,tree", "--nodes", "4,8", "--k", "3",
                   "--max-prompt-tokens", "48", "--warmup", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert RESULT_KEYS <= set(res)
    assert ENV_KEYS <= set(res["environment"])
    assert res["config"]["methods"] == ["ar", "chain", "tree@4", "tree@8"]
    assert len(res["prompts"]) == 2 and all(p["prompt_tokens"] <= 48 for p in res["prompts"])
    assert len(res["requests"]) == 2 * 4
    for r in res["requests"]:
        assert REQUEST_KEYS <= set(r)
        assert r["new_tokens"] == len(r["token_ids"]) and 1 <= r["new_tokens"] <= 16
    for name in ("ar", "chain", "tree@4", "tree@8"):
        s = res["summary"][name]
        assert SUMMARY_KEYS <= set(s)
        assert {"mean", "median", "p5", "p95"} <= set(s["decode_tokens_per_s"])
        assert s["tau"] >= 1.0
    assert res["summary"]["ar"]["tau"] == 1.0
    vs_ar = res["speedup"]["vs_ar"]
    assert set(vs_ar) == {"chain", "tree@4", "tree@8"}
    for v in vs_ar.values():
        lo, hi = v["ci95"]
        assert v["n"] == 2 and lo <= v["geomean"] <= hi
    assert set(res["tau_by_nodes"]) == {"4", "8"}
    chk = res["check"]
    assert chk["checked"] and chk["mismatch_count"] == 0 and chk["first_divergence"] is None
    assert set(chk["mismatches"]) == {"chain", "tree@4", "tree@8"}
    md = (out / "results.md").read_text()
    assert "| method | tok/s mean | median | p5 | p95 |" in md and "| tree@8 |" in md
    for png in ("tokens_per_s_cdf.png", "accept_length_hist.png", "tau_vs_nodes.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png in res["files"]


def test_without_matplotlib_the_results_are_written_and_the_plots_skipped_in_one_note(tiny_pair, tmp_path,
                                                                                      monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "out"
    rc = cli.main(["bench", *_pair_args(tiny_pair, prefer_bundled=True), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "1", "--max-new-tokens", "4", "--methods", "ar", "--warmup", "0",
                   "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "tandem: note: PNG plots skipped: matplotlib is not installed" in err and "Traceback" not in err
    res = json.loads((out / "results.json").read_text())
    assert res["files"] == ["results.json", "results.md"] and not list(out.glob("*.png"))


def test_planted_divergence_fails_and_is_reported(tiny_pair, tmp_path, monkeypatch, capsys):
    original = Generator.generate
    planted: dict[str, int] = {}

    def perturbed(self, prompt_ids, method="tree", *args, **kwargs):
        r = original(self, prompt_ids, method, *args, **kwargs)
        if method == "chain" and bytes(prompt_ids).startswith(b"class Stack"):
            planted["expected"] = r.token_ids[5]
            r.token_ids[5] = (r.token_ids[5] + 1) % 256
            planted["got"] = r.token_ids[5]
        return r

    monkeypatch.setattr(Generator, "generate", perturbed)
    argv = ["bench", "--target", str(tiny_pair), "--draft", str(tiny_pair), "--workload", str(_prompts_file(tmp_path)),
            "--num-prompts", "2", "--max-new-tokens", "12", "--ignore-eos", "--methods", "chain,tree", "--nodes", "6",
            "--warmup", "0", "--out", str(tmp_path / "bad")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "OUTPUT MISMATCH" in err and "chain diverges from ar on prompt 1 at new token 5" in err
    res = json.loads((tmp_path / "bad" / "results.json").read_text())
    chk = res["check"]
    assert chk["mismatch_count"] == 1
    assert chk["mismatches"]["tree"]["count"] == 0
    assert chk["mismatches"]["chain"]["prompts"] == [1]
    assert chk["first_divergence"] == {"method": "chain", "prompt_index": 1, "position": 5,
                                       "expected": planted["expected"], "got": planted["got"]}
    assert "First divergence: chain diverges" in (tmp_path / "bad" / "results.md").read_text()
    # --allow-mismatch reports it but exits 0
    assert cli.main(argv[:-1] + [str(tmp_path / "bad2"), "--allow-mismatch", "--no-plots"]) == 0


def test_hf_peers_are_checked_as_peers(tiny_pair, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    rc = cli.main(["bench", "--target", str(tiny_pair), "--draft", str(tiny_pair), "--workload",
                   str(_prompts_file(tmp_path)), "--num-prompts", "1", "--max-new-tokens", "8", "--ignore-eos",
                   "--methods", "hf,hf-assisted", "--warmup", "0", "--no-plots", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["methods"] == ["ar", "hf", "hf-assisted"]
    chk = res["check"]
    assert set(chk["peer_mismatches"]) == {"hf", "hf-assisted"} and chk["mismatches"] == {}
    # fp32 on CPU: transformers' greedy output is ar's, token for token
    assert chk["peer_mismatch_count"] == 0
    assert set(res["speedup"]["vs_hf"]) == {"ar", "hf-assisted"}
    assert res["summary"]["hf"]["tau"] is None
    assert "vs hf" in (out / "results.md").read_text()


def test_bench_user_errors_are_one_line(tiny_pair, tmp_path, capsys):
    base = ["bench", "--target", str(tiny_pair), "--out", str(tmp_path / "x")]
    assert cli.main(base + ["--methods", "ar,beam"]) == 2
    assert "unknown method 'beam'" in capsys.readouterr().err
    assert cli.main(base + ["--workload", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    assert cli.main(base + ["--nodes", "4,x"]) == 2
    assert "--nodes" in capsys.readouterr().err


# ---- pieces -----------------------------------------------------------------------------------
def test_first_divergence():
    assert harness.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert harness.first_divergence([1, 2, 3], [1, 9, 3]) == (1, 2, 9)
    assert harness.first_divergence([1, 2, 3], [1, 2]) == (2, 3, None)
    assert harness.first_divergence([1, 2], [1, 2, 7]) == (2, None, 7)


def test_check_outputs_separates_peers():
    outs = {"ar": [[1, 2], [3, 4]], "tree": [[1, 2], [3, 5]], "hf": [[1, 0], [3, 4]]}
    chk = harness.check_outputs(outs, peers={"hf"}, greedy=True)
    assert chk["mismatch_count"] == 1 and chk["peer_mismatch_count"] == 1
    assert chk["first_divergence"] == {"method": "tree", "prompt_index": 1, "position": 1, "expected": 4, "got": 5}
    assert not harness.check_outputs(outs, peers={"hf"}, greedy=False)["checked"]


def test_parse_methods_and_nodes():
    assert harness.parse_methods("tree,chain", [16]) == ["ar", "tree", "chain"]
    assert harness.parse_methods("ar,tree,hf", [8, 32]) == ["ar", "tree@8", "tree@32", "hf"]
    assert harness.parse_nodes("8, 16,8") == [8, 16]
    with pytest.raises(ConfigError):
        harness.parse_methods("chain@3", [8])


def test_summarize_and_paired_ratio_ci():
    s = stats.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s.mean, s.median, s.min, s.max) == (3.0, 3.0, 1.0, 5.0)
    assert s.p5 == pytest.approx(1.2) and s.p95 == pytest.approx(4.8)
    assert stats.summarize([]).n == 0
    base = [10.0, 20.0, 30.0, 40.0]
    r = stats.paired_ratio_ci([2 * b for b in base], base, seed=1)
    assert r.geomean == pytest.approx(2.0) and r.lo == pytest.approx(2.0) and r.hi == pytest.approx(2.0)
    noisy = [21.0, 38.0, 65.0, 79.0]
    a, b = stats.paired_ratio_ci(noisy, base, seed=3), stats.paired_ratio_ci(noisy, base, seed=3)
    assert a == b  # seeded
    assert a.lo < a.geomean < a.hi
    assert a.geomean == pytest.approx(math.exp(sum(math.log(x / y) for x, y in zip(noisy, base)) / 4))
    assert stats.paired_ratio_ci([0.0, 5.0], [1.0, 1.0]).n == 1  # a zero has no ratio


def test_mbpp_prompt_format():
    code = "R = 3\r\ndef min_cost(cost, m, n): \r\n\treturn 0"
    assert workloads.mbpp_prompt("Write a function to  find\nthe cost.", code) == (
        'def min_cost(cost, m, n):\n    """Write a function to find the cost."""\n')
    assert workloads.mbpp_prompt("Do it.", "x = 1") == '"""Do it."""\n'


@pytest.mark.parametrize("name", ["mbpp", "spec-bench", "mt-bench", "gsm8k"])
def test_known_workloads(name):
    if not workloads.DEFAULT_DATA_DIR.is_dir():
        pytest.skip("shared datasets are not present")
    ps = workloads.load_workload(name, 3)
    assert len(ps) == 3 and all(p.text.strip() for p in ps)
    if name == "mbpp":
        assert ps[0].id == "11" and ps[0].text.startswith("def ") and '"""' in ps[0].text


def test_jsonl_workload_and_errors(tmp_path):
    f = _prompts_file(tmp_path)
    ps = workloads.load_workload(str(f), 5)
    assert [p.id for p in ps] == ["add", "stack"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match="prompt"):
        workloads.load_workload(str(bad), 1)
    with pytest.raises(ConfigError, match="--data-dir"):
        workloads.load_workload("gsm8k", 1, data_dir=tmp_path)


def test_source_workload_takes_heldout_heads():
    ps = workloads.load_workload("source", 2, source_lines=5)
    assert 1 <= len(ps) <= 2
    for p in ps:
        assert p.id.startswith(("stdlib/", "site/")) and p.text.count("\n") <= 5


def test_async_method_is_benchmarked_and_checked(tiny_pair, tmp_path):
    out = tmp_path / "async"
    rc = cli.main(["bench", "--target", str(tiny_pair), "--draft", str(tiny_pair), "--workload",
                   str(_prompts_file(tmp_path)), "--num-prompts", "2", "--max-new-tokens", "12", "--ignore-eos",
                   "--methods", "async", "--nodes", "6", "--async-transport", "inline", "--warmup", "0",
                   "--no-plots", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["methods"] == ["ar", "async"]
    assert res["check"]["mismatches"]["async"]["count"] == 0
    assert res["summary"]["async"]["tau"] >= 1.0


def test_acceptance_replay_times_methods_at_preset_shapes_with_the_recorded_accepts(tiny_pair, tmp_path, capsys):
    trace_dir, out = tmp_path / "trace", tmp_path / "replay"
    rc = cli.main(["bench", *_pair_args(tiny_pair, prefer_bundled=True), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "2", "--max-new-tokens", "16", "--methods", "ar,chain,tree", "--k", "3",
                   "--nodes", "8", "--warmup", "0", "--no-plots", "--out", str(trace_dir)])
    assert rc == 0, capsys.readouterr().err
    rc = cli.main(["bench", "--preset", "tiny", "--replay", str(trace_dir / "results.json"), "--methods", "ar,chain,tree",
                   "--no-plots", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    trace = json.loads((trace_dir / "results.json").read_text())
    assert "simulated acceptance" in res["acceptance"] and "simulated acceptance" in (out / "results.md").read_text()
    assert res["check"]["checked"] is False
    assert set(res["summary"]) == {"ar", "chain", "tree"} and res["config"]["preset"] == "tiny"
    recorded = {(r["method"], r["prompt_index"]): r for r in trace["requests"]}
    for r in res["requests"]:
        rec = recorded[(r["method"], r["prompt_index"])]
        assert r["new_tokens"] == max(1, rec["new_tokens"])
        if r["method"] == "chain":  # a chain of k always has room for the recorded accept count
            assert r["accept_lengths"] == rec["accept_lengths"]
        # each replayed request says which loop ran it and how long it drafted and verified
        assert r["loop"] == "host" and r["verify_seconds"] > 0
        assert r["draft_seconds"] is not None and (r["method"] == "ar" or r["draft_seconds"] > 0)


def test_replay_with_an_eagle3_head_of_a_preset_shape(tiny_pair, tmp_path, capsys):
    """--draft-preset eagle3-...: a random EAGLE-3 head (reduced vocabulary, the target's features)
    drafts at the preset's shape; a chain of k replays the recorded accepts exactly."""
    trace_dir, out = tmp_path / "trace", tmp_path / "replay"
    rc = cli.main(["bench", *_pair_args(tiny_pair, prefer_bundled=True), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "1", "--max-new-tokens", "16", "--methods", "ar,chain,tree", "--k", "3",
                   "--nodes", "8", "--warmup", "0", "--no-plots", "--out", str(trace_dir)])
    assert rc == 0, capsys.readouterr().err
    rc = cli.main(["bench", "--preset", "tiny", "--draft-preset", "eagle3-tiny", "--replay",
                   str(trace_dir / "results.json"), "--methods", "ar,chain,tree", "--no-plots", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["draft_preset"] == "eagle3-tiny" and "simulated acceptance" in res["acceptance"]
    recorded = {(r["method"], r["prompt_index"]): r for r in json.loads((trace_dir / "results.json").read_text())["requests"]}
    chains = [r for r in res["requests"] if r["method"] == "chain"]
    assert chains and all(r["accept_lengths"] == recorded[("chain", r["prompt_index"])]["accept_lengths"] for r in chains)
    assert cli.main(["bench", "--preset", "tiny", "--draft-preset", "eagle3-huge", "--replay",
                     str(trace_dir / "results.json"), "--out", str(out)]) == 2
    assert "unknown preset 'eagle3-huge'" in capsys.readouterr().err


def test_replay_at_a_hybrid_preset_shape(tiny_pair, tmp_path, capsys):
    """--preset qwen3.5-tiny: a random Qwen3.5 target and a Qwen3.5 draft run the hybrid loop with
    the recorded accepts (a chain of k replays them exactly); an EAGLE-3 draft preset is refused."""
    trace_dir, out = tmp_path / "trace", tmp_path / "replay"
    rc = cli.main(["bench", *_pair_args(tiny_pair, prefer_bundled=True), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "1", "--max-new-tokens", "16", "--methods", "ar,chain,tree", "--k", "3",
                   "--nodes", "8", "--warmup", "0", "--no-plots", "--out", str(trace_dir)])
    assert rc == 0, capsys.readouterr().err
    rc = cli.main(["bench", "--preset", "qwen3.5-tiny", "--replay", str(trace_dir / "results.json"),
                   "--methods", "ar,chain,tree", "--no-plots", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["preset"] == "qwen3.5-tiny" and res["config"]["draft_preset"] == "qwen3.5-tiny"
    assert set(res["summary"]) == {"ar", "chain", "tree"} and "simulated acceptance" in res["acceptance"]
    recorded = {(r["method"], r["prompt_index"]): r for r in json.loads((trace_dir / "results.json").read_text())["requests"]}
    chains = [r for r in res["requests"] if r["method"] == "chain"]
    assert chains and all(r["accept_lengths"] == recorded[("chain", r["prompt_index"])]["accept_lengths"] for r in chains)
    assert cli.main(["bench", "--preset", "qwen3.5-tiny", "--draft-preset", "eagle3-tiny", "--replay",
                     str(trace_dir / "results.json"), "--out", str(out)]) == 2
    assert "is an EAGLE-3 head of an attention-only target" in capsys.readouterr().err


def test_replay_needs_a_preset_and_a_real_trace(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert cli.main(["bench", "--replay", str(bad)]) == 2
    assert "--replay needs --preset" in capsys.readouterr().err
    assert cli.main(["bench", "--preset", "tiny", "--replay", str(bad)]) == 2
    assert "no per-request records" in capsys.readouterr().err
    assert cli.main(["bench", "--preset", "tiny"]) == 2
    assert "need --replay" in capsys.readouterr().err


def test_replay_refuses_a_draft_preset_that_cannot_embed_the_targets_tokens(capsys):
    """A replay feeds the target's tokens to the draft: a draft preset of a smaller vocabulary
    stopped on the GPU at a device-side index assert (Qwen3.5-4B with a Qwen2.5-0.5B draft)."""
    from pathlib import Path

    trace = Path(__file__).parent.parent / "bench/results/h200-2026-12-01-drafters-table/mbpp_eagle3/results.json.gz"
    assert cli.main(["bench", "--preset", "qwen3.5-4b", "--draft-preset", "qwen2.5-0.5b", "--replay",
                     str(trace)]) == 2
    err = capsys.readouterr().err
    assert "draft preset qwen2.5-0.5b has 151936 tokens, fewer than qwen3.5-4b's 248320" in err
    assert "(qwen3.5-0.8b)" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["bench", "--preset", "llama3.2-1b", "--replay", str(trace)]) == 2  # (its default draft: tiny)
    assert "draft preset tiny has 512 tokens" in capsys.readouterr().err


def test_read_json_reads_a_gzipped_results_file(tmp_path):
    """Older results are kept gzipped; --replay and --tau-json read them as they are."""
    import gzip
    import json

    from tandem.bench.env import read_json

    doc = {"runs": [{"method": "tree", "tau": 4.5}]}
    (tmp_path / "results.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert read_json(tmp_path / "results.json.gz", "--replay") == doc
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    from tandem.config import ConfigError

    with pytest.raises(ConfigError, match="ends in .gz but is not gzip data"):
        read_json(tmp_path / "bad.json.gz", "--replay")


def test_the_stack_sampler_charges_a_busy_function_of_the_watched_thread():
    """StackSampler reads the watched thread's innermost Python frame every interval: a thread
    spinning in one function gets nearly every sample, and the switch interval is restored."""
    import sys
    import time

    from tandem.bench.stack_sampler import StackSampler

    def spin_here(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    before = sys.getswitchinterval()
    sampler = StackSampler(interval_s=0.002).start()
    spin_here(0.3)
    sampler.stop()
    cpu = StackSampler(interval_s=0.002, mode="cpu").start()  # (SIGPROF on the main thread: a CPU profile)
    spin_here(0.3)
    cpu.stop()
    assert cpu.samples >= 20 and cpu.own.most_common(1)[0][0].endswith(":spin_here")
    own = sampler.own.most_common(1)[0]
    assert sampler.samples >= 20 and own[0].endswith(":spin_here") and own[1] >= 0.8 * sampler.samples
    assert sampler.total["test_bench.py:test_the_stack_sampler_charges_a_busy_function_of_the_watched_thread"] \
        == sampler.samples and sys.getswitchinterval() == before
    assert "spin_here" in sampler.report(5)
