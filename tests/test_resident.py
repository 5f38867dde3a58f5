"""The device-resident loop (tandem.runtime.resident) and its device-built tree
(tandem.drafting.device_tree): same tree as the host walk, same tokens as `ar`, same accepts as
the host-driven loop, and streaming / EOS / stop strings / max_new_tokens on its records."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models_for_tests import tiny_model, token_paths
from test_block_drafter import make_drafter
from tandem.config import GenerationConfig, SpecConfig
from tandem.drafting import device_tree as dt
from tandem.kernels import resident as kr
from tandem.drafting.lattice import Lattice, best_chain, best_first_tree
from tandem.runtime.generate import Generator
from tandem.tree.draft_tree import ancestor_mask


def _random_lattice(seed: int, B: int = 16, K: int = 16):
    g = torch.Generator().manual_seed(seed)
    tok = torch.stack([torch.randperm(500, generator=g)[:K] for _ in range(B)])  # distinct per position
    cond = torch.log_softmax(2 * torch.randn(B, K, K, generator=g), -1) - torch.rand(B, K, 1, generator=g)
    return tok, cond, Lattice(tokens=tok.numpy(), cond=cond.double().numpy())




@pytest.mark.parametrize("nodes", [1, 7, 32, 60])
def test_device_tree_is_the_host_best_first_tree(nodes):
    for seed in range(6):
        tok, cond, lat = _random_lattice(seed)
        want = best_first_tree(lat, 3, nodes)
        t, p, d, anc = dt.best_first_tree_device(tok, cond, torch.tensor([3]), nodes)
        t, p, d = t.tolist(), p.tolist(), d.tolist()
        assert torch.equal(anc, ancestor_mask(p))
        assert len(t) == nodes + 1 and t[0] == 3 and p[0] == -1
        assert all(0 <= p[i] < i for i in range(1, len(p)))  # prefix-closed, topological
        assert d == [0] + [d[p[i]] + 1 for i in range(1, len(p))]
        assert token_paths(t, p) == token_paths(want.tokens, want.parents)


def test_a_kept_narrow_tree_is_the_full_beams_tree():
    """The narrow first pass's rule (kernels.resident.narrow_tree_kept, what _tree_kernel decides on): over
    random lattices from flat to peaked, every narrow tree the rule keeps equals the full beams' tree, and
    the rule does reject narrow trees that differ (so it is needed) while keeping at least 100 of the cases."""
    kept = differ = 0
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        B, K = (16, 16) if seed % 3 else (6, 4)
        sharp = [0.05, 0.5, 2.0, 4.0][seed % 4]
        cond = torch.log_softmax(sharp * torch.randn(B, K, K, generator=g), -1)
        tok = torch.stack([torch.randperm(500, generator=g)[:K] for _ in range(B)])
        root = torch.tensor([3])
        for nodes in (7, 20, 32):
            width = 1 << (nodes - 1).bit_length()
            full = kr.select_tree_ref(tok, root, *kr.beam_levels_ref(cond, width, nodes), nodes)
            for narrow in (width // 2, width // 4):
                if narrow < 1 or B * narrow < nodes:
                    continue
                tree = kr.select_tree_ref(tok, root, *kr.beam_levels_ref(cond, narrow, nodes), nodes)
                same = all(torch.equal(a, b) for a, b in zip(tree, full))
                if kr.narrow_tree_kept(tree[2], narrow, B, K):
                    kept += 1
                    assert same, (seed, nodes, narrow)
                differ += not same
    assert kept >= 100 and differ >= 5, (kept, differ)


def test_device_chain_is_the_host_greedy_chain():
    for seed in range(6):
        tok, cond, lat = _random_lattice(seed)
        t, p, d = dt.best_chain_device(tok, cond, torch.tensor([9]), 8)
        assert t.tolist() == best_chain(lat, 9, 8).tokens
        assert p.tolist() == list(range(-1, 8)) and d.tolist() == list(range(9))


def test_level_beams_break_ties_toward_the_earlier_candidate():
    cond = torch.zeros(3, 4, 4) - 1.0  # every candidate ties
    scores, cands, pslots = kr.beam_levels_ref(cond, 4)
    assert cands[0].tolist() == [0, 1, 2, 3] and pslots[1].tolist() == [0, 0, 0, 0]
    assert torch.equal(scores[2], torch.full((4,), -3.0))


def test_score_keys_order_like_the_floats():
    x = torch.tensor([-0.0, 0.0, -1.5, 2.0, float("-inf"), -1e-30, 3.0, -1.5])
    keys = kr.score_keys(x)
    assert torch.equal(kr.key_score(keys), x)
    order = keys.argsort(descending=True).tolist()
    assert [x[i].item() for i in order] == sorted(x.tolist(), reverse=True)
    assert order.index(2) < order.index(7)  # equal scores: the lower index first


def test_ancestors_equal_the_host_mask():
    parents = [-1, 0, 1, 1, 0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 2]
    assert torch.equal(kr.ancestors(torch.tensor(parents), 16), ancestor_mask(parents))


# ---- decoding -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    target = tiny_model(seed=3)
    return target, make_drafter(target)


@pytest.mark.parametrize("method,spec", [("ar", SpecConfig()), ("chain", SpecConfig(k=4)),
                                         ("tree", SpecConfig(nodes=12)), ("tree", SpecConfig(nodes=40))])
def test_resident_greedy_equals_ar_on_a_tiny_pair(tiny, method, spec):
    target, draft = tiny
    ar = Generator(target, None, use_graphs=False, resident=False)
    res = Generator(target, draft, use_graphs=False, resident=True)
    g = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for p in ([1, 5, 9, 2], [7], list(range(3, 90))):  # 87 tokens: the prompt's context is fed in chunks
        want = ar.generate(p, "ar", gen=g).token_ids
        got = res.generate(p, method, spec, gen=g)
        assert got.token_ids == want
        assert got.target_passes == len(got.accept_lengths) and got.verify_seconds > 0


def test_resident_ar_queues_no_step_past_the_end(tiny, monkeypatch):
    """`ar` commits one token a step, so the loop queues exactly max_new_tokens steps: the steps it
    queues ahead of the one it reads stop where the request ends (before, LAG more ran and were
    thrown away, and the request waited for them). A tree's steps commit a varying count: its
    tokens still equal `ar`'s whatever the loop holds back."""
    from tandem.runtime.resident import ResidentLoop

    target, draft = tiny
    runs: list[str] = []
    real = ResidentLoop._run
    monkeypatch.setattr(ResidentLoop, "_run", lambda self, part, width: (runs.append(part), real(self, part, width)))
    res = Generator(target, draft, use_graphs=False, resident=True)
    g = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    want = res.generate([1, 5, 9, 2], "ar", gen=g)
    assert len(want.token_ids) == 20 and runs.count("verify") == 20 and "draft" not in runs
    assert want.passes_past_end == 0
    runs.clear()
    got = res.generate([1, 5, 9, 2], "tree", SpecConfig(nodes=12), gen=g)
    assert got.token_ids == want.token_ids
    assert runs.count("draft") == runs.count("verify") == got.target_passes + got.passes_past_end
    monkeypatch.setenv("TANDEM_RESIDENT_HOLD", "0")  # the A/B switch: LAG steps queued past the end, as before
    runs.clear()
    assert res.generate([1, 5, 9, 2], "ar", gen=g).passes_past_end == 2 == runs.count("verify") - 20
    monkeypatch.setenv("TANDEM_RESIDENT_HOLD", "half")
    with pytest.raises(ValueError, match="TANDEM_RESIDENT_HOLD='half' is not a number; use 0"):
        res.generate([1, 5, 9, 2], "ar", gen=g)


