"""`--method auto`: the measured choice, its fallback to ar, and exact output whatever it picks."""
from __future__ import annotations

from models_for_tests import noisy_copy, tiny_model
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.auto import AutoChoice, AutoSelector
from tandem.runtime.generate import Generator


def test_auto_output_equals_ar_and_names_the_method_it_ran(capsys):
    target = tiny_model(seed=3)
    eng = Generator(target, noisy_copy(target, 0.05))
    g = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    for prompt in ([1, 5, 9, 2], [4, 4, 8]):
        want = Generator(target).generate(prompt, "ar", gen=g).token_ids
        res = eng.generate(prompt, "auto", SpecConfig(k=4, nodes=8), gen=g)
        assert res.token_ids == want
        assert res.method in ("ar", "chain", "tree")
    err = capsys.readouterr().err
    assert err.count("tandem: auto:") == 1  # one trial per engine, printed with the measured rates
    assert eng.auto.choice.method == max(eng.auto.choice.rates, key=eng.auto.choice.rates.get)
    assert set(eng.auto.choice.rates) == {"ar", "chain", "tree"}


def test_auto_without_a_draft_is_ar():
    res = Generator(tiny_model(seed=3)).generate([1, 2, 3], "auto", gen=GenerationConfig(max_new_tokens=5))
    assert res.method == "ar"


def test_auto_falls_back_to_ar_when_the_drafter_stops_paying_and_retrials():
    sel = AutoSelector(retrial_every=5, verbose=False)
    sel.choice, sel.requests = AutoChoice("tree", {"ar": 100.0, "tree": 150.0}, "test"), 1
    sel.rates = {"ar": 100.0, "tree": 150.0}
    assert sel.choose(None, [1], SpecConfig(), None) == "tree"
    sel.update("tree", 40.0)  # a workload the drafter does not know: 0.5 * 40 + 0.5 * 150 = 95 < 100
    assert sel.rates["tree"] == 95.0
    assert sel.choose(None, [1], SpecConfig(), None) == "ar"
    sel.update("tree", 200.0)  # it pays again: 0.5 * 200 + 0.5 * 95 = 147.5 > 100
    assert sel.choose(None, [1], SpecConfig(), None) == "tree"
    assert sel.requests == 4  # the 5th (retrial_every) runs the trial again
