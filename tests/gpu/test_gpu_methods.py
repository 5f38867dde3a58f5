"""GPU lane: `ar`, `tree` and `async` (two CUDA streams) decode what an uncached forward says.

Every new token must be the argmax of a plain causal forward (no KV cache, no graphs, no tree
masks) over the tokens before it, up to a near-tie: what bench/gpu_async_check.py checks per
target pass. On the GPU: the bundled pair in fp32 with CUDA graphs and device rounds; `async`
with the self-tuned depth and with d = 2 expansion rounds queued on the draft's stream while
the target's pass runs on its own. On the CPU the same loop runs on tiny models, graphs
emulated, `async` over the inline transport.
"""
from __future__ import annotations

import pytest

from gpu_lane import bundled_pair, cpu, cuda, first_wrong_token, graphs_for
from models_for_tests import noisy_copy, tiny_model
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator

CASES = [
    ("ar", SpecConfig()),
    ("tree", SpecConfig(nodes=32, width=4)),
    ("async", SpecConfig(nodes=32, width=4)),  # self-tuned depth
    ("async", SpecConfig(nodes=32, width=4, depth=2)),  # rounds overlap every verify
]


def _pair(device: str):
    if device == "cuda":
        return bundled_pair("cuda")
    target = tiny_model(seed=0)
    return target, noisy_copy(target, 0.1), [[5, 17, 3, 88], list(range(20, 60)), [7] * 3]


@pytest.mark.parametrize("method,spec", CASES, ids=["ar", "tree", "async", "async-d2"])
@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
def test_method_matches_an_uncached_forward(device, method, spec):
    target, draft, prompts = _pair(device)
    engine = Generator(target, draft, use_graphs=graphs_for(device))
    transport = "streams" if device == "cuda" else "inline"
    gen = GenerationConfig(max_new_tokens=96, ignore_eos=True)
    taus = []
    for prompt in prompts:
        r = engine.generate(prompt, method, spec, gen=gen, transport=transport)
        assert r.new_tokens == 96
        wrong = first_wrong_token(target, prompt, r.token_ids)
        assert wrong is None, (method, prompt[:8], wrong)
        taus.append(r.tau)
        if method == "async":
            assert r.stats["transport"] == transport
            if spec.depth:
                assert r.stats["mean_rounds"] > 0  # the draft did expand while the target verified
    if method != "ar":
        assert sum(taus) / len(taus) > 1.5  # drafts were accepted: the tree masks were exercised