@pytest.mark.parametrize("method,spec", [("chain", SpecConfig(k=4)), ("tree", SpecConfig(nodes=12, width=3)),
                                         ("tree", SpecConfig(nodes=40, width=4, depth=6))])
@pytest.mark.parametrize("same", [True, False], ids=["self-draft", "other-draft"])
def test_resident_draft_model_equals_ar(tiny, same, method, spec):
    """A small draft model grows its tree level by level in the resident loop (DraftAsHead):
    greedy output equals ar whether its guesses are all right (the target as its own draft:
    every level accepted, the deepest paths and K/V moves) or mostly wrong (another model)."""
    target, _ = tiny
    draft = tiny_model(seed=3) if same else tiny_model(seed=8)
    ar = Generator(target, None, use_graphs=False, resident=False)
    res = Generator(target, draft, use_graphs=False, resident=True)
    g = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for p in ([1, 5, 9, 2], list(range(3, 90))):
        got = res.generate(p, method, spec, gen=g)
        assert got.loop == "resident" and got.token_ids == ar.generate(p, "ar", gen=g).token_ids
        deepest = spec.k if method == "chain" else spec.resolved_depth()
        if same and method == "chain":  # each pass accepts the whole chain, then the bonus
            assert got.accept_lengths[:-1] == [deepest] * (len(got.accept_lengths) - 1)
        elif same:  # the N best nodes need not reach the deepest level, but the argmax path is deep
            assert min(got.accept_lengths[:-1]) >= 2 and max(got.accept_lengths) == deepest


