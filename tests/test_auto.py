"""`--method auto`: the measured choice, the cost model's shallower shapes (predicted, then
confirmed by measurement), its fallback to ar, and exact output whatever it picks."""
from __future__ import annotations

import dataclasses
import re

import pytest

from models_for_tests import noisy_copy, tiny_model
from tandem.config import GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.auto import AutoChoice, AutoSelector, Candidate, TrialRun, level_costs, levels_of, shallower
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
    assert err.count("tandem: auto:") == 2  # trials on requests 1 and 2, printed with the measured rates
    choice, sel = eng.auto.choice, eng.auto
    scores = sel.scores()
    assert choice.label == max(scores, key=scores.get)  # the best score over the paired trials
    assert len(sel.ratios["ar"]) == 2 and sel.ratios["ar"] == [1.0, 1.0]
    assert {"ar", "chain", "tree"} <= set(choice.rates)
    # every shape it measured beyond the three was one the cost model predicted to beat them all
    for label in set(choice.rates) - {"ar", "chain", "tree"}:
        assert choice.predicted[label] > max(choice.rates[m] for m in ("ar", "chain", "tree"))


def test_auto_without_a_draft_is_ar():
    res = Generator(tiny_model(seed=3)).generate([1, 2, 3], "auto", gen=GenerationConfig(max_new_tokens=5))
    assert res.method == "ar"


def test_auto_falls_back_to_ar_when_the_drafter_stops_paying_and_retrials():
    sel = AutoSelector(retrial_every=10, early_trials=(), verbose=False)
    sel.choice, sel.requests = AutoChoice("tree", {"ar": 100.0, "tree": 150.0}, "test"), 1
    sel.rates = {"ar": 100.0, "tree": 150.0}
    assert sel.choose(None, [1], SpecConfig(), None).method == "tree"
    sel.update("tree", 40.0)  # 0.5 * 40 + 0.5 * 150 = 95: below ar, but within the 0.9 fallback margin
    assert sel.rates["tree"] == 95.0 and sel.choose(None, [1], SpecConfig(), None).method == "tree"
    sel.update("tree", 20.0)  # a workload the drafter does not know: 0.5 * 20 + 0.5 * 95 = 57.5 < 90
    assert sel.choose(None, [1], SpecConfig(), None).method == "ar"
    sel.update("tree", 200.0)  # it pays again: 0.5 * 200 + 0.5 * 57.5 = 128.75 > 100
    assert sel.choose(None, [1], SpecConfig(), None).method == "tree"
    assert sel.requests == 5  # the next (the 6th) is no trial; the 10th (retrial_every) is


def test_shallower_shapes_are_predicted_from_the_measured_run():
    """Hand-computed: a tree of depth 4 measured at 100 tok/s, accepting 3, 1, 0, 2 drafts over
    four passes (deepest offered 4), 0.4 s drafting and 0.2 s verifying a pass. At depth 2 the
    accepts count at most 2: tau 1 + (2 + 1 + 0 + 2) / 4 = 2.25 against 1 + 6 / 4 = 2.5, and the
    pass costs 0.4 * 2 / 4 + 0.2 = 0.4 s against 0.6: 100 * 2.25 / 2.5 * 0.6 / 0.4 = 135."""
    base = Candidate("tree", SpecConfig(nodes=32, width=4, depth=4), "tree")
    run = TrialRun(100.0, [3, 1, 0, 2], draft_per_pass=0.4, verify_per_pass=0.2, deepest=4)
    pred = {c.label: (c, r) for c, r in shallower(base, run)}
    assert sorted(pred) == ["tree d=1", "tree d=2", "tree d=3"]
    assert pred["tree d=2"][1] == pytest.approx(135.0)
    assert pred["tree d=2"][0].spec == SpecConfig(nodes=32, width=4, depth=2)
    # depth 1: tau 1 + (1 + 1 + 0 + 1) / 4 = 1.75, cost 0.1 + 0.2 = 0.3: 100 * 1.75 / 2.5 * 0.6 / 0.3 = 140
    assert pred["tree d=1"][1] == pytest.approx(140.0)
    # a chain of 3: k = 1, 2 (each accept counts at most k)
    chain = shallower(Candidate("chain", SpecConfig(k=3), "chain"),
                      TrialRun(90.0, [3, 3, 0], draft_per_pass=0.3, verify_per_pass=0.1, deepest=3))
    got = {c.label: r for c, r in chain}
    # k = 1: tau 1 + 2/3 against 1 + 2; cost 0.1 + 0.1 against 0.4: 90 * (5/3) / 3 * 2 = 100
    assert got == {"chain k=1": pytest.approx(100.0), "chain k=2": pytest.approx(90 * (1 + 4 / 3) / 3 * 0.4 / 0.3)}
    # nothing to predict without the run's per-pass times, or for ar
    assert shallower(base, dataclasses.replace(run, draft_per_pass=None)) == []
    assert shallower(Candidate("ar", SpecConfig(), "ar"), run) == []


