"""GPU lane: the device-resident loop (CUDA graphs of the whole step) decodes what an uncached
forward says, and accepts what the host-driven loop accepts.

On the GPU: the bundled pair's target with its trained block drafter in fp32, real graphs;
on the CPU: a tiny model and a random block drafter, the bodies run eagerly."""
from __future__ import annotations

import pytest

from gpu_lane import PROMPTS, cpu, cuda, first_wrong_token, graphs_for
from models_for_tests import tiny_model
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator


def _pair(device: str):
    if device == "cuda":
        from tandem.runtime.pair import load_pair

        pair = load_pair(None, "block", device="cuda", dtype="float32")
        return pair.target, pair.draft, [pair.tokenizer.encode(p).ids for p in PROMPTS]
    from test_block_drafter import make_drafter

    target = tiny_model(seed=3)
    return target, make_drafter(target), [[5, 17, 3, 88], list(range(10, 90))]


@pytest.mark.parametrize("method,spec", [("ar", SpecConfig()), ("chain", SpecConfig(k=8)),
                                         ("tree", SpecConfig(nodes=32))], ids=["ar", "chain", "tree"])
@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
def test_resident_loop_matches_an_uncached_forward_and_the_host_loop(device, method, spec):
    target, draft, prompts = _pair(device)
    res = Generator(target, draft, use_graphs=graphs_for(device), resident=True)
    host = Generator(target, draft, use_graphs=graphs_for(device), resident=False)
    gen = GenerationConfig(max_new_tokens=96, ignore_eos=True)
    for prompt in prompts:
        r = res.generate(prompt, method, spec, gen=gen)
        assert r.new_tokens == 96
        wrong = first_wrong_token(target, prompt, r.token_ids)
        assert wrong is None, (method, prompt[:8], wrong)
        h = host.generate(prompt, method, spec, gen=gen)
        if h.token_ids == r.token_ids:  # (a near-tie may split them; then the passes differ too)
            assert r.accept_lengths == h.accept_lengths
        if device == "cuda" and method != "ar":
            assert r.tau > 1.5  # the trained drafter's trees were accepted deep
