"""End to end: every method's greedy output equals `ar`, token for token; stops behave."""
from __future__ import annotations

import pytest
import torch

from models_for_tests import noisy_copy, tiny_model
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.generate import Generator

SPECS = [
    ("chain", SpecConfig(k=1)),
    ("chain", SpecConfig(k=4)),
    ("chain", SpecConfig(k=8)),
    ("tree", SpecConfig(nodes=1, width=1)),
    ("tree", SpecConfig(nodes=6, width=2, depth=2)),
    ("tree", SpecConfig(nodes=16, width=4)),
    ("tree", SpecConfig(nodes=32, width=3, depth=10)),
    ("tree", SpecConfig(nodes=64, width=8, depth=3)),
]


@pytest.fixture(scope="module")
def engines():
    target = tiny_model(seed=0)
    return {
        "close": Generator(target, noisy_copy(target, 0.1)),  # agrees often: long accepted paths
        "far": Generator(target, tiny_model(seed=7, hidden=32, layers=1)),  # agrees rarely
    }


@pytest.mark.parametrize("draft", ["close", "far"])
def test_greedy_equals_ar(engines, draft):
    g = engines[draft]
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    rng = torch.Generator().manual_seed(123)
    taus = []
    for _ in range(4):
        prompt = torch.randint(0, 95, (int(torch.randint(1, 30, (), generator=rng)),), generator=rng).tolist()
        ref = g.generate(prompt, "ar", gen=gen)
        assert ref.new_tokens == 40 and ref.tau == 1.0
        for method, spec in SPECS:
            out = g.generate(prompt, method, spec=spec, gen=gen)
            assert out.token_ids == ref.token_ids, (method, spec, prompt)
            assert sum(a + 1 for a in out.accept_lengths) >= out.new_tokens
            taus.append(out.tau)
    if draft == "close":
        assert max(taus) > 2.5  # the drafts really were accepted, so the tree/commit paths ran


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_equals_ar_other_families(family):
    target = tiny_model(seed=3, family=family)
    g = Generator(target, noisy_copy(target, 0.3))
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompt = [5, 17, 42, 9]
    ref = g.generate(prompt, "ar", gen=gen)
    for method, spec in (("chain", SpecConfig(k=5)), ("tree", SpecConfig(nodes=12, width=3))):
        assert g.generate(prompt, method, spec=spec, gen=gen).token_ids == ref.token_ids


def test_ar_matches_plain_full_forward_argmax():
    """`ar` itself against the simplest possible decoder: re-run the full prefix every step."""
    target = tiny_model(seed=5)
    prompt = [3, 1, 4, 1, 5]
    out = Generator(target).generate(prompt, "ar", gen=GenerationConfig(max_new_tokens=12, ignore_eos=True))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(target(torch.tensor([ids]))[0, -1].argmax()))
    assert out.token_ids == ids[len(prompt):]


def test_eos_stops_every_method_at_the_same_token():
    target = tiny_model(seed=0)
    g = Generator(target, noisy_copy(target, 0.3))
    free = g.generate([1, 2, 3], "ar", gen=GenerationConfig(max_new_tokens=30, ignore_eos=True))
    eos = free.token_ids[9]  # pretend the 10th generated token is EOS
    target.config = target.config.__class__(**{**target.config.__dict__, "eos_token_ids": (eos,)})
    first = free.token_ids.index(eos)
    for method in ("ar", "chain", "tree"):
        out = g.generate([1, 2, 3], method, gen=GenerationConfig(max_new_tokens=30))
        assert out.token_ids == free.token_ids[: first + 1]
        assert out.finish_reason == "eos"


def test_max_new_tokens_cuts_inside_an_accepted_path():
    target = tiny_model(seed=0)
    g = Generator(target, noisy_copy(target, 0.05))
    ref = g.generate([7, 8], "ar", gen=GenerationConfig(max_new_tokens=7, ignore_eos=True))
    out = g.generate([7, 8], "tree", spec=SpecConfig(nodes=16, width=2),
                     gen=GenerationConfig(max_new_tokens=7, ignore_eos=True))
    assert out.token_ids == ref.token_ids and out.new_tokens == 7 and out.finish_reason == "length"


class _CharTokenizer:
    """Decodes token t as chr(ord('a') + t % 26): enough to exercise stop strings."""

    def decode(self, ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_string_trims_text_and_stops_early():
    target = tiny_model(seed=0)
    g = Generator(target, noisy_copy(target, 0.3), tokenizer=_CharTokenizer())
    full = g.generate([1, 2], "ar", gen=GenerationConfig(max_new_tokens=30, ignore_eos=True))
    text = _CharTokenizer().decode(full.token_ids)
    stop = text[12:14]
    cut = text.find(stop)
    # ar keeps the tokens up to the one that completes the stop string; a speculative pass that
    # committed more keeps no more than that either (token ids, and so usage and logprobs)
    end = next(k for k in range(1, len(full.token_ids) + 1) if stop in _CharTokenizer().decode(full.token_ids[:k]))
    for method in ("ar", "chain", "tree"):
        out = g.generate([1, 2], method, gen=GenerationConfig(max_new_tokens=30, ignore_eos=True, stop=(stop,)))
        assert out.finish_reason == "stop"
        assert out.stop_trimmed_text == text[:cut]
        assert out.token_ids == full.token_ids[:end], method


def test_sampling_is_reproducible_with_a_seed():
    target = tiny_model(seed=0, scale=1.0)
    g = Generator(target, noisy_copy(target, 0.3))
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    for method in ("ar", "chain", "tree"):
        a = g.generate([4, 5], method, sampling=SamplingConfig(temperature=0.9, seed=11), gen=gen)
        b = g.generate([4, 5], method, sampling=SamplingConfig(temperature=0.9, seed=11), gen=gen)
        c = g.generate([4, 5], method, sampling=SamplingConfig(temperature=0.9, seed=12), gen=gen)
        assert a.token_ids == b.token_ids
        assert a.token_ids != c.token_ids


def test_bad_generation_arguments():
    g = Generator(tiny_model(seed=0))
    with pytest.raises(ConfigError, match="needs a draft model"):
        g.generate([1], "tree")
    with pytest.raises(ConfigError, match="unknown method"):
        g.generate([1], "beam")
    with pytest.raises(ConfigError, match="context window is 512"):
        g.generate(list(range(600)), "ar")
    with pytest.raises(ConfigError, match="max-new-tokens must be a positive"):
        g.generate([1], "ar", gen=GenerationConfig(max_new_tokens=0))
    with pytest.raises(ConfigError, match="temperature must be a finite number >= 0"):
        g.generate([1], "ar", sampling=SamplingConfig(temperature=-0.5))