class _Timed:
    """A real Generator whose trial rates come from a table (the decision is what is tested; the
    runs themselves are real and their per-pass figures are replaced by the table's)."""

    def __init__(self, gen: Generator, table: dict[tuple[str, int | None], TrialRun]):
        self.gen, self.table = gen, table

    def __call__(self, generator, ids, cands, greedy, gen, warm):
        out = {}
        for c in cands:
            generator.generate(ids, c.method, c.spec, greedy, gen)  # the shape really runs
            out[c.label] = self.table[(c.method, c.spec.depth if c.method == "tree" else c.spec.k)]
        return out


def test_trial_confirms_a_predicted_shape_before_choosing_it(capsys, monkeypatch):
    target = tiny_model(seed=3)
    eng = Generator(target, noisy_copy(target, 0.05))
    spec = SpecConfig(k=4, nodes=16, width=2, depth=4)
    # the deep tree pays less than ar: its last levels are seldom accepted and cost a draft pass each
    table = {("ar", 4): TrialRun(100.0), ("chain", 4): TrialRun(80.0, [1, 0, 2, 1], 0.4, 0.1, 4),
             ("tree", 4): TrialRun(90.0, [1, 1, 2, 0], 0.6, 0.2, 4),
             ("tree", 1): TrialRun(120.0), ("tree", 2): TrialRun(95.0), ("tree", 3): TrialRun(91.0),
             ("chain", 1): TrialRun(99.0), ("chain", 2): TrialRun(85.0), ("chain", 3): TrialRun(81.0)}
    monkeypatch.setattr(AutoSelector, "_measure", staticmethod(_Timed(eng, table)))
    g = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    want = Generator(target).generate([1, 5, 9, 2], "ar", gen=g).token_ids
    res = eng.generate([1, 5, 9, 2], "auto", spec, gen=g)
    choice = eng.auto.choice
    # tree d=1: tau 1 + 3/4 against 2, cost 0.15 + 0.2 against 0.8: 90 * 0.875 * 0.8 / 0.35 = 180 predicted
    assert choice.predicted["tree d=1"] == pytest.approx(90 * 0.875 * 0.8 / 0.35)
    assert choice.label == "tree d=1" and choice.spec == dataclasses.replace(spec, depth=1)
    assert res.method == "tree" and res.token_ids == want  # the chosen shape ran, and equals ar
    assert "tandem: auto: tree d=1 (trial" in capsys.readouterr().err
    # the predictions above the best measured rate (100) were measured, at most `confirm` of them
    assert set(choice.rates) == {"ar", "chain", "tree", "tree d=1", "chain k=1"}
    # a later request keeps its own spec, cut to the chosen depth
    later = eng.auto.choose(eng, [3, 3], dataclasses.replace(spec, nodes=12), SamplingConfig())
    assert later == Candidate("tree", SpecConfig(k=4, nodes=12, width=2, depth=1), "tree d=1")


def test_auto_with_sampling_runs_the_chosen_shape_sampled():
    """The trial samples as the request does (tokens thrown away); the request then is exactly
    the chosen method and shape under the request's own seed."""
    target = tiny_model(seed=3)
    eng = Generator(target, noisy_copy(target, 0.05))
    spec, sampling = SpecConfig(k=3, nodes=8, width=2), SamplingConfig(temperature=0.8, seed=11)
    g = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    res = eng.generate([1, 5, 9, 2], "auto", spec, sampling, g)
    c = eng.auto.choice  # the trial's pick: this first request ran it
    shape = {"chain": dataclasses.replace(spec, k=c.spec.k), "tree": dataclasses.replace(spec, depth=c.spec.depth),
             "ar": spec}[c.method] if c.label != c.method else spec
    assert res.method == c.method
    assert eng.generate([1, 5, 9, 2], c.method, shape, sampling, g).token_ids == res.token_ids


