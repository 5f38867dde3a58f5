"""The batched engine end to end: concurrent requests give exactly their solo `ar` outputs
(greedy, fp32), through chunked prefill, preemption, prefix caching and aborts; `tandem.LLM`."""
from __future__ import annotations

import json

import pytest
import torch

from models_for_tests import assert_clean, noisy_copy, run_all, tiny_model
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.gate_arms import GateArms
from tandem.engine.request import RequestState, SamplingParams
from tandem.runtime.generate import Generator

MAX_NEW = 24


@pytest.fixture(scope="module")
def models():
    target = tiny_model(seed=0)
    return target, noisy_copy(target, 0.1)


@pytest.fixture(scope="module")
def solo(models):
    """32 prompts (1-40 tokens) and each one's solo greedy `ar` output."""
    target, draft = models
    g = Generator(target, draft)
    rng = torch.Generator().manual_seed(2024)
    prompts = [torch.randint(0, 95, (int(torch.randint(1, 41, (), generator=rng)),), generator=rng).tolist()
               for _ in range(32)]
    gen = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    return prompts, [g.generate(p, "ar", gen=gen).token_ids for p in prompts]


@pytest.mark.parametrize("method,spec", [("ar", SpecConfig()), ("tree", SpecConfig(nodes=8, width=2)),
                                         ("chain", SpecConfig(k=4))])
def test_32_concurrent_requests_equal_their_solo_ar_outputs(models, solo, method, spec):
    prompts, refs = solo
    # a budget of 96 rows splits the longer prompts into chunks that share passes with trees
    engine = Engine(*models, config=EngineConfig(method=method, spec=spec, block_size=8, max_num_batched_tokens=96,
                                                 debug_check=True))
    outs = run_all(engine, prompts)
    assert [o.token_ids for o in outs] == refs
    assert all(o.finish_reason == "length" for o in outs)
    assert_clean(engine)
    if method != "ar":  # the drafts were accepted, so the tree commit paths ran
        assert max(o.tau for o in outs) > 2.0
        assert sum(o.figures.accepted_tokens for o in outs) > 0
    else:
        assert all(o.tau == 1.0 and o.figures.draft_tokens == 0 for o in outs)
    assert all(o.figures.ttft is not None and o.figures.target_passes >= 1 for o in outs)


@pytest.mark.parametrize("method,spec", [("ar", SpecConfig()), ("tree", SpecConfig(nodes=8, width=2)),
                                         ("chain", SpecConfig(k=4))])
def test_graph_bucketed_passes_equal_their_solo_ar_outputs(models, solo, method, spec, monkeypatch):
    """Every pass padded to its CUDA-graph bucket (emulated on the CPU: the same static buffers,
    padding rows writing the scratch slot, logits picked from every row's), the target's and the
    batched drafter's alike: outputs equal the solo ar outputs and the pool stays clean."""
    from tandem.engine import batched_draft, batched_model, engine as engine_mod

    made = []

    class Emulated(batched_model.BatchedModel):
        def __init__(self, *a, **k):
            k["use_graphs"] = "emulate"
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(engine_mod, "BatchedModel", Emulated)
    monkeypatch.setattr(batched_draft, "BatchedModel", Emulated)
    prompts, refs = solo
    engine = Engine(*models, config=EngineConfig(method=method, spec=spec, block_size=8, max_num_batched_tokens=96,
                                                 debug_check=True))
    outs = run_all(engine, prompts)
    assert [o.token_ids for o in outs] == refs
    assert_clean(engine)
    assert len(made) == (1 if method == "ar" else 2) and all(m.use_graphs and m._graphs for m in made)
    if method != "ar":  # the draft trees (a greedy chain: the width-1 tree) ran over their captures' buffers
        assert engine.batched.tree_graphs and any(engine.batched._trees.values())


@pytest.mark.parametrize("method", ["ar", "tree"])
def test_a_tiny_block_budget_forces_preemptions_and_outputs_stay_exact(models, solo, method):
    prompts, refs = solo
    # 30 blocks of 4 rows: room for about two long requests at a time
    cfg = EngineConfig(method=method, spec=SpecConfig(nodes=8, width=2), block_size=4, num_blocks=30,
                       max_num_batched_tokens=64, debug_check=True)
    engine = Engine(*models, config=cfg)
    outs = run_all(engine, prompts[:12])
    assert [o.token_ids for o in outs] == refs[:12]
    assert sum(o.figures.preemptions for o in outs) > 0
    assert_clean(engine)


@pytest.mark.parametrize("method", ["ar", "tree"])
def test_a_request_that_raises_in_its_part_of_a_step_fails_alone(models, solo, method):
    """fault_hook raises for every fourth request on its third decoding step: those end with
    finish_reason "error" (their blocks freed), every other request equals its solo output."""
    prompts, refs = solo
    engine = Engine(*models, config=EngineConfig(method=method, spec=SpecConfig(nodes=8, width=2), block_size=8,
                                                 debug_check=True))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in prompts[:16]]
    doomed = {r.request_id for r in reqs[3::4]}
    seen: dict[str, int] = {}

    def hook(req):
        seen[req.request_id] = seen.get(req.request_id, 0) + 1
        if req.request_id in doomed and seen[req.request_id] == 3:
            raise RuntimeError("injected")

    engine.fault_hook = hook
    done = {o.request_id: o for o in engine.run()}
    for r, ref in zip(reqs, refs):
        out = done[r.request_id]
        if r.request_id in doomed:
            assert out.finish_reason == "error" and r.state == RequestState.ABORTED
        else:
            assert out.finish_reason == "length" and out.token_ids == ref
    assert engine.counters.failed == len(doomed) == 4
    assert_clean(engine)


@pytest.mark.parametrize("method,spec", [("chain", SpecConfig(k=4)), ("tree", SpecConfig(nodes=8, width=2))])
@pytest.mark.parametrize("selection", [False, True])
def test_batched_drafting_keeps_outputs_exact(models, solo, selection, method, spec):
    """Greedy chains and trees of the draft model drafted for all requests at once
    (engine.batched_draft): outputs equal solo ar; a chain proposes what each request's own
    drafter proposes (the same accepted tokens); a tree (EAGLE-2's level tree, not the
    per-request best-first rounds) is accepted deep too; preemptions and aborts leave the draft
    pool empty."""
    prompts, refs = solo
    outs = {}
    for batched in (True, False):
        cfg = EngineConfig(method=method, spec=spec, block_size=4, num_blocks=40,
                           max_num_batched_tokens=64, debug_check=True, batched_drafting=batched,
                           row_selection=selection, draft_gate=False)
        engine = Engine(*models, config=cfg)
        assert (engine.batched is not None) == batched
        reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in prompts[:12]]
        engine.step()
        engine.abort(reqs[5].request_id)  # an abort while its chain rows are in the draft pool
        done = {o.request_id: o for o in engine.run()}
        outs[batched] = [done[r.request_id] for r in reqs if r.request_id in done]
        assert_clean(engine)
        if batched:
            assert engine.batched.pool.seqs == {} and engine.batched.pool.num_free == engine.batched.pool.num_blocks
            assert sum(o.figures.preemptions for o in outs[batched]) > 0  # the small pool preempted some
    kept = [i for i in range(12) if i != 5]
    assert [o.token_ids for o in outs[True]] == [refs[i] for i in kept]
    if method == "chain":
        assert [o.figures.accepted_tokens for o in outs[True]] == [o.figures.accepted_tokens for o in outs[False]]
    else:
        assert max(o.tau for o in outs[True]) > 2.0


