"""The batched engine with a hybrid (Qwen3.5) target: each request's recurrent state in the pool
beside its K/V blocks (tandem.kv.hybrid_pool), one batched pass whose GDN layers walk each
request's tree from its own state (tandem.engine.hybrid_model).

Concurrent requests give exactly their solo `ar` outputs (greedy, fp32) through chunked
prefill, trees with deep accepts, preemption and aborts; `check()` finds what a broken pool
would hide; sampling through the engine follows the target's distribution."""
from __future__ import annotations

import math

import pytest
import torch

from models_for_tests import assert_clean, run_all, tiny_model
from test_qwen3_5 import VOCAB, OracleTreeDrafter, build_hf
from tandem.config import ConfigError, GenerationConfig, SpecConfig
from tandem.engine.config import EngineConfig
from tandem.engine.draft_gate import StepCosts
from tandem.engine.engine import Engine
from tandem.engine.request import RequestState, SamplingParams
from tandem.models.loader import load_model
from tandem.runtime.hybrid import generate_hybrid

MAX_NEW = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5-engine")
    build_hf("default").save_pretrained(d)
    return load_model(d)


@pytest.fixture(scope="module")
def solo(target):
    """10 prompts (2-40 tokens) and each one's solo greedy `ar` output (the single-request loop)."""
    rng = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB - 1, (int(torch.randint(2, 41, (), generator=rng)),), generator=rng).tolist()
               for _ in range(10)]
    gen = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    return prompts, [generate_hybrid(target, p, "ar", gen=gen).token_ids for p in prompts]


class OracleDrafter(OracleTreeDrafter):
    """The single-request tests' oracle trees (a spine along the reference for a random length,
    so trees are accepted 0-6 deep), started from a request's tokens so far (again after a
    preemption) and fed as the engine feeds a drafter."""

    def __init__(self, prompt_len: int, reference: list[int], nodes: int, seed: int):
        super().__init__(reference, nodes, seed)
        self.prompt_len = prompt_len

    def start(self, ids: list[int]) -> None:
        self.done, self.root = len(ids) - self.prompt_len, ids[-1]

    def observe(self, result, tree, feats=None) -> None:
        super().observe(result, tree)


class OracleEngine(Engine):
    """The engine with each request drafted by an OracleDrafter over its solo reference (the
    target side, the pool and the commit are the engine's own)."""

    references: dict[tuple[int, ...], list[int]] = {}

    def _new_drafter(self, req):
        prompt = tuple(req.prompt_ids)
        return OracleDrafter(len(prompt), self.references[prompt], self.spec.nodes, seed=hash(prompt) % 1000)

    def _proposal(self, req):
        tree = super()._proposal(req)
        tree.tokens[0] = req.last_token
        return tree


def _engine(target, draft=None, cls=Engine, **kw) -> Engine:
    base = dict(block_size=8, max_num_batched_tokens=40, debug_check=True)
    return cls(target, draft, config=EngineConfig(**{**base, **kw}))


def _slots_free(engine) -> bool:
    p = engine.pool
    return sorted(p.free_slots) == list(range(p.num_slots)) and not p.slot_of and not p.records


@pytest.mark.parametrize("method,spec", [("ar", SpecConfig()), ("chain", SpecConfig(k=3)),
                                         ("tree", SpecConfig(nodes=8, width=2))])
def test_concurrent_requests_equal_their_solo_ar_outputs(target, solo, method, spec):
    """A small attention-only draft (same vocabulary) through the batched drafters; a 40-row
    budget splits the longer prompts into chunks that share passes with decodes."""
    prompts, refs = solo
    draft = None if method == "ar" else tiny_model(vocab=VOCAB, seed=5)
    engine = _engine(target, draft, method=method, spec=spec)
    outs = run_all(engine, prompts)
    assert [o.token_ids for o in outs] == refs
    assert_clean(engine)
    assert _slots_free(engine)
    assert engine.counters.steps > 0 and all(o.figures.target_passes >= 1 for o in outs)


