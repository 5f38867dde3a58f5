"""GPU lane: `tlv` (Q pass over the 8-bit view, CUDA graphs on all three runners) and `--certified-head`
(eager target runner, fp32 accumulation in the head) decode what an uncached forward says, on the
bundled pair in fp32; the certified head's tokens equal the full head's. On the CPU the same loop runs
on tiny models with the graph path emulated."""
from __future__ import annotations

import pytest

from gpu_lane import bundled_pair, cpu, cuda, first_wrong_token, graphs_for
from models_for_tests import noisy_copy, tiny_model
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator

CASES = [("tlv", SpecConfig(nodes=8, width=2), False), ("tree", SpecConfig(nodes=16, width=4), True),
         ("ar", SpecConfig(), True)]


def _pair(device: str):
    if device == "cuda":
        return bundled_pair("cuda")
    target = tiny_model(seed=0)
    return target, noisy_copy(target, 0.1), [[5, 17, 3, 88], list(range(20, 60)), [7] * 3]


@pytest.mark.parametrize("method,spec,certified", CASES, ids=["tlv", "tree-certified", "ar-certified"])
@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
def test_matches_an_uncached_forward(device, method, spec, certified):
    target, draft, prompts = _pair(device)
    plain = Generator(target, draft, use_graphs=graphs_for(device))
    engine = Generator(target, draft, use_graphs=graphs_for(device), certified_head=certified)
    gen = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    taus = []
    for prompt in prompts:
        r = engine.generate(prompt, method, spec, gen=gen)
        assert r.new_tokens == 64
        wrong = first_wrong_token(target, prompt, r.token_ids)
        assert wrong is None, (method, prompt[:8], wrong)
        if certified:
            assert r.token_ids == plain.generate(prompt, method, spec, gen=gen).token_ids
        taus.append(r.tau)
        if method == "tlv":
            print(f"{device} tlv: tau {r.tau:.2f}, Q agreement {r.q_agreement:.2f}, {r.tokens_per_s:.1f} tok/s")
    if method != "ar":
        assert sum(taus) / len(taus) > 1.5
