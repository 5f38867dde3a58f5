"""`--certified-head` in the serial loop: greedy ar / chain / tree verified through the certified INT8
LM head give the same tokens as without it (tiny models, the bundled pair in fp32, the graph path's
CPU emulation, the CLI), the head really runs, the full head comes back after each request, and
sampling / async are refused with one-line errors."""
from __future__ import annotations

import json

import pytest
import torch

from models_for_tests import noisy_copy, tiny_model
from tandem.cli import main
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.quant.int8_head import CertifiedHead
from tandem.runtime.generate import Generator
from tandem.runtime.pair import load_pair

RUNS = [("ar", SpecConfig()), ("chain", SpecConfig(k=4)), ("tree", SpecConfig(nodes=16, width=4))]


def _outputs(engine: Generator, prompts, gen) -> dict:
    return {(m, i): engine.generate(p, m, spec, gen=gen).token_ids for m, spec in RUNS for i, p in enumerate(prompts)}


@pytest.mark.parametrize("graphs", [None, "emulate"])
def test_tiny_models_certified_equals_plain(graphs):
    target = tiny_model(seed=0)
    draft = noisy_copy(target, 0.1)
    full = target.lm_head
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 95, (n,), generator=rng).tolist() for n in (1, 7, 23)]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    want = _outputs(Generator(target, draft, use_graphs=graphs), prompts, gen)
    engine = Generator(target, draft, use_graphs=graphs, certified_head=True)
    got = _outputs(engine, prompts, gen)
    assert got == want and all(len(v) == 30 for v in got.values())
    assert target.lm_head is full  # the full head is back after every request
    assert engine._runners["target-certified"].use_graphs == (graphs == "emulate")
    # the certified head is what verification reads: count its calls over one more request
    calls = []
    hook = target.certified_head_cache.register_forward_hook(lambda mod, inp, out: calls.append(out.shape[0]))
    res = engine.generate(prompts[1], "tree", RUNS[2][1], gen=gen)
    hook.remove()
    assert res.token_ids == want[("tree", 1)]
    assert len(calls) == res.target_passes + 1  # one prefill chunk, then one per verify pass
    # and the plain engine never touches it
    calls.clear()
    hook = target.certified_head_cache.register_forward_hook(lambda mod, inp, out: calls.append(1))
    Generator(target, draft).generate(prompts[1], "ar", gen=gen)
    hook.remove()
    assert calls == []


def test_bundled_pair_fp32_certified_equals_plain():
    pair = load_pair(dtype="float32")
    prompts = [pair.tokenizer.encode(p).ids for p in ("def fib(n):", "class Stack:\n    def __init__(self):")]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    want = _outputs(Generator(pair.target, pair.draft, pair.tokenizer), prompts, gen)
    got = _outputs(Generator(pair.target, pair.draft, pair.tokenizer, certified_head=True), prompts, gen)
    assert got == want and all(len(v) == 24 for v in got.values())
    assert got[("tree", 0)] == got[("ar", 0)] and got[("chain", 1)] == got[("ar", 1)]  # fp32: lossless vs ar too
    assert not isinstance(pair.target.lm_head, CertifiedHead)


def test_refusals():
    target = tiny_model(seed=0)
    engine = Generator(target, noisy_copy(target, 0.1), certified_head=True)
    with pytest.raises(ConfigError, match="greedy decoding"):
        engine.generate([1, 2, 3], "tree", sampling=SamplingConfig(temperature=0.8))
    with pytest.raises(ConfigError, match="not 'async'"):
        engine.generate([1, 2, 3], "async")
    assert not isinstance(target.lm_head, CertifiedHead)


def test_cli_flag(tiny_checkpoint, capsys):
    ckpt = str(tiny_checkpoint("llama", name="t"))
    base = ["generate", "hello", "--target", ckpt, "--draft", ckpt, "--max-new-tokens", "8", "--ignore-eos"]
    capsys.readouterr()
    outs = []
    for extra in ([], ["--certified-head"]):
        assert main(base + ["--method", "tree", "--json"] + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 8
    code = main(base + ["--method", "tree", "--certified-head", "--temperature", "0.7"])
    err = capsys.readouterr().err
    assert code == 2 and "--certified-head is for greedy decoding" in err and len(err.strip().splitlines()) == 1