def _bundled(kind: str = "block"):
    from tandem.runtime.pair import BUNDLED_TARGET, load_pair

    if not (BUNDLED_TARGET / "config.json").is_file():
        pytest.skip("no bundled target")
    return load_pair(None, kind, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("kind,method,spec", [("block", "chain", SpecConfig(k=8)), ("block", "tree", SpecConfig(nodes=32)),
                                              ("eagle3", "chain", SpecConfig(k=5)),
                                              ("eagle3", "tree", SpecConfig(nodes=32, width=4))])
def test_resident_loop_accepts_what_the_host_loop_accepts(kind, method, spec):
    """The bundled target and its trained block drafter / EAGLE-3 head: same tokens as ar, and
    pass for pass the same accept counts as the host-driven loop (the same drafter context, tree
    and features)."""
    pair = _bundled(kind)
    host = Generator(pair.target, pair.draft, use_graphs=False, resident=False)
    res = Generator(pair.target, pair.draft, use_graphs=False, resident=True)
    g = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    texts = ["import numpy as np\n\ndef mean(xs):\n    ",
             "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):" * 4]
    for text in texts:
        p = pair.tokenizer.encode(text).ids
        want = host.generate(p, "ar", gen=g).token_ids
        a, b = host.generate(p, method, spec, gen=g), res.generate(p, method, spec, gen=g)
        assert b.token_ids == want == a.token_ids
        assert b.accept_lengths == a.accept_lengths
        assert b.tau > 1.5  # the drafter's proposals were accepted: the tree path was exercised


@pytest.mark.parametrize("method,spec", [("chain", SpecConfig(k=5)), ("tree", SpecConfig(nodes=32, width=4))])
def test_resident_loop_with_the_bundled_draft_model_equals_ar(method, spec):
    """The bundled small draft model in the resident loop: its tree is EAGLE-2's level tree, not
    the host loop's best-first rounds, so only the tokens (equal to ar) and the depth of its
    accepts are compared."""
    pair = _bundled("draft")
    host = Generator(pair.target, pair.draft, use_graphs=False, resident=False)
    res = Generator(pair.target, pair.draft, use_graphs=False, resident=True)
    g = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    p = pair.tokenizer.encode("import numpy as np\n\ndef mean(xs):\n    ").ids
    got = res.generate(p, method, spec, gen=g)
    assert got.loop == "resident" and got.token_ids == host.generate(p, "ar", gen=g).token_ids
    assert got.tau > 1.5


def test_resident_streams_and_stops_like_the_host_loop(monkeypatch):
    import dataclasses

    pair = _bundled()
    host = Generator(pair.target, pair.draft, tokenizer=pair.tokenizer, use_graphs=False, resident=False)
    res = Generator(pair.target, pair.draft, tokenizer=pair.tokenizer, use_graphs=False, resident=True)
    p = pair.tokenizer.encode("def fib(n):\n").ids
    full = host.generate(p, "tree", SpecConfig(nodes=32), gen=GenerationConfig(max_new_tokens=40, ignore_eos=True))
    eos = full.token_ids[9]  # treat the tenth new token as EOS: generation must end on it
    with monkeypatch.context() as m:
        m.setattr(pair.target, "config", dataclasses.replace(pair.target.config, eos_token_ids=(eos,)))
        chunks: list[list[int]] = []
        r = res.generate(p, "tree", SpecConfig(nodes=32), gen=GenerationConfig(max_new_tokens=40),
                         on_tokens=chunks.append)
    first = full.token_ids.index(eos)
    assert r.finish_reason == "eos" and r.token_ids == full.token_ids[:first + 1]
    assert sum(chunks, []) == r.token_ids and len(chunks) >= 2  # streamed as the records arrived
    one = res.generate(p, "tree", SpecConfig(nodes=32), gen=GenerationConfig(max_new_tokens=1, ignore_eos=True))
    assert one.token_ids == full.token_ids[:1] and one.finish_reason == "length"
    stop = pair.tokenizer.decode(full.token_ids[5:8])
    gs = GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=[stop])
    a, b = host.generate(p, "tree", SpecConfig(nodes=32), gen=gs), res.generate(p, "tree", SpecConfig(nodes=32), gen=gs)
    assert b.finish_reason == "stop" == a.finish_reason and b.stop_trimmed_text == a.stop_trimmed_text
    end = next(k for k in range(1, 41) if stop in pair.tokenizer.decode(full.token_ids[:k]))
    assert b.token_ids == a.token_ids == full.token_ids[:end]  # none past the token that completed the stop


