"""Method `tlv` (two-level verification in the serial loop): greedy output equals `ar` token for token
on tiny models (graph path emulated too), with a useless Q model, and on the bundled pair in fp32;
the Q pass over W12's 8-bit view agrees with the exact pass most of the time; refusals are one line."""
from __future__ import annotations

import json

import pytest
import torch

from models_for_tests import noisy_copy, tiny_model
from tandem.cli import main
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.generate import Generator
from tandem.runtime.pair import load_pair

SPECS = [SpecConfig(nodes=1, width=1), SpecConfig(nodes=8, width=2), SpecConfig(nodes=16, width=4)]


def _prompts(seed: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 95, (n,), generator=rng).tolist() for n in (1, 6, 21)]


@pytest.mark.parametrize("graphs", [None, "emulate"])
def test_tlv_equals_ar_on_tiny_models(graphs):
    target = tiny_model(seed=0)
    engine = Generator(target, noisy_copy(target, 0.1), use_graphs=graphs)
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    agree = checked = passes = tokens = 0
    for prompt in _prompts(3):
        ref = engine.generate(prompt, "ar", gen=gen).token_ids
        for spec in SPECS:
            res = engine.generate(prompt, "tlv", spec, gen=gen)
            assert res.token_ids == ref and res.method == "tlv", (prompt, spec)
            assert res.q_passes == res.target_passes and sum(res.accept_lengths) + res.target_passes >= 40
            agree, checked = agree + res.q_agree, checked + res.q_checked
            passes, tokens = passes + res.target_passes, tokens + res.new_tokens
    # the Q pass (8-bit view of the target, its own KV cache) mostly picks the exact argmax: a wrong
    # Q cache would leave it near chance; and TLV commits well over one token per exact pass
    assert agree / checked > 0.7, agree / checked
    assert tokens / passes > 2.0, tokens / passes


def test_tlv_is_lossless_with_a_useless_q_pass():
    target = tiny_model(seed=0)
    engine = Generator(target, noisy_copy(target, 0.1))
    engine._runners["tlv-q-model"] = (target, tiny_model(seed=11))  # a Q model unrelated to the target
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    for prompt in _prompts(4):
        ref = engine.generate(prompt, "ar", gen=gen).token_ids
        res = engine.generate(prompt, "tlv", SPECS[1], gen=gen)
        assert res.token_ids == ref
        assert res.q_agreement < 0.5, res.q_agreement  # really a different model


def test_tlv_equals_ar_on_the_bundled_pair_fp32():
    pair = load_pair(dtype="float32")
    engine = Generator(pair.target, pair.draft, pair.tokenizer)
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    for text in ("def fib(n):", "class Stack:\n    def __init__(self):"):
        ids = pair.tokenizer.encode(text).ids
        ref = engine.generate(ids, "ar", gen=gen).token_ids
        res = engine.generate(ids, "tlv", SpecConfig(nodes=8, width=2), gen=gen)
        assert res.token_ids == ref and len(ref) == 24
        print(f"bundled pair, {text!r}: tlv tau {res.tau:.2f}, Q agreement {res.q_agreement:.2f}")


def test_tlv_refusals(tiny_checkpoint, capsys):
    target = tiny_model(seed=0)
    engine = Generator(target, noisy_copy(target, 0.1))
    with pytest.raises(ConfigError, match="greedy only"):
        engine.generate([1, 2], "tlv", sampling=SamplingConfig(temperature=0.7))
    with pytest.raises(ConfigError, match="does not replay"):
        engine.generate([1, 2], "tlv", forced_accepts=[1])
    with pytest.raises(ConfigError, match="needs a draft model"):
        Generator(target).generate([1, 2], "tlv")
    ckpt = str(tiny_checkpoint("llama", name="t"))
    base = ["generate", "hello", "--target", ckpt, "--draft", ckpt, "--max-new-tokens", "8", "--ignore-eos", "--json"]
    capsys.readouterr()
    outs = []
    for method in ("ar", "tlv"):
        assert main(base + ["--method", method]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[1]["token_ids"] == outs[0]["token_ids"] and outs[1]["method"] == "tlv" and "q_agreement" in outs[1]
    assert main(base + ["--method", "tlv", "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "greedy only" in err and len(err.strip().splitlines()) == 1
