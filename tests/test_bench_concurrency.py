"""`tandem bench --concurrency`: the batched engine at several concurrencies beside transformers'
padded `generate`, on a tiny random checkpoint (draft = target, so the tree accepts a lot).

Every output is compared here with the single-request loop's greedy `ar` output (an independent
reference: `Generator`, not the engine). `generate_batch` is left out: its manager setup alone
takes ~10 s per call on a CPU; the lead's GPU run covers it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem import cli
from tandem.bench.concurrency import parse_concurrency
from tandem.config import ConfigError, GenerationConfig

MAX_NEW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from conftest import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("pair") / "target", "llama_untied", seed=0)


def _prompts_file(tmp_path: Path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"id": "add", "prompt": "def add(a, b):\n"}) + "\n"
                 + json.dumps({"id": "stack", "prompt": "class Stack:\n    def push(self, x):\n"}) + "\n"
                 + json.dumps({"id": "fib", "prompt": "def fib(n):\n    if n < 2:"}) + "\n")
    return f


def test_concurrency_runs_write_results_and_every_output_equals_solo_ar(tiny, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    rc = cli.main(["bench", "--target", str(tiny), "--draft", str(tiny), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "3", "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--methods", "tree",
                   "--nodes", "4", "--concurrency", "1,4", "--peers", "generate", "--warmup", "0", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["methods"] == ["ar", "tree"] and res["config"]["concurrency"] == [1, 4]
    runs = {(r["name"], r["concurrency"]): r for r in res["runs"]}
    assert set(runs) == {(n, c) for n in ("ar", "tree", "hf generate (padded)") for c in (1, 4)}

    # the independent reference: each prompt alone through the single-request loop
    from tandem.runtime.generate import Generator
    from tandem.runtime.pair import load_pair

    pair = load_pair(str(tiny), None, "cpu", "float32", need_draft=False)
    g = Generator(pair.target, None, pair.tokenizer)
    texts = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    refs = [g.generate(pair.tokenizer.encode(t).ids, "ar", gen=GenerationConfig(max_new_tokens=MAX_NEW,
                                                                                 ignore_eos=True)).token_ids
            for t in texts]
    assert res["reference_outputs"] == refs
    for (name, c), r in runs.items():
        assert len(r["requests"]) == c and r["new_tokens"] == c * MAX_NEW
        # prompts are cycled: request i decodes prompt i % 3
        assert [q["prompt_index"] for q in r["requests"]] == [i % 3 for i in range(c)]
        assert [q["token_ids"] for q in r["requests"]] == [refs[i % 3] for i in range(c)], (name, c)
        for q in r["requests"]:
            assert 0 < q["ttft"] <= q["e2e"] and q["itl"] is not None and q["itl"] >= 0
        assert r["tokens_per_s"] > 0 and r["ttft_s"]["n"] == c
    assert all(runs[(n, c)]["preemptions"] == 0 for n in ("ar", "tree") for c in (1, 4))
    assert runs[("ar", 4)]["tau"] == 1.0 and runs[("ar", 4)]["steps"] >= MAX_NEW
    # draft = target: every draft token is accepted, so the tree takes fewer passes than ar
    assert runs[("tree", 4)]["tau"] > 1.5 and runs[("tree", 4)]["steps"] < runs[("ar", 4)]["steps"]
    chk = res["check"]
    assert chk["checked"] and chk["mismatch_count"] == 0 and chk["peer_mismatch_count"] == 0
    assert chk["runs"]["tree@4"] == {"mismatches": 0, "of": 4, "first": None}

    # the engine's step times: the whole step, and of it drafting (tree drafts, ar does not)
    for c in (1, 4):
        tree, ar = runs[("tree", c)], runs[("ar", c)]
        assert 0 < tree["drafting_ms"] < tree["step_ms"] and ar["drafting_ms"] < 0.5 * ar["step_ms"]
        assert abs(tree["step_ms"] * tree["steps"] / 1e3 - tree["seconds"]) < 0.5 * tree["seconds"]
    md = (out / "results.md").read_text()
    assert "| tree | 4 |" in md and "| hf generate (padded) | 4 |" in md and "0 mismatching engine" in md
    assert "- tree C=4: " in md
    assert md == captured.out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res["files"] == ["results.json", "results.md"]
    else:
        assert (out / "tokens_per_s_vs_concurrency.png").stat().st_size > 0
        assert "tokens_per_s_vs_concurrency.png" in res["files"]


def test_requests_per_level_keep_at_most_c_in_flight_and_every_output_equals_solo_ar(tiny, tmp_path, capsys):
    """--requests N with --concurrency C: N requests (prompts cycled), at most C decoding at once,
    the next admitted as one finishes (a steady state rather than one wave); outputs equal solo ar."""
    out = tmp_path / "out"
    rc = cli.main(["bench", "--target", str(tiny), "--draft", str(tiny), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "3", "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--methods", "tree",
                   "--nodes", "4", "--concurrency", "2", "--requests", "5", "--peers", "none", "--warmup", "0",
                   "--no-plots", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["requests"] == 5 and res["check"]["mismatch_count"] == 0
    for r in res["runs"]:
        assert r["concurrency"] == 2 and len(r["requests"]) == 5 and r["new_tokens"] == 5 * MAX_NEW
        assert [q["prompt_index"] for q in r["requests"]] == [i % 3 for i in range(5)]
        # two slots: the last request starts only after two others finished
        ttft = sorted(q["ttft"] for q in r["requests"])
        e2e = sorted(q["e2e"] for q in r["requests"])
        assert ttft[-1] >= e2e[1]
    assert "5 requests per level (at least C), at most C in flight" in (out / "results.md").read_text()
    assert cli.main(["bench", "--target", str(tiny), "--concurrency", "2", "--requests", "0",
                     "--out", str(tmp_path / "y")]) == 2
    assert "--requests must be >= 1 (got 0)" in capsys.readouterr().err


@pytest.mark.parametrize("value,message", [
    ("0", "--concurrency values must be >= 1 (got 0"),
    ("-4", "--concurrency values must be >= 1 (got -4"),
    ("1,-2", "--concurrency values must be >= 1 (got -2"),
    ("2.5", "--concurrency takes a comma list of positive integers (got '2.5')"),
    ("1,x", "--concurrency takes a comma list of positive integers (got '1,x')"),
    ("", "--concurrency takes a comma list of positive integers (got '')"),
])
def test_bad_concurrency_values_are_one_line_errors(tiny, tmp_path, capsys, value, message):
    rc = cli.main(["bench", "--target", str(tiny), f"--concurrency={value}", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"tandem: error: {message}")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x").exists()  # checked before any work


def test_bad_methods_and_peers_are_one_line_errors(tiny, tmp_path, capsys):
    base = ["bench", "--target", str(tiny), "--concurrency", "1,2", "--out", str(tmp_path / "x")]
    assert cli.main(base + ["--methods", "ar,hf"]) == 2
    err = capsys.readouterr().err
    assert "runs the engine methods ar, chain, tree (got 'hf')" in err and err.count("\n") == 1
    assert cli.main(base + ["--peers", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "unknown peer 'vllm' in --peers" in err and err.count("\n") == 1
    assert cli.main(base + ["--nodes", "4,8"]) == 2
    assert "one --nodes budget" in capsys.readouterr().err


def test_parse_concurrency():
    assert parse_concurrency("1,8,16,32,64") == [1, 8, 16, 32, 64]
    assert parse_concurrency(" 4 , 1,4") == [4, 1]  # order kept, repeats dropped
    with pytest.raises(ConfigError, match="positive integers"):
        parse_concurrency("1,,2")


def test_check_counts_engine_and_peer_mismatches_apart():
    from tandem.bench.concurrency import RunResult, Timed, check

    refs = [[5, 6, 7], [8, 9]]
    tree = RunResult("tree", 3, False, 1.0, [Timed(0, 0, [5, 6, 7], 0.1, 0.3), Timed(1, 1, [8, 4], 0.1, 0.2),
                                             Timed(2, 0, [5, 6], 0.1, 0.2)])
    peer = RunResult("hf generate (padded)", 2, True, 1.0, [Timed(0, 0, [5, 6, 1], 0.1, 0.3),
                                                            Timed(1, 1, [8, 9], 0.1, 0.2)])
    skipped = RunResult("hf generate_batch", 2, True, skipped="no generate_batch")
    rep = check([tree, peer, skipped], refs, greedy=True)
    assert rep["mismatch_count"] == 2 and rep["peer_mismatch_count"] == 1
    assert rep["runs"]["tree@3"]["mismatches"] == 2 and rep["runs"]["tree@3"]["of"] == 3
    # request 1 differs at new token 1; request 2 ended early (got None at token 2)
    assert rep["first_divergence"] == {"run": "tree@3", "request": 1, "prompt_index": 1, "position": 1,
                                       "expected": 9, "got": 4}
    assert "hf generate_batch@2" not in rep["runs"]
    assert check([tree], refs, greedy=False)["checked"] is False


def test_engine_modes_run_as_method_variants_and_stay_exact(tiny, tmp_path, capsys):
    """--batch-parallel / --row-selection add METHOD+bp and METHOD+bp+sel runs; every output is
    checked against solo ar like the plain runs."""
    out = tmp_path / "out"
    rc = cli.main(["bench", "--target", str(tiny), "--draft", str(tiny), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "3", "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--methods", "tree",
                   "--nodes", "4", "--concurrency", "4", "--peers", "none", "--warmup", "0", "--batch-parallel",
                   "--row-selection", "--no-plots", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["methods"] == ["ar", "tree", "tree+bp", "tree+bp+sel"]
    assert {r["name"] for r in res["runs"]} == {"ar", "tree", "tree+bp", "tree+bp+sel"}
    assert res["check"]["mismatch_count"] == 0
    assert "| tree+bp+sel | 4 |" in captured.out


def test_a_gated_run_measures_its_step_costs_once(tiny, tmp_path, capsys, monkeypatch):
    """With a warm-up, the measured engine takes the warm-up engine's measured step costs
    (EngineConfig.step_costs) instead of measuring again: seconds of device time per run."""
    from tandem.engine.engine import Engine

    calls = []
    measure = Engine.measure_step_costs

    def counted(self, *a, **k):
        calls.append(self.config.max_num_seqs)
        return measure(self, *a, **k)

    monkeypatch.setattr(Engine, "measure_step_costs", counted)
    out = tmp_path / "out"
    rc = cli.main(["bench", "--target", str(tiny), "--draft", str(tiny), "--workload", str(_prompts_file(tmp_path)),
                   "--num-prompts", "2", "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--methods", "tree+gate",
                   "--nodes", "4", "--concurrency", "2", "--peers", "none", "--warmup", "1", "--no-plots",
                   "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert calls == [2]  # the warm-up engine's; the measured one reused them
    results = json.loads((out / "results.json").read_text())
    assert results["check"]["mismatch_count"] == 0
    # the gate's step-by-step view, apart: runs of steps alike whose tokens are the run's new tokens
    trace = json.loads((out / "gate_trace.json").read_text())
    assert trace["columns"][:5] == ["R", "regime", "steps", "seconds", "tokens"]
    assert all("gate_trace" not in r for r in results["runs"])
    rows = trace["runs"]["tree+gate C=2"]
    run = next(r for r in results["runs"] if r["name"] == "tree+gate")
    assert {r[1] for r in rows} <= {"on", "off", "probe"} and all(r[0] in (1, 2) for r in rows)
    # every decode step is in one row (the run's other steps are prefill-only), and every decoded token
    # is a step's (a request's first token comes from its prefill; a step's count may pass max_tokens,
    # whose excess the request drops)
    assert 0 < sum(r[2] for r in rows) <= run["steps"]
    assert sum(r[4] for r in rows) >= run["new_tokens"] - 2


def test_engine_mode_errors_are_one_line(tiny, tmp_path, capsys):
    from tandem.bench.concurrency import engine_modes, parse_engine_methods

    assert parse_engine_methods("tree,chain+sel", batch_parallel=True) == ["ar", "tree", "chain+sel", "tree+bp"]
    assert engine_modes("tree+bp+sel") == ("tree", {"batch_parallel": True, "row_selection": True,
                                                    "deterministic": False})
    assert parse_engine_methods("ar,tree", deterministic=True) == ["ar", "tree", "ar+det", "tree+det"]
    assert parse_engine_methods("tree,tree+seq") == ["ar", "tree", "tree+seq"]
    assert engine_modes("tree+seq")[1]["batched_drafting"] is False and "batched_drafting" not in engine_modes("tree")[1]
    assert engine_modes("tree+gate")[1]["draft_gate"] is True and "draft_gate" not in engine_modes("tree+sel")[1]
    assert engine_modes("tree")[1]["draft_gate"] is False  # (`tree` drafts every step, even where a GPU gates by default)
    assert engine_modes("tree+sel+adapt")[1]["adaptive_draft"] is True
    assert parse_engine_methods("ar,ar+sync") == ["ar", "ar+sync"]  # (ar's A/B of async scheduling)
    assert engine_modes("ar+sync") == ("ar", {"batch_parallel": False, "row_selection": False, "deterministic": False,
                                              "draft_ahead": False, "async_scheduling": False, "draft_gate": False})
    with pytest.raises(ConfigError, match="need a speculative method"):
        parse_engine_methods("ar+seq")
    with pytest.raises(ConfigError, match="need a speculative method"):
        parse_engine_methods("ar+gate")
    base = ["bench", "--target", str(tiny), "--out", str(tmp_path / "x")]
    for extra, message in ((["--concurrency", "2", "--methods", "ar+bp"], "need a speculative method"),
                           (["--concurrency", "2", "--methods", "tree+fast"], "unknown engine mode in 'tree+fast'"),
                           (["--concurrency", "2", "--methods", "ar", "--batch-parallel"], "need a speculative method"),
                           (["--batch-parallel"], "use them with --concurrency")):
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_the_reference_outputs_are_each_prompt_decoded_alone():
    """solo_outputs (one ar engine, prompts one after another, no prefix cache) gives what the
    single-request loop gives for each prompt on its own."""
    import torch

    from models_for_tests import tiny_model
    from tandem.bench.concurrency import solo_outputs
    from tandem.config import SpecConfig
    from tandem.engine.request import SamplingParams
    from tandem.runtime.generate import Generator
    from tandem.runtime.pair import Pair

    target = tiny_model(seed=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (3, 17, 3, 9)]
    prompts[2] = prompts[1][:3]  # a shared prefix: the second prompt's blocks must not be reused
    pair = Pair(target=target, draft=None, tokenizer=None, target_dir=Path("."), draft_dir=None)
    outs = solo_outputs(pair, SpecConfig(), prompts, SamplingParams(max_tokens=12, ignore_eos=True), 256)
    solo = Generator(target, None, use_graphs=False)
    want = [solo.generate(p, "ar", gen=GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids for p in prompts]
    assert outs == want