def test_resident_is_off_on_the_cpu_by_default(tiny, monkeypatch):
    from tandem.config import SamplingConfig

    target, draft = tiny
    gen = Generator(target, draft, use_graphs=False)
    assert not gen._resident("tree", SamplingConfig(), None)
    on = Generator(target, draft, use_graphs=False, resident=True)
    assert on._resident("tree", SamplingConfig(), None) and on._resident("ar", SamplingConfig(), None)
    assert on._resident("tree", SamplingConfig(temperature=0.8), None)  # sampling: the sampled walk
    assert on._resident("tree", SamplingConfig(), [1, 2])  # greedy acceptance replay runs resident too
    assert not on._resident("tree", SamplingConfig(temperature=0.8), [1, 2])  # a sampled replay: the host loop
    assert Generator(target, tiny_model(seed=4), resident=True)._resident("tree", SamplingConfig(), None)  # a draft model
    np.testing.assert_equal(on._resident("async", SamplingConfig(), None), False)


@pytest.mark.parametrize("markov", [8, 0])
def test_the_resident_lattice_is_the_drafters_lattice(tiny, markov):
    """kernels.resident.lattice_ref (what the resident step computes from the B rows' logits)
    equals BlockDrafter.lattice_rows + lattice.unpack_lattice (what the host loop reads)."""
    from tandem.drafting.lattice import unpack_lattice
    from tandem.kernels.resident import lattice_ref

    target, _ = tiny
    draft = make_drafter(target, block=5, k=4, markov=markov, seed=1)
    logits = torch.randn(1, 5, target.config.vocab_size)
    ids = torch.tensor([[11] + [draft.mask_id] * 4])  # the root's row, then mask rows
    want = unpack_lattice(draft.lattice_rows(logits, ids)[0], 4)
    tok_want, cond_want = torch.from_numpy(want.tokens), torch.from_numpy(want.cond).float()
    tok, cond = lattice_ref(logits[0], torch.tensor([11]), draft.markov_u, draft.markov_v, 4)
    assert torch.equal(tok, tok_want)
    torch.testing.assert_close(cond[1:], cond_want[1:])
    torch.testing.assert_close(cond[0, 0], cond_want[0, 0])  # the root's children (its other rows are unused)


def test_resident_stops_at_the_context_window(tiny):
    """A prompt a few tokens short of the context window: the caches hold the queued steps past
    the end, and the output is ar's, cut where the window ends."""
    target, draft = tiny
    ctx = Generator(target, draft).context_window
    prompt = [(7 * i) % 50 + 1 for i in range(ctx - 6)]
    g = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    want = Generator(target, None, use_graphs=False, resident=False).generate(prompt, "ar", gen=g).token_ids
    assert len(want) == 6
    res = Generator(target, draft, use_graphs=False, resident=True)
    for method in ("ar", "chain", "tree"):
        assert res.generate(prompt, method, SpecConfig(k=4, nodes=12), gen=g).token_ids == want