def test_prefix_cache_serves_a_repeated_prompt_and_the_output_is_unchanged(models, solo):
    prompts, refs = solo
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    engine = Engine(*models, config=EngineConfig(method="tree", spec=SpecConfig(nodes=8, width=2), block_size=4))
    first = run_all(engine, [prompts[i]])[0]
    second = run_all(engine, [prompts[i]])[0]
    assert first.token_ids == second.token_ids == refs[i]
    assert first.figures.cached_tokens == 0
    assert second.figures.cached_tokens == (len(prompts[i]) - 1) // 4 * 4 > 0
    assert engine.pool.stats.hits > 0
    assert_clean(engine)


def test_aborts_at_every_phase_leave_the_pool_clean(models, solo):
    prompts, refs = solo
    long = [p for p in prompts if len(p) > 20][:3]
    cfg = EngineConfig(method="tree", spec=SpecConfig(nodes=8, width=2), block_size=4, num_blocks=24,
                       max_num_seqs=4, max_num_batched_tokens=16, debug_check=True)
    engine = Engine(*models, config=cfg)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in long + prompts[:5]]
    engine.step()
    waiting = next(r for r in reqs if r.state is RequestState.WAITING)
    prefilling = next(r for r in reqs if r.state is RequestState.RUNNING and r.in_prefill)
    assert engine.abort(waiting.request_id) and engine.abort(prefilling.request_id)
    while not any(r.output_ids for r in reqs if r.state is RequestState.RUNNING):
        engine.step()
    decoding = next(r for r in reqs if r.output_ids and r.state is RequestState.RUNNING)
    assert engine.abort(decoding.request_id)
    preempted = None
    while engine.has_unfinished() and preempted is None:
        engine.step()
        preempted = next((r for r in reqs if r.state is RequestState.WAITING and r.figures.preemptions), None)
    assert preempted is not None and engine.abort(preempted.request_id)  # waiting again, with output
    rest = engine.run()
    assert {o.request_id for o in rest}.isdisjoint({waiting.request_id, prefilling.request_id,
                                                     decoding.request_id, preempted.request_id})
    assert not engine.abort(rest[0].request_id) and not engine.abort("no-such-request")  # finished / unknown
    aborted = [waiting, prefilling, decoding, preempted]
    assert all(r.state is RequestState.ABORTED and r.finish_reason == "abort" for r in aborted)
    for o in rest:  # the survivors are still exact
        assert o.token_ids == refs[prompts.index(o.prompt_token_ids)]
    assert_clean(engine)


def test_sampled_ar_equals_the_single_request_loop_with_the_same_seed(models, solo):
    prompts, _ = solo
    target, draft = models
    g = Generator(target, draft)
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=11)
    refs = [g.generate(p, "ar", sampling=sampling, gen=GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
            for p in prompts[:6]]
    engine = Engine(target, None, config=EngineConfig(method="ar"))
    outs = run_all(engine, prompts[:6], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11,
                                                       ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert_clean(engine)


def test_sampled_tree_finishes_and_stops_at_eos(models, solo):
    prompts, _ = solo
    engine = Engine(*models, config=EngineConfig(method="tree", spec=SpecConfig(nodes=6, width=2), debug_check=True))
    outs = run_all(engine, prompts[:4], SamplingParams(max_tokens=40, temperature=1.0, seed=3))
    eos = models[0].config.eos_token_ids[0]
    for o in outs:
        assert o.finish_reason in ("eos", "length") and 1 <= len(o.token_ids) <= 40
        assert (o.finish_reason == "eos") == (o.token_ids[-1] == eos) and eos not in o.token_ids[:-1]
    assert_clean(engine)


@pytest.mark.parametrize("method,spec", [("tree", SpecConfig(nodes=6, width=2)), ("chain", SpecConfig(k=3))])
def test_sampled_batched_drafts_keep_the_targets_distribution(models, method, spec):
    """Sampled requests draft in batches (engine.batched_draft): point-mass trees, or chains drawn
    from the draft's q and carrying it; rejection sampling keeps the target's law: the first token
    of 400 seeds of one prompt, all in one batch, against the target's distribution (total
    variation within the sampling noise)."""
    import math

    from tandem.verify.sampling import probs_from_logits

    target, draft = models
    prompt = [5, 17, 3, 88, 41]
    with torch.no_grad():
        p = probs_from_logits(target(torch.tensor([prompt]))[0, -1], SamplingConfig(temperature=1.0))
    engine = Engine(target, draft, config=EngineConfig(method=method, spec=spec, max_num_seqs=64, debug_check=True))
    assert engine.batched is not None
    n = 400
    reqs = [engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=s, ignore_eos=True))
            for s in range(n)]
    done = {o.request_id: o for o in engine.run()}
    counts = torch.zeros(p.shape[0])
    for r in reqs:
        counts[done[r.request_id].token_ids[0]] += 1
    noise = 0.5 * float((2 / (math.pi * n) * p * (1 - p)).sqrt().sum())
    tv = 0.5 * float((counts / n - p).abs().sum())
    assert tv < 1.3 * noise + 0.02, (tv, noise)
    assert sum(done[r.request_id].figures.draft_tokens for r in reqs) > 0  # drafts were verified
    assert_clean(engine)


def test_bad_requests_are_one_line_config_errors(models):
    engine = Engine(*models, config=EngineConfig(method="ar", num_blocks=4, block_size=4))
    with pytest.raises(ConfigError, match="prompt is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ConfigError, match="context window is 512"):
        engine.add_request([1] * 600, SamplingParams())
    with pytest.raises(ConfigError, match="max_tokens must be a positive integer"):
        engine.add_request([1], SamplingParams(max_tokens=0))
    # prompt ids and params of the wrong kind are refused at the door: one bad request would fail every step
    for ids, params, msg in (([10 ** 6], SamplingParams(), r"prompt token ids must be in \[0, "),
                             ([-1], SamplingParams(), r"must be in \[0, "),
                             ("def f():", SamplingParams(), "a list of int token ids"),
                             ([5.7, 6.2], SamplingParams(), "a list of int token ids"),
                             (torch.tensor([1, 2]), SamplingParams(), "a list of int token ids"),
                             ([1], None, "params must be a SamplingParams")):
        with pytest.raises(ConfigError, match=msg):
            engine.add_request(ids, params)
    assert not engine.has_unfinished()
    with pytest.raises(ConfigError, match="temperature must be a finite number"):
        engine.add_request([1], SamplingParams(temperature=-1.0))
    for bad, field in (({"top_p": 0.0}, "top_p must be"), ({"seed": "x"}, "seed must be an integer or None (got 'x')"),
                       ({"stop": [""]}, "stop must be non-empty strings"), ({"max_tokens": 2.5}, "max_tokens must")):
        with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
            SamplingParams(**bad)  # refused where it is written, as vLLM's SamplingParams
    with pytest.raises(ConfigError, match="needs 5 KV blocks but the pool has 4"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=8))
    with pytest.raises(ConfigError, match="needs a draft model"):
        Engine(models[0], None, config=EngineConfig(method="tree"))
    with pytest.raises(ConfigError, match="unknown engine method 'async'"):
        Engine(*models, config=EngineConfig(method="async"))
    assert not engine.has_unfinished()


