"""`tandem audit`: token forcing passes a correct method and catches a deliberately faulty verifier.

The fault is the documented hook `run_audit(..., fault_bias=(token_id, value))`: the target's
logits get `value` added at `token_id` during the method's generation only, as a buggy
verifier would. The scorer (fp32 LM head, no fault) disagrees with the tokens it produced.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem import cli
from tandem.bench import audit
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.pair import load_pair

PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, x):\n", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory) -> Path:
    from conftest import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("audit") / "target", "llama_untied", seed=0)


@pytest.fixture(scope="module")
def pair(pair_dir):
    # draft = target: speculation accepts often, so verification decides many tokens per pass
    return load_pair(pair_dir, pair_dir)


def _ids(pair):
    return [pair.tokenizer.encode(p).ids for p in PROMPTS]


GEN = GenerationConfig(max_new_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("method", ["chain", "tree", "async", "tlv"])
def test_correct_method_passes(pair, method):
    rep = audit.run_audit(_ids(pair), method, SpecConfig(k=3, nodes=8, width=2), GEN, pair)
    assert rep["passed"], rep["reasons"]
    assert rep["candidate"]["tokens"] == rep["ar"]["tokens"] == 16 * len(PROMPTS)
    assert rep["candidate"]["large_events"] == 0
    assert rep["delta"] == 0.125  # fp32 on CPU: ar agrees with the scorer everywhere
    assert all(o["ar"] == o[method] for o in rep["outputs"]) and rep["outputs_differing_from_ar"] == 0


@pytest.mark.parametrize("method", ["chain", "tree", "async", "tlv"])
def test_faulty_verifier_is_caught(pair, method):
    rep = audit.run_audit(_ids(pair), method, SpecConfig(k=3, nodes=8, width=2), GEN, pair, fault_bias=(65, 5.0))
    assert not rep["passed"]
    assert rep["fault_bias"] == [65, 5.0]
    c = rep["candidate"]
    assert c["mismatches"] > 0 and c["large_events"] > 0
    assert rep["rate_excess_pp"] > 0.5
    assert any("large event" in r for r in rep["reasons"])
    ev = c["events"][0]
    assert ev["token"] == 65 and ev["argmax"] != 65 and ev["margin"] >= 2 * rep["delta"]
    # the hook is scoped to the method's generation: the model is intact afterwards
    assert "forward" not in vars(pair.target)
    assert audit.run_audit(_ids(pair)[:1], method, SpecConfig(k=3, nodes=8, width=2), GEN, pair)["passed"]


def test_delta_rounds_up_to_eighths():
    def scored(margins):
        s = audit.Scored("ar", tokens=100)
        s.events = [audit.Event(0, i, 1, 2, m) for i, m in enumerate(margins)]
        return s

    assert audit.compute_delta(scored([])) == 0.125
    assert audit.compute_delta(scored([0.01, 0.2])) == 0.25
    assert audit.compute_delta(scored([0.25])) == 0.25
    assert audit.compute_delta(scored([0.0])) == 0.125
    assert len(scored([0.1, 0.3, 0.6]).large(0.25)) == 1


def test_score_output_uses_fp32_head(pair):
    ids = _ids(pair)[0]
    m = pair.target
    with torch.inference_mode():
        h = m.hidden_states(torch.tensor([ids]))[0, -1]
        best = int((h.float() @ m.lm_head.weight.float().T).argmax())
    assert audit.score_output(m, ids, [best]) == []
    (ev,) = audit.score_output(m, ids, [(best + 1) % 256])
    assert ev.argmax == best and ev.margin > 0 and ev.position == 0


def test_audit_cli_writes_json(pair_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rc = cli.main(["audit", "--method", "tree", "--target", str(pair_dir), "--draft", str(pair_dir),
                   "--workload", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8", "--nodes", "6",
                   "--out", str(tmp_path / "a")])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert {"environment", "config", "method", "delta", "large_threshold", "ar", "candidate", "rate_excess_pp",
            "passed", "reasons", "outputs", "prompts"} <= set(rep)
    assert {"tokens", "mismatches", "mismatch_rate", "large_events", "max_margin", "events"} <= set(rep["candidate"])
    assert rep["passed"] and "PASS" in capsys.readouterr().out
    assert cli.main(["audit", "--target", str(pair_dir), "--temperature", "0.7", "--workload", str(prompts)]) == 2
