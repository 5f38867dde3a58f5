"""`tandem profile` on CPU with the tiny preset: the documented profile.json keys and the prediction."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tandem import cli
from tandem.bench import presets, profile

PROFILE_KEYS = {"environment", "config", "target", "draft", "bandwidth_gb_s", "ar_step_ms", "ar_floor_ms",
                "ar_vs_floor", "t_target_ms", "c", "t_draft_ms", "tau", "tau_source", "prediction", "best_nodes",
                "best_predicted_speedup", "files"}


def test_profile_tiny_cpu(tmp_path, capsys):
    tau = tmp_path / "results.json"  # a bench results.json with a tau table
    tau.write_text(json.dumps({"tau_by_nodes": {"2": 1.6, "4": 2.0, "8": 2.3}}))
    out = tmp_path / "prof"
    rc = cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "32",
                   "--rows", "1,2,4", "--widths", "1,2", "--width", "2", "--iters", "2", "--tau-json", str(tau),
                   "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "profile.json").read_text())
    assert PROFILE_KEYS <= set(rep)
    assert rep["config"]["preset"] == "tiny" and rep["config"]["draft_preset"] == "tiny"
    # requested rows plus n + 1 for each budget of the tau table
    assert set(rep["t_target_ms"]) == {"1", "2", "3", "4", "5", "9"}
    assert rep["c"]["1"] == 1.0 and all(v > 0 for v in rep["t_target_ms"].values())
    assert set(rep["t_draft_ms"]) == {"1", "2"}
    assert rep["ar_step_ms"] == pytest.approx(rep["t_target_ms"]["1"])
    assert rep["ar_vs_floor"] == pytest.approx(rep["ar_step_ms"] / rep["ar_floor_ms"])
    assert rep["target"]["weight_bytes"] == presets.weight_bytes(presets.random_model("tiny", "cpu", torch.float32))
    assert rep["tau"] == {"2": 1.6, "4": 2.0, "8": 2.3} and rep["tau_source"] == str(tau)
    assert [p["nodes"] for p in rep["prediction"]] == [2, 4, 8]
    for p in rep["prediction"]:
        assert p["rows"] == p["nodes"] + 1
        assert p["predicted_speedup"] == pytest.approx(p["tau"] / (p["c"] + p["draft_term"]))
    best = max(rep["prediction"], key=lambda p: p["predicted_speedup"])
    assert rep["best_nodes"] == best["nodes"]
    assert (out / "cost_model.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out  # the best budget where it pays, else `ar` named
    assert (f"best node budget: {best['nodes']}" in printed) == (best["predicted_speedup"] >= 1.0)
    assert ("nothing pays: ar" in printed) == (best["predicted_speedup"] < 1.0)


def test_profile_without_tau_and_errors(tmp_path, capsys):
    rc = cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "16",
                   "--rows", "1,2", "--widths", "1", "--width", "1", "--iters", "1", "--no-plots",
                   "--out", str(tmp_path / "p")])
    assert rc == 0
    rep = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert rep["tau"] is None and rep["prediction"] == [] and rep["best_nodes"] is None
    assert cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--tau-json", str(tmp_path / "missing.json")]) == 2
    assert "--tau-json" in capsys.readouterr().err


# The tiny preset's parameters, counted by hand from its shapes (hidden 64, 2 layers, 4 heads and
# 2 K/V heads of 16, MLP 128, vocabulary 512, untied): per layer q 64x64 + k, v 64x32 each +
# o 64x64 + gate, up, down 64x128 each + two norms of 64 = 36,992; embedding + lm_head 2 x 512x64
# = 65,536; final norm 64. 2 x 36,992 + 65,536 + 64 = 139,584.
TINY_PARAMS = 139_584


@pytest.mark.parametrize("dtype,weight_bytes,floor_ms", [
    ("float32", 4 * TINY_PARAMS, 0.2233344),  # 558,336 bytes / 2.5 GB/s
    ("bfloat16", 2 * TINY_PARAMS, 0.1116672),  # 279,168 bytes / 2.5 GB/s
])
def test_profile_floor_is_weight_bytes_over_bandwidth(tmp_path, monkeypatch, dtype, weight_bytes, floor_ms):
    """The floor against a known bandwidth and the hand-counted weight bytes, not against itself."""
    monkeypatch.setattr(profile, "copy_bandwidth", lambda device, nbytes, iters: 2.5e9)  # a 2.5 GB/s device
    rc = cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--dtype", dtype, "--context", "8",
                   "--rows", "1", "--widths", "1", "--width", "1", "--iters", "1", "--no-plots",
                   "--out", str(tmp_path / "p")])
    assert rc == 0
    rep = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert rep["target"]["num_params"] == TINY_PARAMS and rep["target"]["weight_bytes"] == weight_bytes
    assert rep["bandwidth_gb_s"] == pytest.approx(2.5)
    assert rep["ar_floor_ms"] == pytest.approx(floor_ms, rel=1e-9)


def test_copy_bandwidth_counts_the_read_and_the_write(monkeypatch):
    """A copy of 8 MiB that takes 2 ms moves 2 x 8 MiB: 8.39 GB/s."""
    copies = []

    def two_ms(device):
        def measure(fn, iters, warmup=2):
            copies.append(fn())  # the copy really runs; its time is given
            return 0.002
        return measure

    monkeypatch.setattr(profile, "timer", two_ms)
    assert profile.copy_bandwidth(torch.device("cpu"), 8 << 20, 3) == pytest.approx(2 * (8 << 20) / 0.002)
    assert copies[0].numel() == (8 << 20) // 4 and bool((copies[0] == 1.0).all())


def test_profile_has_no_fuse_flag(capsys):
    """The runner always fuses the projections, so `--fuse` (which changed nothing) is gone."""
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--fuse"])
    assert e.value.code == 2
    assert "unrecognized arguments: --fuse" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["profile", "--help"])
    assert "--fuse" not in capsys.readouterr().out


def test_random_model_shapes_dtype_and_tying():
    cfg = dataclasses.replace(presets.PRESETS["tiny"], tie_word_embeddings=True, attention_bias=True)
    m = presets.random_model(cfg, "cpu", torch.bfloat16)
    assert m.dtype == torch.bfloat16
    assert m.lm_head.weight is m.model.embed_tokens.weight
    w = m.model.layers[0].mlp.down_proj.weight.float()
    assert abs(w.std().item() - 0.02) < 0.004
    assert torch.isfinite(m(torch.tensor([[1, 2, 3]])).float()).all()
    for name in ("llama3-8b", "llama3.2-1b", "qwen2.5-7b", "qwen2.5-0.5b"):
        assert presets.preset_config(name).num_params > 4e8


def test_load_tau_json_formats(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"16": 2.5, "32": 2.9}))
    assert profile.load_tau_json(str(f)) == {16: 2.5, 32: 2.9}
    f.write_text(json.dumps({"tau_by_nodes": {}}))
    with pytest.raises(Exception, match="no tau table"):
        profile.load_tau_json(str(f))


def test_measure_tau_on_a_pair(tmp_path):
    from conftest import save_tiny_checkpoint

    pair = save_tiny_checkpoint(tmp_path / "pair", "llama_untied")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    rc = cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "16",
                   "--rows", "1", "--widths", "1", "--width", "2", "--iters", "1", "--no-plots", "--measure-tau",
                   "--target", str(pair), "--draft", str(pair), "--workload", str(prompts), "--tau-nodes", "2,4",
                   "--tau-prompts", "1", "--tau-max-new-tokens", "8", "--out", str(tmp_path / "p")])
    assert rc == 0
    rep = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert rep["tau_source"] == "measured" and set(rep["tau"]) == {"2", "4"}
    assert all(t >= 1.0 for t in rep["tau"].values())  # draft == target: most drafts are accepted
    assert [p["nodes"] for p in rep["prediction"]] == [2, 4]


def test_replay_retimes_recorded_acceptance(tmp_path):
    trace = tmp_path / "results.json"
    trace.write_text(json.dumps({
        "config": {"method_specs": {"ar": {"method": "ar", "k": 3, "nodes": 4, "width": 2, "depth": None},
                                    "chain": {"method": "chain", "k": 3, "nodes": 4, "width": 2, "depth": None},
                                    "tree@4": {"method": "tree", "k": 3, "nodes": 4, "width": 2, "depth": None}}},
        "speedup": {"vs_ar": {"chain": {"geomean": 1.5}, "tree@4": {"geomean": 1.7}}},
        "requests": [{"method": "ar", "new_tokens": 8, "target_passes": 8},
                     {"method": "chain", "new_tokens": 8, "target_passes": 3},
                     {"method": "tree@4", "new_tokens": 8, "target_passes": 2}],
    }))
    rc = cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "16",
                   "--rows", "1", "--widths", "1", "--iters", "1", "--no-plots", "--replay", str(trace),
                   "--out", str(tmp_path / "p")])
    assert rc == 0
    rep = json.loads((tmp_path / "p" / "profile.json").read_text())
    # chain verifies k + 1 = 4 rows, tree@4 verifies 5; both were measured for the replay
    assert {"4", "5"} <= set(rep["t_target_ms"]) and "2" in rep["t_draft_ms"]
    m = rep["replay"]["methods"]
    assert set(m) == {"ar", "chain", "tree@4"}
    assert m["ar"]["predicted_speedup_vs_ar"] == pytest.approx(1.0)
    assert (m["chain"]["rows"], m["chain"]["draft_steps_per_pass"], m["chain"]["tau"]) == (4, 3, 8 / 3)
    assert (m["tree@4"]["rows"], m["tree@4"]["draft_steps_per_pass"]) == (5, 3)  # depth ceil(4/2) = 2, +1
    t = rep["t_target_ms"]
    d = rep["t_draft_ms"]
    pass_ms = t["5"] + d["1"] + 2 * d["2"]
    assert m["tree@4"]["pass_ms"] == pytest.approx(pass_ms)
    assert m["tree@4"]["predicted_speedup_vs_ar"] == pytest.approx(8 * t["1"] / (2 * pass_ms))
    assert m["tree@4"]["measured_speedup_vs_ar"] == 1.7


# ---- `--draft`: per-drafter costs and predictions -------------------------------------------------
# Costs in seconds chosen as binary fractions, so every expected figure below is exact.
def _cost(drafter, method, t_draft, t_verify, tau, rows=9):
    return profile.MethodCost(drafter, "block", method, None, None, rows, 2, t_draft, t_verify, tau)


def test_drafter_predictions_follow_from_costs_and_taus():
    t_ar = 0.25  # 4 tok/s for ar
    recs = profile.predict_methods(t_ar, [
        _cost("block", "tree@32", 0.125, 0.375, 3.0),  # pass 0.5 s: 3 / 0.5 = 6 tok/s, 1.5x ar
        _cost("eagle3", "chain", 0.25, 0.5, 2.25),  # pass 0.75 s: 3 tok/s, 0.75x ar
        _cost("draft", "tree@8", 0.5, 0.5, None),  # no tau: costs and break-even only
    ])
    assert [(r["drafter"], r["method"]) for r in recs] == [
        (None, "ar"), ("block", "tree@32"), ("eagle3", "chain"), ("draft", "tree@8")]
    ar, block, eagle, draft = recs
    assert (ar["pass_ms"], ar["predicted_tokens_per_s"], ar["predicted_speedup"], ar["break_even_tau"]) == (
        250.0, 4.0, 1.0, 1.0)
    assert (block["pass_ms"], block["predicted_tokens_per_s"], block["predicted_speedup"]) == (500.0, 6.0, 1.5)
    assert (eagle["pass_ms"], eagle["predicted_tokens_per_s"], eagle["predicted_speedup"]) == (750.0, 3.0, 0.75)
    # break-even tau: the tau at which the method's rate equals ar's, t_pass / t_ar
    assert (block["break_even_tau"], eagle["break_even_tau"], draft["break_even_tau"]) == (2.0, 3.0, 4.0)
    assert (block["draft_ms"], block["verify_ms"], block["draft_over_verify"]) == (125.0, 375.0, 0.125 / 0.375)
    assert draft["predicted_tokens_per_s"] is None and draft["predicted_speedup"] is None
    assert profile.choose_best(recs) is block


def test_drafter_ar_is_best_when_nothing_pays():
    t_ar = 0.25
    recs = profile.predict_methods(t_ar, [
        _cost("block", "tree@32", 0.125, 0.375, 2.0),  # exactly its break-even tau: 4 tok/s, a tie with ar
        _cost("eagle3", "chain", 0.25, 0.5, 1.5),  # 2 tok/s
    ])
    assert [r["predicted_tokens_per_s"] for r in recs] == [4.0, 4.0, 2.0]
    assert profile.choose_best(recs)["method"] == "ar"  # a tie does not pay for drafting
    # without any tau there is nothing to choose between
    assert profile.choose_best(profile.predict_methods(t_ar, [_cost("block", "chain", 0.125, 0.375, None)])) is None


def _bench_results(path, draft_dir, taus):
    """A `tandem bench` results.json as the harness writes it (the keys the profile reads)."""
    specs = {"ar": {"method": "ar", "k": 2, "nodes": 32, "width": 4, "depth": None},
             "chain": {"method": "chain", "k": 2, "nodes": 32, "width": 4, "depth": None},
             "tree@4": {"method": "tree", "k": 2, "nodes": 4, "width": 2, "depth": None},
             "async": {"method": "async", "k": 2, "nodes": 4, "width": 2, "depth": None}}
    summary = {m: {"tau": t, "pass_ms": {"draft_ms": 0.5 * t, "verify_ms": 2.0}} for m, t in taus.items()}
    path.write_text(json.dumps({"config": {"draft": str(draft_dir), "method_specs": specs}, "summary": summary,
                                "speedup": {"vs_ar": {m: {"geomean": t / 2} for m, t in taus.items() if m != "ar"}}}))
    return path


def test_load_method_taus_and_assignment(tmp_path):
    f = _bench_results(tmp_path / "r.json", "/elsewhere/tandem/assets/pair/block",
                       {"ar": 1.0, "chain": 2.5, "tree@4": 3.25, "async": 3.0})
    t = profile.load_method_taus(str(f), k=5, width=4)
    assert t.tau == {"chain": 2.5, "tree@4": 3.25} and t.skipped == ["async"]
    assert t.measured["tree@4"] == {"speedup": 1.625, "draft_ms": 1.625, "verify_ms": 2.0}
    assert [(s.name, s.method, s.k, s.nodes, s.width, s.max_rows) for s in t.shapes] == [
        ("chain", "chain", 2, 32, 4, 3), ("tree@4", "tree", 2, 4, 2, 5)]
    # a plain {"N": tau} table gives tree@N shapes at the profile's --k and --width
    g = tmp_path / "plain.json"
    g.write_text(json.dumps({"16": 2.5, "8": 2.0}))
    p = profile.load_method_taus(str(g), k=5, width=4)
    assert [(s.name, s.nodes, s.width) for s in p.shapes] == [("tree@8", 8, 4), ("tree@16", 16, 4)]
    assert p.tau == {"tree@8": 2.0, "tree@16": 2.5}
    # the bench's recorded draft folder picks the drafter (same folder name on another machine)
    drafters = profile.resolve_drafters("draft,block")
    assert [(d.label, d.kind) for d in drafters] == [("draft", "model"), ("block", "block")]
    assert profile.assign_taus(drafters, [t]) == {"block": t}
    with pytest.raises(Exception, match="none of the profiled drafters"):
        profile.assign_taus(drafters, [p])  # no recorded draft, two drafters: ambiguous
    eagle3 = profile.resolve_drafters("eagle3")
    assert profile.assign_taus(eagle3, [p]) == {"eagle3": p}  # no recorded draft, one drafter: that one
    with pytest.raises(Exception, match="measured with draft '/elsewhere/tandem/assets/pair/block', which is none"):
        profile.assign_taus(eagle3, [t])  # recorded with the block drafter: not the head's acceptance


def test_accepted_path_follows_the_most_probable_child():
    from tandem.tree.draft_tree import DraftTree

    tree = DraftTree(tokens=[7, 1, 2, 3, 4], parents=[-1, 0, 0, 2, 2], logp=[0.0, -2.0, -0.5, -1.5, -0.75])
    assert profile._accepted_path(tree, 0) == []
    assert profile._accepted_path(tree, 1) == [2]
    assert profile._accepted_path(tree, 5) == [2, 4]  # stops at a leaf


needs_bundled = pytest.mark.skipif(
    not __import__("tandem.runtime.pair", fromlist=["bundled_available"]).bundled_available()
    or not (__import__("tandem.runtime.pair", fromlist=["BUNDLED_DRAFTERS"]).BUNDLED_DRAFTERS["block"]
            / "config.json").is_file(), reason="the bundled pair and block drafter are not installed")


@needs_bundled
def test_profile_draft_block_cli(tmp_path, capsys):
    """`tandem profile --draft block` on the bundled pair, with a bench results.json for the block drafter."""
    from tandem.runtime.pair import BUNDLED_DRAFTERS

    res = _bench_results(tmp_path / "results.json", BUNDLED_DRAFTERS["block"], {"chain": 2.5, "tree@4": 3.25})
    out = tmp_path / "p"
    rc = cli.main(["profile", "--draft", "block", "--device", "cpu", "--dtype", "float32", "--context", "24",
                   "--iters", "1", "--tau-json", str(res), "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rep = json.loads((out / "profile.json").read_text())
    assert rep["config"]["context"] == 24 and rep["drafters"][0]["kind"] == "block"
    assert rep["drafters"][0]["tau_source"] == str(res)
    ar, chain, tree = rep["methods"]
    assert (ar["method"], chain["method"], tree["method"]) == ("ar", "chain", "tree@4")
    assert (chain["rows"], chain["k"], tree["rows"], tree["nodes"]) == (3, 2, 5, 4)  # k + 1, N + 1 rows verified
    assert (chain["pending_rows"], tree["pending_rows"]) == (2, 3)  # round(tau) committed tokens fed per pass
    assert (chain["tau"], tree["tau"]) == (2.5, 3.25)
    for m in (chain, tree):
        assert m["draft_ms"] > 0 and m["verify_ms"] > 0
        assert m["pass_ms"] == pytest.approx(m["draft_ms"] + m["verify_ms"])
        assert m["predicted_tokens_per_s"] == pytest.approx(1e3 * m["tau"] / m["pass_ms"])
        assert m["predicted_speedup"] == pytest.approx(m["tau"] * rep["ar_ms"] / m["pass_ms"])
        assert m["break_even_tau"] == pytest.approx(m["pass_ms"] / rep["ar_ms"])
        # the bench's own figures ride along, to check the model against
        assert (m["measured_speedup"], m["measured_draft_ms"], m["measured_verify_ms"]) == (
            m["tau"] / 2, m["tau"] / 2, 2.0)
    best = max(rep["methods"], key=lambda m: m["predicted_tokens_per_s"])
    assert (rep["best"]["drafter"], rep["best"]["method"]) == (best["drafter"], best["method"])
    assert "| drafter | method | rows |" in cap.out and "**best**" in cap.out


def test_profile_draft_over_a_hybrid_target(tmp_path, capsys):
    """`tandem profile --target QWEN3.5 --draft DIR`: the hybrid target's verify passes are timed as
    the hybrid loop runs them (GDN paths from the committed state), ar included; a feature drafter
    or a Qwen3.5 draft over a hybrid target is a one-line error."""
    import sys

    from conftest import save_tiny_checkpoint

    sys.path.insert(0, str(Path(__file__).parent))
    from test_qwen3_5 import VOCAB, build_hf

    target, draft = tmp_path / "q35", tmp_path / "draft"
    save_tiny_checkpoint(draft, "llama", vocab_size=VOCAB)
    build_hf("default").save_pretrained(target)
    (target / "tokenizer.json").write_text((draft / "tokenizer.json").read_text())
    out = tmp_path / "p"
    rc = cli.main(["profile", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--dtype", "float32",
                   "--context", "24", "--iters", "1", "--nodes", "4", "--k", "2", "--no-plots", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rep = json.loads((out / "profile.json").read_text())
    assert rep["config"]["hybrid_target"] is True and rep["ar_ms"] > 0
    ar, chain, tree = rep["methods"]
    assert (chain["rows"], tree["rows"]) == (3, 5) and chain["verify_ms"] > 0 and tree["verify_ms"] > 0
    rc = cli.main(["profile", "--target", str(target), "--draft", "block", "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    rc = cli.main(["profile", "--target", str(target), "--draft", str(target), "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "a Qwen3.5 (hybrid) draft is not profiled yet" in err and len(err.strip().splitlines()) == 1, err


def test_profile_draft_errors(tmp_path, capsys):
    rc = cli.main(["profile", "--draft", str(tmp_path / "nowhere"), "--device", "cpu", "--out", str(tmp_path / "p")])
    assert rc == 2 and "--draft" in capsys.readouterr().err
    rc = cli.main(["profile", "--draft", "block", "--device", "cpu", "--replay", str(tmp_path / "r.json"),
                   "--out", str(tmp_path / "p")])
    assert rc == 2 and "--replay" in capsys.readouterr().err
    rc = cli.main(["profile", "--draft", "block", "--device", "cpu", "--nodes", "0", "--out", str(tmp_path / "p")])
    assert rc == 2 and "--nodes" in capsys.readouterr().err


@needs_bundled
def test_profile_draft_context_too_small(tmp_path, capsys):
    rc = cli.main(["profile", "--draft", "block", "--device", "cpu", "--context", "4", "--out", str(tmp_path / "p")])
    assert rc == 2 and "no room for a prefix" in capsys.readouterr().err
