"""The CUDA-graph step path (row buckets, padded rows on a scratch row, attention-width buckets,
staged inputs), emulated on the CPU: every method must still equal plain `ar`."""
from __future__ import annotations

import pytest
import torch

from models_for_tests import noisy_copy, tiny_model
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator


@pytest.fixture(scope="module")
def models():
    target = tiny_model(seed=0)
    return target, noisy_copy(target, 0.1)


@pytest.mark.parametrize("method,spec", [
    ("ar", SpecConfig()),
    ("chain", SpecConfig(k=4)),
    ("tree", SpecConfig(nodes=16, width=4)),
    ("async", SpecConfig(nodes=8, width=2)),
    ("async", SpecConfig(nodes=16, width=4, depth=3)),
])
def test_emulated_graph_path_equals_eager_ar(models, method, spec):
    target, draft = models
    eager = Generator(target, draft, use_graphs=False)
    graphs = Generator(target, draft, use_graphs="emulate")
    gen = GenerationConfig(max_new_tokens=100, ignore_eos=True)
    rng = torch.Generator().manual_seed(5)
    for n in (3, 40, 150):  # prompts below and above the largest row bucket (128)
        prompt = torch.randint(0, 95, (n,), generator=rng).tolist()
        ref = eager.generate(prompt, "ar", gen=gen).token_ids
        out = graphs.generate(prompt, method, spec=spec, gen=gen, transport="inline")
        assert out.token_ids == ref, (method, n)
