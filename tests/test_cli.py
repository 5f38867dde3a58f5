"""`tandem generate`: JSON output, streaming, and one-line errors (exit 2, no traceback)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tandem.cli import main


@pytest.fixture
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", name="t")


def run_cli(args, capsys):
    capsys.readouterr()  # drop output of earlier set-up (e.g. transformers' save progress bars)
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_has_the_documented_keys(ckpt, capsys):
    code, out, err = run_cli(["generate", "hello", "--target", str(ckpt), "--draft", str(ckpt), "--method", "tree",
                              "--max-new-tokens", "8", "--ignore-eos", "--json"], capsys)
    assert code == 0, err
    rec = json.loads(out)
    for key in ("text", "token_ids", "prompt_tokens", "new_tokens", "method", "tau", "target_passes", "seconds",
                "tokens_per_s"):
        assert key in rec
    assert rec["new_tokens"] == len(rec["token_ids"]) == 8 and rec["method"] == "tree"
    code, out2, _ = run_cli(["generate", "hello", "--target", str(ckpt), "--method", "ar", "--max-new-tokens", "8",
                             "--ignore-eos", "--json"], capsys)
    assert json.loads(out2)["token_ids"] == rec["token_ids"] and json.loads(out2)["tau"] == 1.0
    assert "auto_pick" not in rec  # only auto says which candidate it ran
    code, out3, err3 = run_cli(["generate", "hello", "--target", str(ckpt), "--draft", str(ckpt), "--max-new-tokens",
                                "8", "--ignore-eos", "--json"], capsys)  # the default method: auto
    auto = json.loads(out3)
    assert auto["token_ids"] == rec["token_ids"] and auto["auto_pick"].split()[0] == auto["method"]
    assert f"tandem: auto: {auto['auto_pick']} (trial 1" in err3


def test_plain_mode_streams_text_and_reports_stats(ckpt, capsys):
    code, out, err = run_cli(["generate", "hi", "--target", str(ckpt), "--draft", str(ckpt), "--method", "chain",
                              "--max-new-tokens", "5", "--ignore-eos"], capsys)
    assert code == 0
    assert "[chain: 5 tokens" in err and "tau" in err


def _bad(capsys, args, needle):
    code, out, err = run_cli(args, capsys)
    assert code == 2
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("tandem: error:") and needle in line, line
    return line


def test_bad_inputs_get_one_line_errors(ckpt, tmp_path, tiny_checkpoint, capsys):
    t = str(ckpt)
    _bad(capsys, ["generate", "x", "--target", str(tmp_path / "nope")], "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _bad(capsys, ["generate", "x", "--target", str(empty)], "no config.json")
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "config.json").write_text("{not json")
    _bad(capsys, ["generate", "x", "--target", str(broken)], "not valid JSON")
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(ckpt, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    _bad(capsys, ["generate", "x", "--target", str(gpt2)], "unsupported architecture")
    other = tiny_checkpoint("llama", name="other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab["zz" + first] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    _bad(capsys, ["generate", "x", "--target", t, "--draft", str(other)], "different tokenizers")
    _bad(capsys, ["generate", "x" * 400, "--target", t, "--method", "ar"], "context window")
    _bad(capsys, ["generate", "x", "--target", t, "--method", "ar", "--max-new-tokens", "0"], "positive integer")
    _bad(capsys, ["generate", "x", "--target", t, "--method", "ar", "--temperature", "-1"],
         "temperature must be a finite number >= 0")
    _bad(capsys, ["generate", "x", "--target", t, "--method", "ar", "--top-p", "0"], "top-p")
    _bad(capsys, ["generate", "--target", t, "--method", "ar"], "no prompt")
    _bad(capsys, ["generate", "--prompt-file", str(tmp_path / "missing.txt"), "--target", t], "cannot read --prompt-file")
    import torch

    if not torch.cuda.is_available():
        _bad(capsys, ["generate", "x", "--target", t, "--device", "cuda"], "no CUDA GPU")


def test_python_dash_m_works_the_same(ckpt):
    r = subprocess.run([sys.executable, "-m", "tandem", "generate", "abc", "--target", str(ckpt), "--method", "ar",
                        "--max-new-tokens", "4", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["new_tokens"] == 4
    r = subprocess.run([sys.executable, "-m", "tandem", "generate", "abc", "--target", "/no/such/dir"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "does not exist" in r.stderr


def test_the_default_drafter_is_the_eagle3_head_on_a_gpu_only(monkeypatch):
    """Without --target and --draft, `generate` drafts with the bundled EAGLE-3 head on CUDA for auto, chain
    and tree (the measured fastest there), and with the bundled draft model on the CPU, for the methods
    that need a draft model (async, tlv), and with the certified head."""
    from tandem.runtime import pair

    for method in ("auto", "chain", "tree", "ar", "async", "tlv"):
        assert pair.default_drafter(method, "cpu") is None
    monkeypatch.setattr(pair.torch.cuda, "is_available", lambda: True)  # (only the device's name is resolved)
    assert [pair.default_drafter(m, "cuda") for m in ("auto", "chain", "tree")] == ["eagle3"] * 3
    assert pair.default_drafter("async", "cuda") is None and pair.default_drafter("tlv", "cuda") is None
    assert pair.default_drafter("tree", "cuda", certified_head=True) is None
    assert pair.default_drafter("tree", "auto") == "eagle3"  # --device auto with a GPU visible
    assert pair.GPU_DEFAULT_DRAFTER in pair.BUNDLED_DRAFTERS
