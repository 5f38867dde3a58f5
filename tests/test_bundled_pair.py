"""The bundled pair: loads, decodes like transformers, and speculates losslessly and usefully."""
from __future__ import annotations

import pytest
import torch

from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator
from tandem.runtime.pair import bundled_available, load_pair

PROMPTS = ["def fib(n):", "import os\n\n\ndef list_python_files(root):\n", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def pair():
    assert bundled_available(), "tandem/assets/pair is missing: the bundled pair must ship with the package"
    return load_pair()


@pytest.fixture(scope="module")
def engine(pair):
    return Generator(pair.target, pair.draft, pair.tokenizer)


def test_greedy_equals_transformers_greedy(pair, engine):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(pair.target_dir), dtype=torch.float32).eval()
    for text in PROMPTS:
        ids = pair.tokenizer.encode(text).ids
        ours = engine.generate(ids, "ar", gen=GenerationConfig(max_new_tokens=24, ignore_eos=True)).token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert ours == ref, text


def test_chain_and_tree_equal_ar_and_accept_long_paths(pair, engine):
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    taus = {"chain": [], "tree": []}
    for text in PROMPTS:
        ids = pair.tokenizer.encode(text).ids
        ref = engine.generate(ids, "ar", gen=gen).token_ids
        for method, spec in (("chain", SpecConfig(k=5)), ("tree", SpecConfig(nodes=32))):
            out = engine.generate(ids, method, spec=spec, gen=gen)
            assert out.token_ids == ref, (method, text)
            taus[method].append(out.tau)
    # The draft really predicts its target: well above one token per pass on code.
    assert sum(taus["chain"]) / 3 > 2.5 and sum(taus["tree"]) / 3 > 3.5, taus


def test_main_command_output_is_python_looking(pair, engine):
    ids = pair.tokenizer.encode("def fib(n):").ids
    text = pair.tokenizer.decode(engine.generate(ids, "tree", gen=GenerationConfig(max_new_tokens=32)).token_ids)
    assert "return" in text or "\n    " in text, text