def test_llm_on_the_bundled_pair_equals_tandem_generate_ar(capsys):
    from tandem import LLM, SamplingParams as SP
    from tandem.cli import main
    from tandem.runtime.pair import bundled_available

    if not bundled_available():
        pytest.skip("the bundled pair is not in this checkout")
    prompts = ["def fib(n):", "import os\n"]
    outs = LLM().generate(prompts, SP(max_tokens=8))
    for prompt, out in zip(prompts, outs):
        assert main(["generate", prompt, "--method", "ar", "--max-new-tokens", "8", "--json"]) == 0
        ref = json.loads(capsys.readouterr().out)
        assert out.token_ids == ref["token_ids"] and out.text == ref["text"]
        assert out.finish_reason == ref["finish_reason"] and out.prompt == prompt
        assert out.figures.target_passes >= 1 and out.figures.ttft > 0
    # a stop string taken from the middle of the first output: cut before it, reason "stop"
    text = outs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = LLM(method="ar").generate(prompts[0], SP(max_tokens=8, stop=stop))[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.find(stop)]
    # a tree step that commits tokens past the stop string keeps none of them, as ar
    spec = LLM(method="tree").generate(prompts[0], SP(max_tokens=8, stop=stop))[0]
    assert (spec.token_ids, spec.text, spec.finish_reason) == (cut.token_ids, cut.text, "stop")
    # token-id prompts (one, or a list of them) decode as their text does; other prompts are refused
    llm = LLM(method="ar")
    ids = llm.tokenizer.encode(prompts[0]).ids
    assert [o.token_ids for o in llm.generate(ids, SP(max_tokens=8)) + llm.generate([ids, ids], SP(max_tokens=8))] \
        == [outs[0].token_ids] * 3
    for bad, msg in (([ids, 1.5], "a prompt is text, a list of int token ids, or a dict"),
                     ([[10 ** 9]], r"must be in \[0, ")):
        with pytest.raises(ConfigError, match=msg):
            llm.generate(bad)
    assert not llm.engine.has_unfinished()
    from tandem import EngineConfig, SpecConfig  # (the API's names at the top level)
    with pytest.raises(ConfigError, match="method='ar' and engine_config.method='chain' differ"):
        LLM(method="ar", engine_config=EngineConfig(method="chain"))
    assert LLM(engine_config=EngineConfig(method="chain"), spec=SpecConfig(k=3)).engine.config.method == "chain"
    # a last pass cut by max_tokens counts the drafts it kept only
    for n in (1, 2, 3):
        short = LLM(method="tree").generate(prompts[0], SP(max_tokens=n))[0]
        assert len(short.token_ids) == n and short.figures.accepted_tokens <= n


