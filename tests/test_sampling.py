"""Statistical losslessness: with sampling, chain and tree draw from exactly the target's law.

For a tiny vocabulary the exact target distribution of the first generated token and of the
second token (marginalised over the first) is computable; the empirical frequencies over many
seeds must match it within a total-variation tolerance. With n = 800 draws over 12 outcomes
the expected TV of a correct sampler is about 0.035; the tolerance is 0.08, and a sampler that
draws from the draft instead (a plausible bug) lands far above it (checked below).
"""
from __future__ import annotations

import pytest
import torch

from models_for_tests import tiny_model
from tandem.config import GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.generate import Generator
from tandem.verify.sampling import probs_from_logits

V, N, TOL = 12, 800, 0.08
PROMPT = [3, 7, 1]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=0, vocab=V, scale=2.0)
    draft = tiny_model(seed=9, vocab=V, scale=2.0, hidden=32, layers=1)
    return target, draft


def exact(target, sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        p1 = probs_from_logits(target(torch.tensor([PROMPT]))[0, -1], sampling)  # [V]
        nxt = torch.stack([probs_from_logits(target(torch.tensor([PROMPT + [x]]))[0, -1], sampling)
                           for x in range(V)])  # [V, V]: p(x2 | x1)
    return p1, p1 @ nxt


def empirical(g: Generator, method: str, sampling: SamplingConfig, spec=SpecConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    c1, c2 = torch.zeros(V), torch.zeros(V)
    gen = GenerationConfig(max_new_tokens=2, ignore_eos=True)
    for seed in range(N):
        out = g.generate(PROMPT, method, spec=spec, sampling=SamplingConfig(sampling.temperature, sampling.top_p, seed),
                         gen=gen)
        c1[out.token_ids[0]] += 1
        c2[out.token_ids[1]] += 1
    return c1 / N, c2 / N


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("method,spec,sampling", [
    ("ar", SpecConfig(), SamplingConfig(temperature=1.0)),
    ("chain", SpecConfig(k=3), SamplingConfig(temperature=1.0)),
    ("tree", SpecConfig(nodes=6, width=3, depth=2), SamplingConfig(temperature=1.0)),
    ("chain", SpecConfig(k=2), SamplingConfig(temperature=0.7, top_p=0.8)),
    ("tree", SpecConfig(nodes=4, width=2, depth=2), SamplingConfig(temperature=0.7, top_p=0.8)),
])
def test_first_two_tokens_follow_the_target_distribution(pair, method, spec, sampling):
    target, draft = pair
    p1, p2 = exact(target, sampling)
    e1, e2 = empirical(Generator(target, draft), method, sampling, spec)
    assert tv(e1, p1) < TOL, (tv(e1, p1), e1, p1)
    assert tv(e2, p2) < TOL, (tv(e2, p2), e2, p2)


def test_the_tolerance_catches_a_sampler_that_follows_the_draft(pair):
    target, draft = pair
    sampling = SamplingConfig(temperature=1.0)
    p1, _ = exact(target, sampling)
    # "Generate" with the draft as if it were the target: what an always-accept bug produces.
    e1, _ = empirical(Generator(draft), "ar", sampling)
    assert tv(e1, p1) > 2 * TOL


@pytest.mark.parametrize("temperature,top_p", [(1e-38, 1.0), (1e-300, 0.5), (1.0, 1e-46), (0.7, 1e-300)])
def test_extreme_temperatures_and_top_p_give_the_argmax_not_nan(temperature, top_p):
    """Accepted values at the edge: a temperature so small that logits / T overflow fp32, a top_p
    below fp32's smallest number (it compares as 0). Each is the limit of its family: the point
    mass on the argmax (the server answered 500 with 'probability tensor contains nan')."""
    logits = torch.tensor([[1.0, 30.0, -5.0, 29.0], [-1e4, 0.0, 2.0, 1.0]])
    probs = probs_from_logits(logits, SamplingConfig(temperature=temperature, top_p=top_p, seed=0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))