def test_a_confirmed_shape_that_disappoints_is_not_chosen(monkeypatch):
    target = tiny_model(seed=3)
    eng = Generator(target, noisy_copy(target, 0.05))
    table = {("ar", 2): TrialRun(100.0), ("chain", 2): TrialRun(70.0, [2, 2, 2, 2], 0.2, 0.1, 2),
             ("tree", 2): TrialRun(60.0, [0, 1, 0, 0], 0.5, 0.1, 2), ("chain", 1): TrialRun(50.0),
             ("tree", 1): TrialRun(80.0)}  # predicted 60 * (1.25 / 1.25) * 0.6 / 0.35 = 103: measured 80
    monkeypatch.setattr(AutoSelector, "_measure", staticmethod(_Timed(eng, table)))
    res = eng.generate([1, 5, 9, 2], "auto", SpecConfig(k=2, nodes=8, width=2, depth=2),
                       gen=GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert eng.auto.choice.label == "ar" and res.method == "ar"
    assert eng.auto.choice.rates["tree d=1"] == 80.0


def test_only_level_drafters_get_shallower_shapes():
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    assert levels_of(tiny_model(seed=1)) and not levels_of(None)
    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled pair")
    assert not levels_of(load_pair(None, "block", device="cpu").draft)  # one pass proposes every depth
    assert levels_of(load_pair(None, "eagle3", device="cpu").draft)


@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize("method,spec", [("chain", SpecConfig(k=1)), ("chain", SpecConfig(k=2)),
                                         ("tree", SpecConfig(nodes=32, width=4, depth=1)),
                                         ("tree", SpecConfig(nodes=32, width=4, depth=2))])
def test_the_shallow_shapes_auto_may_pick_equal_ar(resident, method, spec):
    target = tiny_model(seed=3)
    g = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    eng = Generator(target, noisy_copy(target, 0.05), use_graphs=False, resident=resident)
    for p in ([1, 5, 9, 2], list(range(3, 60))):
        got = eng.generate(p, method, spec, gen=g)
        assert got.token_ids == Generator(target).generate(p, "ar", gen=g).token_ids
        assert got.loop == ("resident" if resident else "host") and got.tau > 1.0


def test_paired_trials_on_the_first_requests_are_averaged(capsys, monkeypatch):
    """One prompt can mislead: trials on requests 1, 2 and 4 each pair every candidate with ar on
    that request's prompt, and the choice is the best mean ratio to ar."""
    target = tiny_model(seed=3)
    eng = Generator(target, noisy_copy(target, 0.05))
    per_trial = [{"ar": 100.0, "chain": 80.0, "tree": 77.0},  # a prompt the drafter does badly on
                 {"ar": 120.0, "chain": 108.0, "tree": 180.0},
                 {"ar": 100.0, "chain": 85.0, "tree": 60.0}]
    trials = []

    def measure(generator, ids, cands, sampling, gen, warm):
        table = per_trial[len(trials)]
        trials.append(ids)
        return {c.label: TrialRun(table[c.label]) for c in cands}  # (no per-pass figures: no predictions)

    monkeypatch.setattr(AutoSelector, "_measure", staticmethod(measure))
    g = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    spec = SpecConfig(k=3, nodes=8, width=2)
    picked = []
    for i in range(4):
        eng.generate([1, 5, 9, 2 + i], "auto", spec, gen=g)
        picked.append(eng.auto.choice.label)
    # request 1: ar (chain 0.80x, tree 0.77x); request 2: tree (mean (0.77 + 1.5) / 2 = 1.135);
    # request 3 keeps it (no trial); request 4: ar again (tree (0.77 + 1.5 + 0.6) / 3 = 0.957)
    assert picked == ["ar", "tree", "tree", "ar"]
    assert len(trials) == 3 and [t[-1] for t in trials] == [2, 3, 5]  # each on its own request's prompt
    assert eng.auto.ratios["tree"] == pytest.approx([0.77, 1.5, 0.6])
    assert "over 3 trials: ar 1.00x, chain 0.85x, tree 0.96x" in capsys.readouterr().err


def test_level_costs_split_the_draft_into_a_fixed_part_and_levels():
    """A chain of 5 drafting 0.332 ms a pass and a tree of 8 levels 0.512 ms (the EAGLE-3 head's
    figures on the H100): 0.06 ms a level and 0.032 fixed. A tree of 5 then drafts
    0.512 - 3 x 0.06 = 0.332 ms (0.320 in proportion)."""
    spec = SpecConfig(k=5, nodes=32, width=4)  # depth 8
    chain, tree = TrialRun(1.0, draft_per_pass=0.332e-3), TrialRun(1.0, draft_per_pass=0.512e-3)
    fixed, per = level_costs(chain, tree, spec)
    assert per == pytest.approx(0.06e-3) and fixed == pytest.approx(0.032e-3)
    run = TrialRun(100.0, [8, 8], draft_per_pass=0.512e-3, verify_per_pass=0.3e-3, deepest=8)
    base = Candidate("tree", spec, "tree")
    got = {c.label: r for c, r in shallower(base, run, (fixed, per))}
    # every pass accepts all 8: at depth 5 tau 6 against 9, cost 0.332 + 0.3 against 0.812
    assert got["tree d=5"] == pytest.approx(100 * 6 / 9 * 0.812 / 0.632)
    # a line with a negative part (the draft model's 0.602 at k = 5, 0.995 at d = 8) is no line
    assert level_costs(TrialRun(1.0, draft_per_pass=0.602e-3), TrialRun(1.0, draft_per_pass=0.995e-3), spec) is None
    assert level_costs(chain, tree, SpecConfig(k=8, nodes=32, width=4)) is None  # the same depth: no line


def test_bench_reports_what_auto_ran(tmp_path):
    """`tandem bench --methods ar,auto`: each request records the candidate auto ran, and the
    summary counts them (results.json and results.md)."""
    import json

    from tandem import cli
    from tandem.runtime.pair import BUNDLED_TARGET

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled pair")
    out = tmp_path / "b"
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return"}) + "\n" for i in range(3)))
    assert cli.main(["bench", "--workload", str(src), "--num-prompts", "3", "--max-new-tokens", "8", "--methods", "ar,auto",
                     "--warmup", "0", "--no-plots", "--allow-mismatch", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    picks = res["summary"]["auto"]["auto_picks"]
    assert sum(picks.values()) == 3
    assert all(re.fullmatch(r"ar|chain|tree|chain k=\d+|tree d=\d+", p) for p in picks), picks
    assert [r["auto_pick"] for r in res["requests"] if r["method"] == "auto"] and "What `auto` ran" in \
        (out / "results.md").read_text()


def test_bench_runs_auto_trials_on_the_workload_not_on_the_warm_up(tmp_path, capsys):
    """The bench's warm-up requests (its longest prompts) must not be where auto decides: after the
    warm-up the selector starts again, so trial 1 runs on measured request 1 and trial 2 on request 2."""
    import json

    from tandem import cli
    from tandem.runtime.pair import BUNDLED_TARGET

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled pair")
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"def g{i}(x):\n    return"}) + "\n" for i in range(3)))
    assert cli.main(["bench", "--workload", str(src), "--num-prompts", "3", "--max-new-tokens", "8", "--methods",
                     "auto", "--warmup", "1", "--no-plots", "--allow-mismatch", "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    trials = re.findall(r"trial (\d+), on request (\d+)", err)
    # the warm-up's request 1, then the measured requests 1 and 2 (trials on requests 1, 2 and 4)
    assert trials == [("1", "1"), ("1", "1"), ("2", "2")], trials
    sel = AutoSelector(verbose=False)
    sel.requests, sel.trials, sel.rates = 5, [{"ar": 1.0}], {"ar": 9.0}
    sel.reset()
    assert (sel.requests, sel.trials, sel.rates, sel.choice) == (0, [], {}, None)


def test_on_cuda_only_a_candidates_first_trial_has_a_warm_up_run():
    """A warm-up run captures a candidate's graphs; later trials measure it at once (on CUDA the
    selector asks for warm-ups by label; the measurements here come from a table)."""
    import types

    import torch

    warmed = []

    def measure(generator, ids, cands, sampling, gen, warm):
        warmed.append(sorted(warm))
        return {c.label: TrialRun(100.0 if c.label == "ar" else 90.0) for c in cands}

    sel = AutoSelector(verbose=False)
    sel._measure = measure
    gpu = types.SimpleNamespace(draft_model=tiny_model(seed=1), context_window=512,
                                target_model=types.SimpleNamespace(device=torch.device("cuda")))
    for _ in range(2):
        sel.choose(gpu, [1, 2, 3], SpecConfig(), SamplingConfig())
    assert warmed == [["ar", "chain", "tree"], []]


def test_a_shape_that_joined_late_is_scored_by_its_paired_difference():
    """A cut shape is measured from the trial that confirmed it on, so it may have missed the
    hard prompts. Its score is its method's mean plus its mean difference from that method on the
    trials that measured both: tree 0.52, 0.86, 0.87 (mean 0.75) and `tree d=4` 1.07 in the third
    trial only (+0.20 over the tree there) score 0.95, below ar, not 1.07 (the draft model on
    GSM8K, H100, 2026-12-06)."""
    sel = AutoSelector(verbose=False)
    d4 = Candidate("tree", SpecConfig(depth=4), "tree d=4")
    sel.shapes = {"ar": Candidate("ar", SpecConfig(), "ar"), "tree": Candidate("tree", SpecConfig(), "tree"),
                  "tree d=4": d4}
    sel.trials = [{"ar": 1.0, "tree": 0.52}, {"ar": 1.0, "tree": 0.86}, {"ar": 1.0, "tree": 0.87, "tree d=4": 1.07}]
    got = sel.scores()
    assert got["ar"] == 1.0 and got["tree"] == pytest.approx(0.75)
    assert got["tree d=4"] == pytest.approx(0.75 + 0.20)
    assert max(got, key=got.get) == "ar"