def test_one_row_decodes_share_one_gdn_call(target, solo):
    """An `ar` step's decodes run each GDN layer as one batched call over their gathered states
    (one shared record, a batch row each), and the commit scatters each row's state back."""
    prompts, refs = solo
    engine = _engine(target, method="ar", max_num_batched_tokens=400)
    seen = []  # each commit's records, as the pass left them
    commit = engine.pool.commit_many

    def spy(commits, keep_later=False):
        seen.append({sid: (id(rec), row) for sid, (rec, row) in engine.pool.records.items()})
        return commit(commits, keep_later)

    engine.pool.commit_many = spy
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in prompts[:4]]
    engine.step()  # every prompt's prefill
    assert len({rec for rec, _ in seen[-1].values()}) == 4  # (prefill chunks: one record each)
    engine.step()  # four one-row decodes
    assert len({rec for rec, _ in seen[-1].values()}) == 1 and sorted(row for _, row in seen[-1].values()) == [0, 1, 2, 3]
    done = {o.request_id: o for o in engine.run()}
    assert [done[r.request_id].token_ids for r in reqs] == refs[:4]
    assert_clean(engine)


def test_chains_of_one_shape_share_one_gdn_call(target, solo):
    """A `chain` step's full chains have one shape: their GDN layers run as one batched call (a
    shared record, a batch row each), each committed by its own accepted path; outputs equal ar."""
    prompts, refs = solo
    engine = _engine(target, tiny_model(vocab=VOCAB, seed=5), method="chain", spec=SpecConfig(k=3),
                     max_num_batched_tokens=400)
    shared = []
    commit = engine.pool.commit_many

    def spy(commits, keep_later=False):
        recs = [rec for rec, _ in engine.pool.records.values()]
        ids = [id(rec) for rec in recs]
        shared.extend(rec for rec in recs if ids.count(id(rec)) > 1 and len(rec.parents) == 4)
        return commit(commits, keep_later)

    engine.pool.commit_many = spy
    outs = run_all(engine, prompts[:4])
    assert [o.token_ids for o in outs] == refs[:4]
    assert shared  # (some step verified two or more 4-row chains in one call)
    assert_clean(engine)


@pytest.mark.parametrize("mode", [dict(batch_parallel=True), dict(row_selection=True), dict(adaptive_draft=True),
                                  # (given step costs: measuring them takes seconds of steps)
                                  dict(draft_gate=True, step_costs=StepCosts((1, 4, 8), plain=(0.01,) * 3,
                                                                             drafting=(0.02, 0.03, 0.05)))],
                         ids=lambda m: next(iter(m)))
def test_engine_modes_over_a_hybrid_target_equal_solo_ar(target, solo, mode):
    """MineDraft's two batches, batch-aware row selection, adaptive draft lengths and the draft
    gate change which rows a pass holds, never what the hybrid pass computes for them."""
    prompts, refs = solo
    engine = _engine(target, tiny_model(vocab=VOCAB, seed=5), method="tree", spec=SpecConfig(nodes=8, width=2), **mode)
    outs = run_all(engine, prompts[:6])
    assert [o.token_ids for o in outs] == refs[:6]
    assert_clean(engine)
    assert _slots_free(engine)


@pytest.mark.parametrize("kernel", ["walk", "wy"])
def test_deeply_accepted_trees_equal_solo_ar(target, solo, kernel, monkeypatch):
    """Trees accepted up to 6 deep, paths that skip rows, several per pass beside prefill chunks:
    the commit replays each accepted path into its request's slot. Both tree kernels: the walk
    (bitwise token-by-token decoding) and WY (equal up to fp32 rounding)."""
    monkeypatch.setattr(target, "gdn_tree", kernel)
    prompts, refs = solo
    OracleEngine.references = {tuple(p): r for p, r in zip(prompts, refs)}
    engine = _engine(target, tiny_model(vocab=VOCAB, seed=5), cls=OracleEngine, method="tree",
                     spec=SpecConfig(nodes=10, width=2), batched_drafting=False)
    outs = run_all(engine, prompts)
    assert [o.token_ids for o in outs] == refs
    assert max(o.tau for o in outs) > 2.5  # deep accepts ran
    assert_clean(engine)
    assert _slots_free(engine)


