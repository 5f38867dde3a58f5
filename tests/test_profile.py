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
