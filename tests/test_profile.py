"""`tandem profile` on CPU with the tiny preset: the documented profile.json keys and the prediction."""
from __future__ import annotations

import dataclasses
import json

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
    assert "best node budget" in capsys.readouterr().out


def test_profile_without_tau_and_errors(tmp_path, capsys):
    rc = cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "16",
                   "--rows", "1,2", "--widths", "1", "--width", "1", "--iters", "1", "--no-plots",
                   "--out", str(tmp_path / "p")])
    assert rc == 0
    rep = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert rep["tau"] is None and rep["prediction"] == [] and rep["best_nodes"] is None
    assert cli.main(["profile", "--preset", "tiny", "--device", "cpu", "--tau-json", str(tmp_path / "missing.json")]) == 2
    assert "--tau-json" in capsys.readouterr().err


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