def test_llm_speaks_vllms_dialect(capsys, monkeypatch, caplog):
    """What a vLLM user writes works: sampling without a seed differs between requests (seed None,
    vLLM's default; a given seed repeats), {"prompt"} / {"prompt_token_ids"} prompts, the
    `sampling_params` and `use_tqdm` keywords, `outputs[0]` with finish_reason "stop" for an EOS and
    stop_reason for a stop string, `finished`, `model=`, dtype "auto", get_tokenizer(); a request
    id the caller took is never generated again."""
    from tandem import LLM, SamplingParams as SP
    from tandem.runtime.pair import bundled_available

    if not bundled_available():
        pytest.skip("the bundled pair is not in this checkout")
    llm = LLM(method="ar", dtype="auto")
    hot = SP(max_tokens=4, temperature=2.0)
    outs = llm.generate(["def fib(n):"] * 8, hot, use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # (a fixed default seed gave 8 equal samples)
    seeded = [llm.generate("def fib(n):", sampling_params=SP(max_tokens=4, temperature=2.0, seed=7))[0].token_ids
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert "Processed requests" in capsys.readouterr().err  # (the progress bar, on by default)
    ref = llm.generate("import os\n", SP(max_tokens=6), use_tqdm=False)[0]
    ids = llm.get_tokenizer().encode("import os\n").ids
    for prompt in ({"prompt": "import os\n"}, {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}]):
        assert llm.generate(prompt, SP(max_tokens=6), use_tqdm=False)[0].token_ids == ref.token_ids
    for bad in ({"prompt": ids}, {"text": "x"}, {"prompt": "x", "prompt_token_ids": ids}):
        with pytest.raises(ConfigError, match="prompt"):
            llm.generate(bad, use_tqdm=False)
    out = ref.outputs[0]
    assert ref.finished and out.index == 0 and (out.text, out.token_ids) == (ref.text, ref.token_ids)
    stop = ref.text[2:4]
    cut = llm.generate("import os\n", SP(max_tokens=6, stop=[" @@", stop]), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop == cut.stop_reason
    # n completions a prompt (pass@k): n requests, seeds 7, 8, 9 for seed 7; one output with n choices
    three = llm.generate(["def fib(n):", "import os\n"], SP(max_tokens=4, temperature=2.0, seed=7, n=3),
                         use_tqdm=False)
    assert [len(o.outputs) for o in three] == [3, 3] and [c.index for c in three[0].outputs] == [0, 1, 2]
    assert three[0].outputs[0].token_ids == seeded[0]  # (the first sample is seed 7's)
    again = llm.generate("def fib(n):", SP(max_tokens=4, temperature=2.0, seed=8), use_tqdm=False)[0]
    assert three[0].outputs[1].token_ids == again.token_ids
    assert len({tuple(c.token_ids) for c in three[0].outputs}) > 1
    import logging
    with caplog.at_level(logging.WARNING, logger="tandem"):
        greedy = llm.generate("def fib(n):", SP(max_tokens=4, n=2), use_tqdm=False)[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids
    assert any("n > 1 with temperature 0 gives n equal greedy completions" in r.getMessage() for r in caplog.records)
    assert LLM().engine.config.method == "ar"  # (the CPU's default: the engine's tree lost to ar there)
    eng = llm.engine
    with pytest.raises(ConfigError, match="n=2: the engine runs one completion per request"):
        eng.add_request(ids, SP(max_tokens=2, n=2))
    eng.add_request(ids, SP(max_tokens=2), request_id="req-999999")
    with pytest.raises(ConfigError, match="request_id must be a string"):
        eng.add_request(ids, SP(max_tokens=2), request_id=5)
    import tandem.engine.request as rq
    monkeypatch.setattr(rq, "_IDS", iter([999999, 1000000]))  # (the next generated id is one the caller holds)
    assert eng.add_request(ids, SP(max_tokens=2)).request_id == "req-1000000"
    eng.run()
    with pytest.raises(ConfigError, match="model and target name the same checkpoint"):
        LLM(target="a", model="b")
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        LLM(dtype="fp8")


def test_generation_config_eos_ids_end_the_output(tiny_checkpoint):
    """An instruct checkpoint lists its end-of-turn ids in generation_config.json; transformers'
    generate stops at any of them, and so does Tandem (they were read from config.json only)."""
    from tandem import LLM, SamplingParams as SP

    d = tiny_checkpoint("llama")
    llm = LLM(target=d, method="ar")
    free = llm.generate([5, 6, 7], SP(max_tokens=6, ignore_eos=False), use_tqdm=False)[0]
    assert len(free.token_ids) == 6 and free.finish_reason == "length"
    end = free.token_ids[2]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, end]}))
    stopped = LLM(target=d, method="ar").generate([5, 6, 7], SP(max_tokens=6), use_tqdm=False)[0]
    assert stopped.token_ids == free.token_ids[:3] and stopped.finish_reason == "eos"
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason is None  # (vLLM's shape)
    # max_tokens None: up to the context window, as vLLM
    window = llm.engine.context_window
    full = llm.generate([5, 6, 7], SP(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(full.token_ids) == window - 3 and full.finish_reason == "length"


_SNIPPETS = ["def fib(n):\n", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
             "def merge_sort(xs):\n", "def is_prime(n):\n    ", "for i in range(10):\n    ",
             "def parse_args(argv):\n    import argparse\n", "with open(path) as f:\n    "]


@pytest.mark.parametrize("kind,method,spec,modes", [
    ("block", "tree", SpecConfig(nodes=32), {}), ("block", "chain", SpecConfig(k=8), {}),
    ("eagle3", "tree", SpecConfig(nodes=16, width=4), {}),
    ("eagle3", "tree", SpecConfig(nodes=16, width=4), {"batched_drafting": False}),
    ("eagle3", "chain", SpecConfig(k=5), {}),
    ("eagle3", "tree", SpecConfig(nodes=16, width=4), {"batch_parallel": True, "row_selection": True}),
    ("block", "tree", SpecConfig(nodes=32), {"batched_drafting": False}),
    ("block", "tree", SpecConfig(nodes=32), {"batch_parallel": True, "row_selection": True})],
    ids=["block-tree", "block-chain", "eagle3-tree", "eagle3-tree-per-request", "eagle3-chain",
         "eagle3-tree-batch-parallel-selection", "block-tree-per-request", "block-tree-batch-parallel-selection"])
def test_32_concurrent_requests_with_a_feature_drafter_equal_their_solo_ar_outputs(kind, method, spec, modes):
    """The bundled target with its block drafter / EAGLE-3 head in the engine (fp32): the batched
    pass keeps every row's target features, each request's drafter reads its own."""
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    pair = load_pair(None, kind, device="cpu", dtype=torch.float32)
    prompts = [pair.tokenizer.encode(f"# case {i}\n" + _SNIPPETS[i % 8]).ids for i in range(32)]
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    solo = Generator(pair.target, None, use_graphs=False)
    refs = [solo.generate(p, "ar", gen=gen).token_ids for p in prompts]
    engine = Engine(pair.target, pair.draft, config=EngineConfig(method=method, spec=spec, block_size=16,
                                                                 max_num_batched_tokens=512, debug_check=True,
                                                                 **modes))
    outs = run_all(engine, prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert_clean(engine)
    assert sum(o.tau for o in outs) / len(outs) > 1.5  # the drafters' proposals were accepted
    from tandem.engine.batched_features import BatchedBlockDrafter, BatchedEagleDrafter

    batched = {"eagle3": BatchedEagleDrafter, "block": BatchedBlockDrafter}[kind]
    assert isinstance(engine.batched, batched) == modes.get("batched_drafting", True)
    if engine.batched is not None:
        assert engine.batched.pool.seqs == {} and engine.batched.pending == {}  # every request released
    if modes.get("batch_parallel"):
        assert engine.counters.batch_parallel_steps > 0 and engine.counters.nodes_offered > 0


def test_deterministic_mode_gives_one_output_alone_in_a_batch_and_with_speculation():
    """--deterministic (tandem.engine.invariant): in bf16 a request's greedy output is
    bit-identical alone, among 7 other requests, and with or without speculation; in fp32 it
    equals the single-request loop's `ar`."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 95, (30,), generator=g).tolist()
    others = [torch.randint(0, 95, (int(torch.randint(1, 60, (), generator=g)),), generator=g).tolist()
              for _ in range(7)]
    for dtype in (torch.bfloat16, torch.float32):
        t, d = tiny_model(seed=0).to(dtype), noisy_copy(tiny_model(seed=0), 0.1).to(dtype)  # fresh: runners fuse weights
        outs = set()
        for method in ("ar", "tree"):
            for n in (1, 8):
                e = Engine(t, d if method != "ar" else None,
                           config=EngineConfig(method=method, spec=SpecConfig(nodes=8, width=2), block_size=8,
                                               deterministic=True, debug_check=True))
                req = e.add_request(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
                for o in others[:n - 1]:
                    e.add_request(o, SamplingParams(max_tokens=48, ignore_eos=True))
                done = {x.request_id: x for x in e.run()}
                outs.add(tuple(done[req.request_id].token_ids))
                assert_clean(e)
        assert len(outs) == 1, dtype
        if dtype == torch.float32:
            want = Generator(t, None).generate(prompt, "ar", gen=GenerationConfig(max_new_tokens=48, ignore_eos=True))
            assert list(outs.pop()) == want.token_ids


def test_batch_invariant_pieces_give_a_row_the_same_bits_whatever_shares_its_pass():
    """The two reductions deterministic mode replaces: a row's linear output over 1 row or among
    37, and a row's attention whether its visible columns sit first or are scattered among
    invisible ones (a tree node's ancestors) and whatever other rows are gathered with it."""
    from tandem.engine import invariant

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        lin = torch.nn.Linear(64, 96).to(dtype)
        x = torch.randn(37, 64, generator=g).to(dtype)
        full = invariant.rowwise(lin, x[None])[0]
        for i in (0, 5, 36):
            assert torch.equal(invariant.rowwise(lin, x[i:i + 1][None])[0, 0], full[i])
        H, Hkv, D, slots = 4, 2, 16, 300
        k, v = torch.randn(slots, Hkv, D, generator=g).to(dtype), torch.randn(slots, Hkv, D, generator=g).to(dtype)
        q = torch.randn(3, H, D, generator=g).to(dtype)
        seen = [7, 8, 9, 40, 41, 200]  # the row's columns, in position order
        alone = invariant.attention(q[:1], k, v, torch.tensor([seen]), torch.ones(1, len(seen), dtype=torch.bool))
        # the same columns scattered among invisible ones, with two other rows of other lengths
        cols = torch.tensor([[7, 3, 8, 9, 5, 40, 6, 41, 1, 200, 2, 4]] * 3)
        vis = torch.zeros(3, 12, dtype=torch.bool)
        vis[0, [0, 2, 3, 5, 7, 9]] = True
        vis[1, :12] = True
        vis[2, :2] = True
        together = invariant.attention(q, k, v, cols, vis)
        assert torch.equal(together[0], alone[0])


def test_batched_drafting_catches_up_a_long_prompt_in_chunks(models, monkeypatch):
    """A prompt longer than the catch-up chunk reaches the draft pool in several passes; the
    output still equals solo ar and the chains are accepted."""
    from tandem.engine import batched_draft

    target, draft = models
    prompt = list(range(3, 60))  # 57 tokens: 7 chunks of 8, then the root's pass
    want = Generator(target, None).generate(prompt, "ar", gen=GenerationConfig(max_new_tokens=20, ignore_eos=True))
    outs = []
    for chunk in (128, 8):  # one catch-up pass, then eight
        monkeypatch.setattr(batched_draft, "CATCH_UP_CHUNK", chunk)
        engine = Engine(target, draft, config=EngineConfig(method="chain", spec=SpecConfig(k=4), debug_check=True))
        req = engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
        outs.append({o.request_id: o for o in engine.run()}[req.request_id])
        assert outs[-1].token_ids == want.token_ids
        assert_clean(engine)
    # the chunked catch-up left the draft the same context: the same chains were accepted
    assert outs[1].figures.accepted_tokens == outs[0].figures.accepted_tokens and outs[1].tau > 1.5


@pytest.mark.parametrize("kind,spec,chunk", [("eagle3", SpecConfig(nodes=16, width=4), None),
                                             ("block", SpecConfig(nodes=32), None),
                                             ("eagle3", SpecConfig(nodes=16, width=4), 3),
                                             ("block", SpecConfig(nodes=32), 3),
                                             ("eagle3", SpecConfig(nodes=16, width=4), "captured"),
                                             ("block", SpecConfig(nodes=32), "captured"),
                                             ("block", SpecConfig(nodes=32), "trees-together")],
                         ids=["eagle3", "block", "eagle3-prompts-in-chunks", "block-prompts-in-chunks",
                              "eagle3-captured", "block-captured", "block-trees-together"])
def test_batched_feature_drafters_grow_the_per_request_drafters_trees(kind, spec, chunk, monkeypatch):
    """The EAGLE-3 head / the block drafter drafting every request at once
    (engine.batched_features.BatchedEagleDrafter / BatchedBlockDrafter) grow the same trees as each
    request's own EagleDrafter / LatticeDrafter: every request accepts exactly as many draft
    tokens both ways (fp32), and the outputs are the same. With `chunk`, a prompt reaches the
    batched drafter in passes of that many rows (a long backlog's path). "captured": the
    drafter's passes and the head's whole tree run over their captures' padded static buffers
    (emulated on the CPU). "trees-together": the block drafter's trees built for all requests at
    once (lattice.best_first_trees, the GPU's path) instead of a heap walk each."""
    from tandem.engine import batched_draft, engine as engine_mod
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    if chunk == "captured":
        made = engine_mod.Engine._batched_drafter
        monkeypatch.setattr(engine_mod.Engine, "_batched_drafter",
                            lambda self, draft, blocks, graphs: made(self, draft, blocks, "emulate"))
    elif isinstance(chunk, int):
        monkeypatch.setattr(batched_draft, "CATCH_UP_CHUNK", chunk)

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    pair = load_pair(None, kind, device="cpu", dtype=torch.float32)
    prompts = [pair.tokenizer.encode(f"# case {i}\n" + _SNIPPETS[i % 8]).ids for i in range(12)]
    accepted, tokens = {}, {}
    for batched in (True, False):
        engine = Engine(pair.target, pair.draft, config=EngineConfig(
            method="tree", spec=spec, block_size=16, max_num_batched_tokens=512, batched_drafting=batched,
            debug_check=True))
        if batched and chunk == "trees-together":
            engine.batched.device_trees_from = 1
        outs = run_all(engine, prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        if batched and chunk == "captured":  # (12 requests: trees padded to a bucket of 16)
            assert engine.batched.model._input_graphs and (kind == "block" or 16 in engine.batched._trees)
        accepted[batched] = [o.figures.accepted_tokens for o in outs]
        tokens[batched] = [o.token_ids for o in outs]
        assert_clean(engine)
    assert accepted[True] == accepted[False] and sum(accepted[True]) > len(prompts)
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind,ahead", [("block", True), ("eagle3", True), ("eagle3", False)])
def test_a_feature_drafter_is_fed_through_steps_that_skip_drafting(kind, ahead, asynchronous):
    """While the draft gate keeps drafting off, the batched feature drafter is still handed every
    committed row with the target's features: when drafting resumes, its pending rows are exactly
    the tokens committed since it last drafted, each with the target's features of the position
    before it (as an uncached forward of the target gives them), and the output equals solo ar.
    (An EAGLE-3 head runs a device-verified step's accepts in that step (EngineConfig.device_context)
    and drafts the next trees there or at its end (draft_ahead): it last ran rows in the second step.)
    With async scheduling the plain steps are queued before the last one is read, and each feeds
    its token with the features gathered when it was queued.)"""
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    pair = load_pair(None, kind, device="cpu", dtype=torch.float32)
    target, draft = pair.target, pair.draft
    prompt = pair.tokenizer.encode(_SNIPPETS[1]).ids
    engine = Engine(target, draft, config=EngineConfig(method="tree", spec=SpecConfig(nodes=16, width=4),
                                                       block_size=16, draft_gate=True, debug_check=True,
                                                       draft_ahead=ahead, async_scheduling=asynchronous))
    req = engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    seen = {}
    last_drafted = 3 if kind == "eagle3" else 2  # (the step whose start holds what it ran)

    class Pattern:  # drafts on its first two decode steps, not on the next three, then again
        decisions_off, calls, dormant = 0, 0, False  # (not dormant yet: every drafter stays fed)

        def plan(self, requests):
            if requests == 0:
                return 0
            self.calls += 1
            if self.calls == last_drafted:
                seen["from"] = len(req.token_ids())  # the last drafting ran every pending row before this
            if self.calls == 6:  # drafting resumes: what the drafter has not run yet
                engine._hand_over()  # (the async plain steps' rows: the step hands them over before it drafts)
                p = engine.batched.pending[req.request_id]
                seen["pending"] = (list(p.tokens), p.rows())
                seen["tokens"] = req.token_ids()
            return 0 if 3 <= self.calls <= 5 else requests

        def observe(self, *a, **k):
            pass

    engine.gate = Pattern()
    out = run_all(engine, [prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    solo = Engine(target, None, config=EngineConfig(method="ar"))
    assert out.token_ids == run_all(solo, [prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    toks, rows = seen["pending"]
    # (step 2's accepted path, unless drafted ahead at its end, then 3 roots; with async
    # scheduling the gate decides before the last plain step is read: its token is not there yet)
    assert toks == seen["tokens"][seen["from"]:] and len(toks) >= 3 + (last_drafted == 2) - asynchronous
    assert (engine.counters.drafted_ahead > 0) == (ahead and kind == "eagle3")
    assert (engine.counters.async_steps >= 3) == asynchronous  # (the three plain steps, and prefill steps)
    with torch.no_grad():
        target(torch.tensor([seen["tokens"]]))
        want = target.last_features[0, seen["from"] - 1:len(seen["tokens"]) - 1]  # [n, F] position p - 1
        if kind == "eagle3":
            want = draft.project(want)
    assert torch.allclose(rows.float(), want.float(), atol=1e-4), (rows - want).abs().max()


def test_a_step_the_gate_keeps_from_drafting_reserves_one_row_a_request(models, solo):
    """The draft gate decides before the step is planned: in steps it keeps drafting off every
    decoding request is planned (and its KV reserved) with its root alone, as in `ar`; outputs
    equal solo `ar` and the pool stays clean."""
    prompts, refs = solo
    engine = Engine(*models, config=EngineConfig(method="tree", spec=SpecConfig(nodes=8, width=2), block_size=8,
                                                 draft_gate=True, debug_check=True))

    class Off:  # drafts on the first two decoding steps, then never
        decisions_off, calls, dormant = 0, 0, True

        def plan(self, requests):
            self.calls += requests > 0
            return requests if self.calls <= 2 else 0

        def observe(self, *a, **k):
            pass

    engine.gate = Off()
    outs = run_all(engine, prompts[:8])
    assert [o.token_ids for o in outs] == refs[:8]
    full = [r for r in engine.counters.records if r.verified == 8 and r.nodes == 0]  # every request decoding
    assert len(full) > 5 and all(r.rows == 8 for r in full)  # (drafting on, a step reserves 8 x 9 rows)
    assert_clean(engine)


def test_the_gates_sample_stays_while_its_requests_decode(models, solo):
    """The gate's learning and probe steps draft a sample of the requests, the newest decoding
    ones (they stay longest, and their drafters start over a prompt alone); the sample stays the
    same while its requests decode (a request new to it first catches up on every token since it
    last drafted), a finished one replaced by the newest decoding request outside it; outputs
    equal solo ar."""
    prompts, refs = solo
    engine = Engine(*models, config=EngineConfig(method="tree", spec=SpecConfig(nodes=8, width=2), block_size=8,
                                                 draft_gate=True, debug_check=True))

    class Two:  # a sample of two every step
        decisions_off, dormant = 0, True

        def plan(self, requests):
            return min(requests, 2)

        def observe(self, *a, **k):
            pass

    engine.gate = Two()
    reqs = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts[:4], (MAX_NEW, MAX_NEW, MAX_NEW, 6))]
    samples = []
    while engine.has_unfinished():
        engine.step()
        if engine._drafting:
            samples.append((sorted(engine._drafting), {r.request_id for r in reqs if not r.done}))
    assert [r.output_ids for r in reqs[:3]] == [refs[i] for i in (0, 1, 2)] and reqs[3].output_ids == refs[3][:6]
    for (before, _), (now, live) in zip(samples, samples[1:]):
        kept = [rid for rid in before if rid in live]
        assert set(kept) <= set(now) and len(now) == 2, (before, now)
    ids = [r.request_id for r in reqs]
    assert samples[0][0] == sorted(ids[2:4])  # the two newest
    assert sorted(ids[1:3]) in [s for s, _ in samples]  # the finished one's place: the newest left


def test_drafting_steps_that_admit_a_request_teach_the_gate(models, solo):
    """In a steady state a request is admitted every step or two. A drafting step is steady for the
    gate (its cost teaches) when every drafted request drafted the step before or decodes for the
    first time, newcomers half of them at most; the check reads the outputs before the step
    extends them (after it, every step with a new request looked unsteady, and at 64 requests
    almost no drafting step taught the gate). The first step, every request new, is not steady."""
    prompts, refs = solo
    engine = Engine(*models, config=EngineConfig(method="tree", spec=SpecConfig(nodes=8, width=2), block_size=8,
                                                 max_num_seqs=8, draft_gate=True, debug_check=True))
    seen = []

    class On:  # every request drafts in every step; records what the engine tells the gate
        decisions_off, dormant = 0, False

        def plan(self, requests):
            return requests

        def observe(self, requests, drafted, seconds, accepted, prefill_rows=0, steady=True):
            seen.append((requests, drafted, steady))

    engine.gate = On()
    lengths = (6, 10, MAX_NEW, 8, 12, MAX_NEW, 7, 9, MAX_NEW, 11, 5, MAX_NEW) * 2
    reqs = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == [ref[:n] for ref, n in zip(refs, lengths)]
    drafting = [s for s in seen if s[1]]
    assert len(drafting) > 10 and all(d == r for r, d, _ in drafting)  # (admissions ride in them)
    assert not drafting[0][2] and all(steady for _, _, steady in drafting[1:]), drafting


def test_the_gate_decides_by_its_cost_model_unless_the_arms_are_asked_for(models, monkeypatch):
    """The engine's gate runs its cost model alone by default (the measured arms lost to it on an
    H100 at every concurrency); TANDEM_GATE_ARMS=1 adds them."""
    cfg = EngineConfig(method="tree", spec=SpecConfig(nodes=8, width=2), block_size=8, max_num_seqs=4, draft_gate=True)
    monkeypatch.delenv("TANDEM_GATE_ARMS", raising=False)
    assert Engine(*models, config=cfg).gate.arms is None
    monkeypatch.setenv("TANDEM_GATE_ARMS", "1")
    assert isinstance(Engine(*models, config=cfg).gate.arms, GateArms)


def _gated_eagle3_engine(n_prompts: int, max_tokens: int, asynchronous: bool = False):
    """The bundled target and EAGLE-3 head in a gated `tree` engine (the test replaces its gate),
    with n of the snippets as prompts -> (pair, prompts, params, engine)."""
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    pair = load_pair(None, "eagle3", device="cpu", dtype=torch.float32)
    prompts = [pair.tokenizer.encode(t).ids for t in _SNIPPETS[:n_prompts]]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine = Engine(pair.target, pair.draft, config=EngineConfig(
        method="tree", spec=SpecConfig(nodes=8, width=2), block_size=16, draft_gate=True, debug_check=True,
        async_scheduling=asynchronous))
    return pair, prompts, params, engine


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_while_the_gate_keeps_drafting_off_only_its_samples_feature_drafters_are_fed(asynchronous):
    """Feeding every request's feature drafter through plain steps costs a plain step more than
    `ar`'s; while the gate keeps drafting off only its sample's drafters are fed (the next probe
    drafts those), the others are released and restart from the whole context when drafting
    resumes. Outputs equal solo ar throughout (a restarted drafter proposes worse, never wrongly)."""
    pair, prompts, params, engine = _gated_eagle3_engine(6, 20, asynchronous)
    fed_while_off = []

    class OnOffOn:  # all draft for two decode steps, none for four, then all again
        decisions_off, calls, sample, dormant = 0, 0, 2, True

        def plan(self, requests):
            if requests == 0:
                return 0
            self.calls += 1
            if 4 <= self.calls <= 6:  # (the step before decided off: its plain requests were fed or dropped)
                fed_while_off.append({rid for rid, r in engine.requests.items() if "drafter" in r.runtime})
            return 0 if 3 <= self.calls <= 6 else requests

        def observe(self, *a, **k):
            pass

    engine.gate = OnOffOn()
    outs = run_all(engine, prompts, params)
    solo = Engine(pair.target, None, config=EngineConfig(method="ar"))
    assert [o.token_ids for o in outs] == [o.token_ids for o in run_all(solo, prompts, params)]
    sample = set(engine._sample)
    assert len(sample) == 2 and fed_while_off and all(fed == sample for fed in fed_while_off)
    drafted_again = [r for r in engine.counters.records if r.nodes > 0]
    assert len(drafted_again) > 2  # (drafting resumed for every request after the off stretch)
    assert (engine.counters.async_steps >= 4) == asynchronous  # (the four plain steps, and prefill steps)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_parked_gates_plain_steps_feed_no_drafter_and_its_probes_start_the_newest(asynchronous, monkeypatch):
    """Feeding feature drafters through plain steps costs a plain step more than `ar`'s: with
    TANDEM_GATE_PARK=1 a dormant gate's plain steps release every drafter and feed none; a probe (two steps of k
    requests drafting) starts the drafters of the k newest decoding requests, the next plain step
    releases them, and drafting for all restarts every drafter from its whole context. Outputs
    equal solo ar throughout (a restarted drafter proposes worse, never wrongly)."""
    monkeypatch.setenv("TANDEM_GATE_PARK", "1")
    pair, prompts, params, engine = _gated_eagle3_engine(6, 20, asynchronous)
    held, probed = [], []

    class OnOffProbeOffOn:  # all for 2 decode steps, none for 3, a probe of 2 (two steps), none for 2, all
        decisions_off, calls, sample, dormant = 0, 0, 2, True

        def plan(self, requests):
            if requests == 0:
                return 0
            self.calls += 1
            if 4 <= self.calls <= 10:  # (what the step before left: drafters held)
                held.append({rid for rid, r in engine.requests.items() if "drafter" in r.runtime})
            if self.calls in (6, 7):
                newest = [r.request_id for r in engine.scheduler.running if not r.in_prefill][-2:]
                probed.append(set(newest))
                return 2
            return 0 if 3 <= self.calls <= 9 else requests

        def observe(self, *a, **k):
            pass

    engine.gate = OnOffProbeOffOn()
    outs = run_all(engine, prompts, params)
    solo = Engine(pair.target, None, config=EngineConfig(method="ar"))
    assert [o.token_ids for o in outs] == [o.token_ids for o in run_all(solo, prompts, params)]
    # held before calls 4-10: after plain steps 3, 4, 5 none; after the probe's steps (6, 7) its two;
    # after plain steps 8, 9 none again
    assert held[:3] == [set(), set(), set()] and held[3] == held[4] == probed[0] == probed[1], (held, probed)
    assert held[5:] == [set(), set()], held
    assert len([r for r in engine.counters.records if r.nodes > 0]) > 3  # (drafting resumed for every request)


def test_rows_kept_for_a_drafter_that_is_gone_are_not_handed_over():
    """Async plain steps keep their feature-drafter rows until the next synchronous step hands
    them over (Engine._hand_over). Rows of a request aborted meanwhile, or whose drafter was
    released and restarted (a new handle), are dropped, never fed into another drafter; the
    others reach their drafters whole: when drafting resumes each drafter holds exactly the
    tokens it has not run. Outputs equal solo ar."""
    pair, prompts, params, engine = _gated_eagle3_engine(4, 16, asynchronous=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    state = {"calls": 0}
    seen = {}

    class OffThenOn:  # all draft for two decode steps, none for five, then all again
        decisions_off, sample, off_streak, dormant_after, dormant = 0, 4, 0, 100, False

        def plan(self, requests):
            if requests == 0:
                return 0
            state["calls"] += 1
            if state["calls"] == 5:  # (rows kept for every request: abort one, restart another's drafter)
                assert engine._unfed
                engine.abort(reqs[0].request_id)
                reqs[1].runtime.pop("drafter")
                engine.batched.release(reqs[1].request_id)
            if state["calls"] == 8:  # drafting resumes: the kept rows are handed over first
                seen["unfed"] = len(engine._unfed)
                engine._hand_over()
                seen["pending"] = {r.request_id: list(engine.batched.pending[r.request_id].tokens)
                                   for r in reqs[2:]}
                seen["tokens"] = {r.request_id: r.token_ids() for r in reqs[2:]}
                seen["ran"] = {r.request_id: engine.batched.pool.seqs[r.request_id].length for r in reqs[2:]}
                seen["gone"] = [r.request_id in engine.batched.pending for r in reqs[:2]]  # (nothing fed to them)
            return 0 if 3 <= state["calls"] <= 7 else requests

        def observe(self, *a, **k):
            pass

    engine.gate = OffThenOn()
    while engine.has_unfinished():
        engine.step()
    solo = Engine(pair.target, None, config=EngineConfig(method="ar"))
    want = [o.token_ids for o in run_all(solo, prompts, params)]
    assert [r.output_ids for r in reqs[1:]] == want[1:] and reqs[0].finish_reason == "abort"
    assert seen["unfed"] > 0 and engine.counters.async_steps >= 4
    assert seen["gone"] == [False, False]
    for rid, pending in seen["pending"].items():  # each drafter: the rows it ran, then the pending ones, in order
        toks, ran = seen["tokens"][rid], seen["ran"][rid]
        assert pending == toks[ran:ran + len(pending)] and ran + len(pending) >= len(toks) - 1  # (one may be on its way)
    assert_clean(engine)


@pytest.mark.parametrize("park", [False, True], ids=["sample-fed", "parked"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_drafters_go_dormant_only_after_the_gates_off_streak_reaches_dormant_after(asynchronous, park, monkeypatch):
    """Near break-even the gate turns drafting on and off often, and a restarted drafter catches
    up on its whole context: every drafter stays fed until the gate has kept drafting off for
    `dormant_after` plain steps in a row; then only its sample's (parked: none), until drafting
    resumes for all."""
    monkeypatch.setenv("TANDEM_GATE_PARK", "1" if park else "0")
    pair, prompts, params, engine = _gated_eagle3_engine(5, 16, asynchronous)
    fed = []

    class Streak:  # all draft for two decode steps, then none (counting its off streak), then all again
        decisions_off, calls, sample, off_streak, dormant_after = 0, 0, 2, 0, 3

        @property
        def dormant(self):  # (as DraftGate's: since the streak reached dormant_after, until all draft)
            return self.off_streak >= self.dormant_after

        def plan(self, requests):
            if requests == 0:
                return 0
            self.calls += 1
            if 3 <= self.calls <= 9:
                fed.append(sum("drafter" in r.runtime for r in engine.requests.values()))
            if 3 <= self.calls <= 8:
                self.off_streak += 1
                return 0
            self.off_streak = 0
            return requests

        def observe(self, *a, **k):
            pass

    engine.gate = Streak()
    outs = run_all(engine, prompts, params)
    solo = Engine(pair.target, None, config=EngineConfig(method="ar"))
    assert [o.token_ids for o in outs] == [o.token_ids for o in run_all(solo, prompts, params)]
    # (fed: counted before the step's decision, so after the streak's previous value)
    left = 0 if park else 2  # (the sample's two)
    assert fed == [5, 5, 5] + [left] * 4, fed  # (the third off decision makes them dormant)


@pytest.mark.parametrize("kind", ["eagle3", "draft"])
@pytest.mark.parametrize("graphs", [None, "emulate"])
def test_trees_verified_on_the_device_equal_the_host_path(kind, graphs, monkeypatch):
    """Greedy `tree` steps verify on the device (the trees never read back: the target's rows
    built from them, the accepted paths found by kernels, one read-back a step): every request
    accepts exactly the tokens the host path accepts (which reads each tree back, packs it and
    accepts on the host), step for step; the outputs equal solo ar. "emulate": both models'
    passes and the drafter's whole tree over their captures' padded static buffers, as on a GPU."""
    from tandem.engine import batched_draft, engine as engine_mod
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    if graphs:
        class Emulated(engine_mod.BatchedModel):
            def __init__(self, *a, **k):
                k["use_graphs"] = "emulate"
                super().__init__(*a, **k)

        monkeypatch.setattr(engine_mod, "BatchedModel", Emulated)
        monkeypatch.setattr(batched_draft, "BatchedModel", Emulated)
        made = engine_mod.Engine._batched_drafter
        monkeypatch.setattr(engine_mod.Engine, "_batched_drafter",
                            lambda self, draft, blocks, g: made(self, draft, blocks, "emulate"))
    pair = load_pair(None, kind, device="cpu", dtype=torch.float32)
    prompts = [pair.tokenizer.encode(f"# case {i}\n" + _SNIPPETS[i % 8]).ids for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = {}
    for on_device, ahead, context in ((True, True, True), (True, False, True), (True, True, False),
                                      (True, False, False), (False, False, False)):
        engine = Engine(pair.target, pair.draft, config=EngineConfig(
            method="tree", spec=SpecConfig(nodes=16, width=4), block_size=16, device_verify=on_device,
            draft_ahead=ahead, device_context=context, max_num_seqs=4, debug_check=True))
        steps = []
        monkeypatch.setattr(engine, "_verify_on_device",
                            lambda *a, _f=engine._verify_on_device, **k: steps.append(1) or _f(*a, **k))
        outs = run_all(engine, prompts, params)
        got[on_device, ahead, context] = ([o.token_ids for o in outs], [o.figures.accepted_tokens for o in outs],
                                          [r.nodes for r in engine.counters.records])
        assert (len(steps) > 5) == on_device and len(steps) < engine.steps  # (prefill steps: the host path)
        # drafted during the step before: every device step but those after a host step (a prefill's)
        c = engine.counters
        assert (c.drafted_ahead > len(steps) // 2) == ahead and c.drafted_ahead + c.ahead_dropped <= len(steps)
        # the drafter ran the accepts before the read in every device step;
        # the next trees too where a captured tree takes them (graphs), drafting ahead is on, no
        # prompt waits and no request can reach max_tokens in the step
        runs = context  # (a draft model's pass over the accepts, or the EAGLE-3 head's)
        assert c.accepts_on_device == (len(steps) if runs else 0), (c.accepts_on_device, len(steps))
        assert (c.trees_before_read > 3) == (runs and ahead and graphs is not None), c.trees_before_read
        assert_clean(engine)
    first = got[True, True, True]
    assert all(g == first for g in got.values()) and sum(first[1]) > len(prompts)
    solo = Engine(pair.target, None, config=EngineConfig(method="ar"))
    assert first[0] == [o.token_ids for o in run_all(solo, prompts, params)]


def test_the_servers_logprob_engine_verifies_on_the_device_when_no_request_wants_logprobs(monkeypatch):
    """The server's LogprobEngine reads every accept of a request that asked for logprobs (on
    the host); a step where none of its requests did verifies on the device as a plain engine's
    does. Outputs equal solo ar either way, and the logprobs asked for are the target's."""
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair
    from tandem.serve.logprobs import LogprobEngine

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    pair = load_pair(None, "eagle3", device="cpu", dtype=torch.float32)
    prompts = [pair.tokenizer.encode(t).ids for t in _SNIPPETS[:3]]
    engine = LogprobEngine(pair.target, pair.draft, config=EngineConfig(
        method="tree", spec=SpecConfig(nodes=16, width=4), block_size=16, debug_check=True))
    on_device = []
    monkeypatch.setattr(engine, "_verify_on_device", lambda plan, *a, _f=engine._verify_on_device:
                        on_device.append({s.request.request_id for s in plan.scheduled}) or _f(plan, *a))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, (8, 30, 30))]
    engine.want_logprobs(reqs[0].request_id, 2)  # (the first finishes early: the others then go on the device)
    while engine.has_unfinished():
        engine.step()
    solo = Engine(pair.target, None, config=EngineConfig(method="ar"))
    want = [o.token_ids for o in run_all(solo, prompts, SamplingParams(max_tokens=30, ignore_eos=True))]
    assert [r.output_ids for r in reqs] == [want[0][:8], want[1], want[2]]
    assert on_device and all(reqs[0].request_id not in ids for ids in on_device)
    lps = engine.logprobs[reqs[0].request_id][:8]
    assert [t.token for t in lps] == reqs[0].output_ids
    assert all(t.top[0][0] == t.token and abs(t.top[0][1] - t.logprob) < 1e-5 for t in lps)


@pytest.mark.parametrize("method", ["ar", "tree+gate"])
def test_the_servers_logprob_engine_starts_as_on_a_gpu(models, solo, method):
    """On a GPU the engine warms up with a throwaway request and schedules `ar` steps async when
    it starts; the server's LogprobEngine must already answer `_reads_accepts` then (the H200's
    `tandem bench --online` failed to start its engine process on this, 2026-12-03). A request
    that wants logprobs then runs synchronously, the others async; outputs equal solo `ar`."""
    from tandem.serve.logprobs import LogprobEngine

    target, draft = models
    prompts, refs = solo
    gated = method == "tree+gate"  # (the gate also measures its step costs on throwaway requests)
    engine = LogprobEngine(target, draft if gated else None, config=EngineConfig(
        method="tree" if gated else "ar", spec=SpecConfig(nodes=8, width=2), block_size=8, warmup_request=True,
        async_scheduling=True, draft_gate=gated, debug_check=True))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in prompts[:3]]
    engine.want_logprobs(reqs[1].request_id, 1)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == refs[:3]
    assert [t.token for t in engine.logprobs[reqs[1].request_id]][:MAX_NEW] == refs[1]
    assert engine.counters.async_steps == 0 < engine.steps  # (a request reads its logits: every step synchronous)


def test_an_engine_without_a_feature_drafter_keeps_no_target_features(models, solo):
    """The target is shared: once an engine with a feature drafter enabled its features, an `ar`
    engine on it must not keep computing them (they cost it a third of its step on the H200)."""
    target, _ = models
    prompts, refs = solo
    target.enable_features()
    try:
        engine = Engine(target, None, config=EngineConfig(method="ar", block_size=8))
        outs = run_all(engine, prompts[:2])
        assert [o.token_ids for o in outs] == refs[:2]
        assert engine.model.last_features is None
    finally:
        target.feature_layers = None


class _CountingEngine(Engine):
    """An engine noting the steps its constructor runs (the warm-up request's): verify passes and
    draft nodes per step."""

    def _record(self, plan, nodes, *a, **k):
        self.warm_steps = getattr(self, "warm_steps", []) + [(len(plan.decodes), nodes)]
        return super()._record(plan, nodes, *a, **k)


@pytest.mark.parametrize("method,spec,gate", [("ar", SpecConfig(), None), ("tree", SpecConfig(nodes=8, width=2), None),
                                              ("tree", SpecConfig(nodes=8, width=2), True)])
def test_the_warmup_request_drafts_then_leaves_no_trace(models, solo, method, spec, gate):
    """warmup_request: a throwaway request through prefill and 3 decode steps that draft as the
    engine drafts (the gate's too), then the engine is as new: no request, no step, a clean pool,
    and the same outputs as an engine without it."""
    target, draft = models
    prompts, want = solo
    cfg = dict(method=method, spec=spec, max_num_seqs=8, draft_gate=gate, debug_check=True)
    engine = _CountingEngine(target, draft, config=EngineConfig(warmup_request=True, **cfg))
    decodes = [(d, n) for d, n in engine.warm_steps if d]
    assert len(decodes) >= 3
    if method != "ar":
        assert all(n > 0 for _, n in decodes[-3:])  # (the gate's own measurements ran before: the warm-up's last)
    assert engine.steps == 0 and len(engine.counters.records) == 0 and engine.requests == {}
    assert engine.pool.check() == [] and engine.pool.seqs == {}
    if engine.batched is not None:
        assert engine.batched.pool.check() == [] and engine.batched.pool.seqs == {}
    outs = run_all(engine, prompts[:8])
    assert [o.token_ids for o in outs] == want[:8]
    cold = Engine(target, draft, config=EngineConfig(warmup_request=False, **cfg))
    assert [o.token_ids for o in run_all(cold, prompts[:8])] == want[:8]


def test_max_tokens_past_the_context_window_is_lowered_with_a_warning(tiny_checkpoint, caplog, capsys):
    """The API lowers max_tokens to what the window leaves (as vLLM's offline API ends the output
    there) and says so; `tandem generate` notes only flags its method reads."""
    from tandem import LLM, SamplingParams as SP
    from tandem.cli import main

    d = tiny_checkpoint("llama", name="short", max_position_embeddings=16)
    with caplog.at_level("WARNING", logger="tandem"):
        out = LLM(target=d, method="ar").generate([5, 6, 7], SP(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 13 and out.finish_reason == "length"
    assert any("max_tokens lowered for 1 prompt(s)" in r.getMessage() and "20 -> 13" in r.getMessage()
               for r in caplog.records)
    assert main(["generate", "def f():", "--target", str(d), "--method", "ar", "--max-new-tokens", "20"]) == 0
    err = capsys.readouterr().err
    assert "--max-new-tokens 20 capped to" in err and "--nodes" not in err


def test_step_counters_count_every_step_past_the_records_window(models, solo):
    """The counters' step kinds (drafted, decodes without nodes, no rows) are totals over the
    engine's life, not counts over `records`, which keeps the latest steps only (a bench run of
    5,544 steps counted its drafted steps among the latest 4,096 and reported 1,380 steps that
    verified nothing)."""
    from collections import deque

    prompts, refs = solo
    engine = Engine(*models, config=EngineConfig(method="tree", spec=SpecConfig(nodes=8, width=2), block_size=8))
    engine.counters.records = deque(maxlen=3)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in prompts[:2]]
    seen = []
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.counters.records[-1])
    k = engine.counters
    assert [r.output_ids for r in reqs] == refs[:2] and len(k.records) == 3 and k.steps == len(seen) > 3
    assert k.drafted_steps == sum(r.nodes > 0 for r in seen) > 0
    assert k.drafted_step_s == pytest.approx(sum(r.seconds for r in seen if r.nodes > 0))
    assert k.undrafted_steps == sum(r.nodes == 0 and r.verified > 0 for r in seen)
    assert k.empty_steps == sum(r.rows == 0 for r in seen)