def test_preemption_recomputes_the_recurrent_state(target, solo):
    """Too few blocks for every request: the scheduler preempts by recompute, the victim's state
    slot is given back and its state rebuilt from its prompt and outputs; outputs unchanged."""
    prompts, refs = solo
    OracleEngine.references = {tuple(p): r for p, r in zip(prompts, refs)}
    engine = _engine(target, tiny_model(vocab=VOCAB, seed=5), cls=OracleEngine, method="tree",
                     spec=SpecConfig(nodes=6, width=2), batched_drafting=False, num_blocks=24, max_num_seqs=6)
    outs = run_all(engine, prompts)
    assert engine.counters.preemptions > 0
    assert [o.token_ids for o in outs] == refs
    assert_clean(engine)
    assert _slots_free(engine)


def test_abort_at_any_point_frees_the_slot(target, solo):
    """Requests aborted while waiting, mid-prefill and mid-decode give their blocks and state
    slots back; the others' outputs are unchanged."""
    prompts, refs = solo
    engine = _engine(target, tiny_model(vocab=VOCAB, seed=5), method="tree", spec=SpecConfig(nodes=6, width=2),
                     max_num_seqs=4)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.abort(reqs[9].request_id)  # still waiting
    done = {}
    for step in range(400):
        if not engine.has_unfinished():
            break
        if step == 1:
            engine.abort(reqs[0].request_id)  # in its first steps
        if step == 6:
            engine.abort(reqs[2].request_id)
        for o in engine.step():
            done[o.request_id] = o
        assert engine.pool.check() == []
    kept = [i for i in range(10) if i not in (0, 2, 9)]
    assert all(done[reqs[i].request_id].token_ids == refs[i] for i in kept)
    assert all(reqs[i].state == RequestState.ABORTED for i in (0, 2, 9))
    assert_clean(engine)
    assert _slots_free(engine)