def test_every_resident_path_is_on_by_default_on_cuda_and_off_when_asked(monkeypatch, tmp_path):
    """Validated on the H200 (the GPU lane), every drafter's resident loop and sampling are on by
    default there; TANDEM_RESIDENT=0 selects the host-driven loop."""
    from tandem.config import SamplingConfig
    from tandem.runtime import generate as G

    target = tiny_model(seed=3)
    from test_eagle3 import write_head
    from tandem.models.eagle3 import load_eagle3

    write_head(tmp_path / "h", target)
    head = load_eagle3(tmp_path / "h", target, "cpu", torch.float32)
    block = make_drafter(target)

    class FakeCuda:  # what _resident reads of the device: its type
        type = "cuda"

    monkeypatch.setattr(type(target), "device", property(lambda self: FakeCuda()))
    greedy, sampled = SamplingConfig(), SamplingConfig(temperature=0.7)
    monkeypatch.delenv("TANDEM_RESIDENT", raising=False)
    for draft in (block, head, tiny_model(seed=4)):
        for s in (greedy, sampled):
            assert G.Generator(target, draft)._resident("tree", s, None)
            assert G.Generator(target, draft)._resident("chain", s, None)
        assert not G.Generator(target, draft, use_graphs=False)._resident("tree", greedy, None)  # graphs off
    assert G.Generator(target, None)._resident("ar", greedy, None)
    monkeypatch.setenv("TANDEM_RESIDENT", "0")
    assert not G.Generator(target, block)._resident("tree", greedy, None)
    assert not G.Generator(target, None)._resident("ar", greedy, None)


@pytest.mark.parametrize("kind", ["block", "eagle3"])
def test_sampled_resident_loop_draws_what_the_host_loop_draws(kind):
    """Sampling: on the CPU the resident walk (kernels.resident.sample_walk_ref) consumes the
    request's generator draw for draw as rejection_accept does, so with the same seed the resident
    loop's tokens and accepts equal the host loop's: the same lossless rejection sampling."""
    from tandem.config import SamplingConfig

    pair = _bundled(kind)
    host = Generator(pair.target, pair.draft, use_graphs=False, resident=False)
    res = Generator(pair.target, pair.draft, use_graphs=False, resident=True)
    g = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    p = pair.tokenizer.encode("def fib(n):\n").ids
    taus = []
    for method, spec in (("ar", SpecConfig()), ("chain", SpecConfig(k=5)), ("tree", SpecConfig(nodes=32, width=4))):
        for s in (SamplingConfig(temperature=0.8, seed=3), SamplingConfig(temperature=1.0, top_p=0.9, seed=5)):
            a, b = host.generate(p, method, spec, sampling=s, gen=g), res.generate(p, method, spec, sampling=s, gen=g)
            assert b.token_ids == a.token_ids and b.accept_lengths == a.accept_lengths, (method, s)
            taus.append(b.tau)
    assert max(taus) > 1.5  # drafts were accepted under sampling: the walk went down the tree


def test_results_say_which_loop_decoded_them(tiny):
    target, draft = tiny
    g = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    assert Generator(target, draft, use_graphs=False, resident=True).generate([1, 2], "tree", gen=g).loop == "resident"
    assert Generator(target, draft, use_graphs=False, resident=False).generate([1, 2], "tree", gen=g).loop == "host"


def test_resident_replays_recorded_accept_counts(tiny):
    """Acceptance replay (bench --replay) in the resident loop: a chain accepts exactly the
    recorded count (capped at k), a tree the recorded count capped at its deepest node; the
    counts cycle as the host loop's replay does."""
    target, draft = tiny
    forced = [0, 3, 1, 7, 2, 5]
    g = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    res = Generator(target, draft, use_graphs=False, resident=True)
    r = res.generate([1, 5, 9, 2], "chain", SpecConfig(k=4), gen=g, forced_accepts=forced)
    assert r.loop == "resident"
    want = [min(forced[i % len(forced)], 4) for i in range(len(r.accept_lengths))]
    assert r.accept_lengths[:-1] == want[:-1]  # (the last pass may be cut by max_new_tokens)
    t = res.generate([1, 5, 9, 2], "tree", SpecConfig(nodes=12), gen=g, forced_accepts=forced)
    assert all(a <= forced[i % len(forced)] for i, a in enumerate(t.accept_lengths))
    assert max(t.accept_lengths) >= 3