def test_check_finds_leaked_and_double_owned_slots(target):
    engine = _engine(target, method="ar")
    a = engine.add_request([3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    b = engine.add_request([7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    pool = engine.pool
    assert pool.check() == []
    sa, sb = pool.slot_of[a.request_id], pool.slot_of[b.request_id]
    pool.slot_of[b.request_id] = sa  # b now points at a's slot, b's own is held by no one
    problems = pool.check()
    assert f"state slot {sa}: owned by 2 sequences (double-owned)" in problems
    assert f"state slot {sb}: leaked (neither free nor owned)" in problems
    pool.slot_of[b.request_id] = sb
    pool.records["gone"] = None
    assert pool.check() == ["gone: a pass record kept for a closed sequence"]
    del pool.records["gone"]
    pool.free_slots.append(sa)
    assert f"state slot {sa}: free and owned (double-owned)" in pool.check()


def test_feature_drafter_over_a_hybrid_target_in_the_engine(target, solo, tmp_path):
    """An EAGLE-3 head reads the hybrid target's features from the batched pass (the residual
    stream entering three of its layers, every row of the pass): outputs equal solo ar."""
    from test_eagle3 import write_head
    from tandem.models.eagle3 import load_eagle3

    prompts, refs = solo
    write_head(tmp_path / "head", target)
    head = load_eagle3(tmp_path / "head", target, "cpu", torch.float32)
    try:
        engine = _engine(target, head, method="tree", spec=SpecConfig(nodes=8, width=2))
        outs = run_all(engine, prompts[:5])
        assert [o.token_ids for o in outs] == refs[:5]
        assert sum(o.figures.draft_tokens for o in outs) > 0
        assert_clean(engine)
    finally:
        target.feature_layers, target.last_features = None, None  # the shared model: back to no features


def test_sampling_through_the_engine_follows_the_target(target):
    """Recursive rejection sampling over the batched hybrid pass: the first sampled token of 400
    requests (one prompt, their own seeds) follows the target's distribution (total variation)."""
    from tandem.config import SamplingConfig
    from tandem.verify.sampling import probs_from_logits

    prompt, n = [7, 7, 21, 64, 3, 90], 400
    with torch.no_grad():
        p1 = probs_from_logits(target(torch.tensor([prompt]))[0, -1], SamplingConfig(temperature=1.0))
    engine = _engine(target, tiny_model(vocab=VOCAB, seed=5), method="tree", spec=SpecConfig(nodes=6, width=2),
                     max_num_seqs=32, max_num_batched_tokens=256, debug_check=False)
    reqs = [engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=s, ignore_eos=True))
            for s in range(n)]
    done = {o.request_id: o for o in engine.run()}
    outs = [done[r.request_id] for r in reqs]
    counts = torch.zeros(VOCAB)
    for o in outs:
        counts[o.token_ids[0]] += 1
    noise = 0.5 * float((2 / (math.pi * n) * p1 * (1 - p1)).sqrt().sum())  # E[TV] of n exact draws
    tv = 0.5 * float((counts / n - p1).abs().sum())
    assert tv < 1.3 * noise + 0.02, (tv, noise)
    assert_clean(engine)


def test_what_the_engine_does_not_run_with_a_hybrid_target_is_one_line(target, tmp_path):
    with pytest.raises(ConfigError, match="^async_scheduling does not run hybrid"):
        _engine(target, async_scheduling=True, method="ar")
    with pytest.raises(ConfigError, match="^deterministic \\(batch-invariant\\) mode does not cover hybrid"):
        _engine(target, deterministic=True, method="ar")
    d = tmp_path / "draft"
    build_hf("mixed").save_pretrained(d)
    with pytest.raises(ConfigError, match="a Qwen3.5 \\(hybrid\\) draft runs in tandem generate"):
        _engine(target, load_model(d), method="tree")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny random Qwen3.5 checkpoint over the bundled pair's tokenizer (its 8,192 ids), so that
    the bundled draft drafts for it and text goes in and out."""
    import shutil

    from tandem.runtime.pair import BUNDLED_TARGET, bundled_available

    if not bundled_available():
        pytest.skip("the bundled pair is not in this checkout")
    d = tmp_path_factory.mktemp("qwen3_5-text")
    build_hf("default", vocab=8192).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TARGET / f, d / f)
    return d


def test_llm_and_the_server_run_a_hybrid_target(hybrid_dir):
    """tandem.LLM and `tandem serve` (a real uvicorn server on loopback) over a hybrid target with
    the bundled draft model: greedy text equals the single-request loop's `ar`."""
    import httpx

    from test_serve import LiveServer
    from tandem import LLM
    from tandem.runtime.pair import BUNDLED_DRAFT
    from tandem.serve.app import Server
    from tandem.serve.chat_template import ChatTemplate
    from tandem.serve.config import ServerConfig

    llm = LLM(target=hybrid_dir, draft=BUNDLED_DRAFT, spec=SpecConfig(nodes=8, width=2))
    prompts = ["def fib(n):", "import os\n", "class Stack:"]
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    tok, model = llm.tokenizer, llm.engine.target
    refs = [generate_hybrid(model, tok.encode(p).ids, "ar", gen=gen).token_ids for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
    assert [o.token_ids for o in outs] == refs
    assert outs[0].text == tok.decode(refs[0])
    server = LiveServer(Server(model, llm.engine.draft, tok, ServerConfig(methods=("tree", "ar")),
                               EngineConfig(num_blocks=128, max_num_seqs=4, debug_check=True),
                               ChatTemplate.for_checkpoint(hybrid_dir)))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for method in ("tree", "ar"):
                r = c.post("/v1/completions", json={"model": "tandem", "prompt": prompts[1], "max_tokens": 12,
                                                     "temperature": 0, "method": method, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == tok.decode(refs[1]), method
    finally:
        server.stop()
