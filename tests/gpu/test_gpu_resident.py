"""GPU lane: the device-resident loop (CUDA graphs of the whole step) decodes what an uncached
forward says, and accepts what the host-driven loop accepts.

On the GPU: the bundled pair's target with its trained block drafter in fp32, real graphs;
on the CPU: a tiny model and a random block drafter, the bodies run eagerly."""
from __future__ import annotations

import pytest
import torch

from gpu_lane import PROMPTS, cpu, cuda, first_wrong_token, graphs_for
from models_for_tests import tiny_model
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.generate import Generator


def _pair(device: str, kind: str):
    if device == "cuda":
        from tandem.runtime.pair import load_pair

        pair = load_pair(None, kind, device="cuda", dtype="float32")
        return pair.target, pair.draft, [pair.tokenizer.encode(p).ids for p in PROMPTS]
    target = tiny_model(seed=3)
    if kind == "block":
        from test_block_drafter import make_drafter

        draft = make_drafter(target)
    elif kind == "draft":
        draft = tiny_model(seed=4)
    else:
        import tempfile
        from pathlib import Path

        from test_eagle3 import write_head
        from tandem.models.eagle3 import load_eagle3

        d = Path(tempfile.mkdtemp()) / "head"
        write_head(d, target)
        draft = load_eagle3(d, target, "cpu", torch.float32)
    return target, draft, [[5, 17, 3, 88], list(range(10, 90))]


@pytest.mark.parametrize("kind,method,spec", [("block", "ar", SpecConfig()), ("block", "chain", SpecConfig(k=8)),
                                              ("block", "tree", SpecConfig(nodes=32)),
                                              ("eagle3", "chain", SpecConfig(k=5)),
                                              ("eagle3", "tree", SpecConfig(nodes=32, width=4)),
                                              ("draft", "tree", SpecConfig(nodes=32, width=4)),
                                              # the shallow shapes `auto` may choose (tandem.runtime.auto)
                                              ("draft", "chain", SpecConfig(k=1)),
                                              ("draft", "tree", SpecConfig(nodes=32, width=4, depth=2)),
                                              ("eagle3", "chain", SpecConfig(k=1)),
                                              ("eagle3", "tree", SpecConfig(nodes=32, width=4, depth=3))],
                         ids=["ar", "block-chain", "block-tree", "eagle3-chain", "eagle3-tree", "draft-tree",
                              "draft-chain1", "draft-tree-d2", "eagle3-chain1", "eagle3-tree-d3"])
@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
def test_resident_loop_matches_an_uncached_forward_and_the_host_loop(device, kind, method, spec):
    target, draft, prompts = _pair(device, kind)
    res = Generator(target, draft, use_graphs=graphs_for(device), resident=True)
    host = Generator(target, draft, use_graphs=graphs_for(device), resident=False)
    gen = GenerationConfig(max_new_tokens=96, ignore_eos=True)
    for prompt in prompts:
        r = res.generate(prompt, method, spec, gen=gen)
        assert r.new_tokens == 96
        wrong = first_wrong_token(target, prompt, r.token_ids)
        assert wrong is None, (method, prompt[:8], wrong)
        h = host.generate(prompt, method, spec, gen=gen)
        if kind == "draft":  # its host loop grows best-first rounds, not the levels: only the tokens compare
            assert h.token_ids == r.token_ids or first_wrong_token(target, prompt, h.token_ids) is None
        elif h.token_ids == r.token_ids and device == "cpu":  # (a near-tie may split them; then the passes differ too)
            assert r.accept_lengths == h.accept_lengths
        elif h.token_ids == r.token_ids:
            # on CUDA the two loops' draft passes run different kernels (graph shapes, the levels'
            # batching), so a near-tie between draft scores may pick another node now and then
            # (once one pass differs the later ones shift, so compare the passes' count)
            assert abs(len(r.accept_lengths) - len(h.accept_lengths)) <= 0.1 * len(h.accept_lengths), \
                (r.accept_lengths, h.accept_lengths)
        if device == "cuda" and method != "ar":
            # the trained drafter's trees were accepted deep (a one-token chain commits at most 2)
            assert r.tau > (1.3 if method == "chain" and spec.k == 1 else 1.5)


@pytest.mark.parametrize("device", [cuda("cuda", id="cuda")])
@torch.no_grad()  # the kernels have no backward: with grad enabled the references would run
def test_resident_kernels_equal_their_references(device):
    """The Triton lattice, tree selection and accept of the resident step against their torch
    references (random lattices, trees and target outputs; fp32)."""
    from tandem.kernels import resident as kr

    assert kr.triton_enabled(torch.zeros(1, device=device)), "the Triton path must be the one tested"

    g = torch.Generator().manual_seed(0)
    B, V, K, R = 16, 8192, 16, 64
    for markov in (True, False):
        logits = (3 * torch.randn(B, V, generator=g)).to(device)
        root = torch.tensor([5], device=device)
        u = (0.5 * torch.randn(V, R, generator=g)).to(device) if markov else None
        v = (0.5 * torch.randn(V, R, generator=g)).to(device) if markov else None
        lp, tok = kr.topk_logprobs(logits, K)  # (the loop takes them from head_topk, checked in its lane)
        cond = kr.lattice_cond(tok, lp, root, u, v)
        tok_r, cond_r = kr.lattice_ref(logits, root, u, v, K)
        assert torch.equal(tok, tok_r)
        torch.testing.assert_close(cond, cond_r, atol=1e-4, rtol=1e-4)
    # the block drafter's input rows (tandem.kernels.block_input) at the bundled drafter's shape, fp32 and bf16
    from tandem.kernels.block_input import block_input, block_input_ref

    P, T, H, Fw = 17, 32, 384, 1152
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        args = [torch.randint(0, V, (P,), generator=g), 3 * torch.randn(P, Fw, generator=g),
                torch.randn(V, H, generator=g), torch.randn(H, generator=g), 1 + 0.1 * torch.randn(Fw, generator=g)]
        args = [a.to(device) if a.dtype == torch.long else a.to(device, dtype) for a in args]
        fc = (torch.randn(H, Fw, generator=g) / Fw ** 0.5).to(device, dtype)
        with torch.no_grad():
            got = block_input(*args, 1e-5, fc, T)
        want = block_input_ref(*args, 1e-5, fc, T)
        assert torch.equal(got[P:], args[3].expand(T - P, H))
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # an EAGLE level's top-w children: [w, V] rows, a single [V] row, more leading dims; in bf16
    # ties are common and may come in another order than torch's, so there only the values
    for dtype in (torch.float32, torch.bfloat16):
        for shape, w in (((4, V), 4), ((V,), 4), ((2, 3, 1000), 3)):
            x = (3 * torch.randn(*shape, generator=g)).to(device, dtype)
            lp, tk = kr.topk_logprobs(x, w)
            ref = torch.log_softmax(x.float(), -1).topk(w, dim=-1)
            assert lp.shape == tk.shape == (*shape[:-1], w)
            torch.testing.assert_close(lp, ref.values, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(x.gather(-1, tk), x.gather(-1, ref.indices), atol=0, rtol=0)
            if dtype == torch.float32:
                assert torch.equal(tk, ref.indices)
    # the EAGLE-2 level glue (HeadLevels): every level of a few (w, depth) shapes, random state
    for W, depth in ((4, 8), (2, 4), (1, 5)):
        R, nodes_n = (depth - 1) * W, W + (depth - 1) * W * W
        for d in range(depth):
            P = 1 if d == 0 else W
            lo = 0 if d <= 1 else W + (d - 2) * W * W
            fed0 = (lo + torch.randperm(W if d <= 1 else W * W, generator=g)[:W]) if d else torch.zeros(W, dtype=torch.long)
            state = [torch.randint(0, 100, (nodes_n,), generator=g), torch.randint(-1, 5, (nodes_n,), generator=g),
                     torch.randn(nodes_n, generator=g), fed0, torch.zeros(W, dtype=torch.long),
                     torch.zeros(W, dtype=torch.long), torch.rand(R, R, generator=g) < 0.3]
            ctok, clp = torch.randint(0, 50, (P, W), generator=g), -3 * torch.rand(P, W, generator=g)
            d2t = torch.randint(0, 20, (50,), generator=g)
            outs = []
            for fn in (kr.level_step_ref, kr.level_step):
                st = [t.clone().to(device) for t in state]
                m = fn(ctok.to(device), clp.to(device), d2t.to(device), *st, torch.tensor([37], device=device), d, 300,
                       d + 1 < depth)
                outs.append(st + [m])
            for a, b in zip(*outs):
                assert (a is None and b is None) or torch.equal(a, b) or torch.allclose(a, b), (W, depth, d)
    for nodes in (7, 32, 60):
        tok = torch.stack([torch.randperm(500, generator=g)[:K] for _ in range(B)]).to(device)
        cond = (torch.log_softmax(2 * torch.randn(B, K, K, generator=g), -1)).to(device)
        W = 1 << (nodes - 1).bit_length()
        beams = kr.beam_levels(cond, W)
        assert all(torch.equal(a, b) for a, b in zip(beams, kr.beam_levels_ref(cond, W)))
        stopped = kr.beam_levels(cond, W, nodes)  # the early stop: the same N best, so the same tree
        assert all(torch.equal(a, b) for a, b in zip(stopped, kr.beam_levels_ref(cond, W, nodes)))
        assert all(torch.equal(a, b) for a, b in zip(kr.select_tree_ref(tok, root, *stopped, nodes),
                                                     kr.select_tree_ref(tok, root, *beams, nodes)))
        M = nodes + 1
        out = (torch.zeros(M, dtype=torch.long, device=device), torch.zeros(M, dtype=torch.long, device=device),
               torch.zeros(M, dtype=torch.long, device=device), torch.zeros(M, M, dtype=torch.bool, device=device))
        kr.select_tree_fused(tok, root, *beams, nodes, out)
        ref = kr.select_tree_ref(tok, root, *beams, nodes)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        one = tuple(torch.zeros_like(o) for o in out)  # the beams and the selection in one launch
        assert kr.tree_fused(tok, root, cond, W, nodes, one)
        assert all(torch.equal(a, b) for a, b in zip(one, ref))
        for narrow in (W // 2, W // 4):  # a narrow first pass (kept, or followed by the full beams): the same tree
            for c in (cond, torch.log_softmax(0.05 * cond, -1)):  # peaked, and flat (wide levels: redone)
                want = kr.select_tree_ref(tok, root, *kr.beam_levels_ref(c, W), nodes)
                for w in (1, 4):
                    kr.launch_tree(tok, root, c, W, nodes, one, num_warps=w, narrow=narrow)
                    assert all(torch.equal(a, b) for a, b in zip(one, want)), (nodes, narrow, w)
        t, p, d, anc = ref
        for trial in range(8):  # target outputs that accept 0..7 levels down a random path
            am = torch.randint(0, 500, (M,), generator=g).to(device)
            node = 0
            for _ in range(trial):
                kids = (p == node).nonzero().flatten().tolist()
                if not kids:
                    break
                c = kids[trial % len(kids)]
                am[node] = t[c]
                node = c
            states = []
            for fused in (True, False):
                st = {k: torch.zeros(17, dtype=torch.long, device=device) for k in ("kv_src", "kv_dst", "node", "ctx")}
                st["P"] = torch.zeros(1, dtype=torch.long, device=device)
                st["rec"] = torch.zeros(20, dtype=torch.long, device=device)
                prefix = torch.tensor([40], device=device)
                if fused:
                    kr.accept_fused(am, t, p, d, anc, prefix, 17, st)
                else:
                    accepted, bonus, path, ctx, nd = kr.accept_ref(am, t, p, d, anc, prefix, 17)
                    st = {"ctx": ctx, "node": nd, "kv_src": 40 + path, "P": accepted + 1}
                states.append((prefix, st))
            (pk, sk), (_, sr) = states
            assert int(pk) == 40 + int(sr["P"])
            for k in ("ctx", "node", "kv_src"):
                assert torch.equal(sk[k], sr[k]), k
            assert int(sk["P"]) == int(sr["P"]) and int(sk["rec"][0]) == int(sr["P"])
            assert sk["rec"][3:].tolist() == sr["ctx"].tolist()


@pytest.mark.parametrize("device", [cuda("cuda", id="cuda")])
@torch.no_grad()
def test_the_sampled_walk_kernel_follows_the_target(device):
    """The Triton walk: point masses give the determined path; with random distributions the first
    committed token follows the root's distribution whatever the children (lossless), and each
    call draws anew (the seed advances)."""
    from tandem.kernels import resident as kr

    assert kr.triton_enabled(torch.zeros(1, device=device))
    tok = torch.tensor([7, 3, 5, 1, 2], device=device)
    par = torch.tensor([-1, 0, 0, 1, 3], device=device)
    V = 16
    probs = torch.zeros(5, V, device=device)
    probs[0, 3] = probs[1, 1] = probs[3, 6] = probs[2, 0] = probs[4, 4] = 1.0
    out = torch.zeros(5, dtype=torch.long, device=device)
    seed = torch.tensor([11], device=device)
    kr.sample_walk(probs, tok, par, seed, None, out)
    assert out.tolist() == [3, 1, -1, 6, -1] and seed.item() == 12
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(5, V, generator=g).to(device)
    probs[0] = torch.softmax(torch.randn(V, generator=g), 0).to(device)
    probs = probs / probs.sum(-1, keepdim=True)
    n = 8000
    counts = torch.zeros(V)
    for _ in range(n):
        kr.sample_walk(probs, tok, par, seed, None, out)
        counts[int(out[0])] += 1
    # total variation between the empirical first-token law and the root's distribution
    tv = 0.5 * (counts / n - probs[0].cpu()).abs().sum().item()
    assert tv < 0.05, tv  # ~0.02 expected from n draws alone


@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
def test_resident_replay_accepts_the_recorded_counts(device):
    """Acceptance replay inside the captured graphs: a chain of k accepts min(recorded, k)."""
    target, draft, prompts = _pair(device, "block")
    forced = [0, 3, 1, 7, 2, 5]
    res = Generator(target, draft, use_graphs=graphs_for(device), resident=True)
    r = res.generate(prompts[0], "chain", SpecConfig(k=4), gen=GenerationConfig(max_new_tokens=48, ignore_eos=True),
                     forced_accepts=forced)
    assert r.loop == "resident"
    assert r.accept_lengths[:-1] == [min(forced[i % len(forced)], 4) for i in range(len(r.accept_lengths) - 1)]


@pytest.mark.parametrize("device", [cuda("cuda", id="cuda")])
@pytest.mark.parametrize("kind,method,spec", [("eagle3", "ar", SpecConfig()),
                                              ("eagle3", "tree", SpecConfig(nodes=32, width=4)),
                                              ("block", "tree", SpecConfig(nodes=32))], ids=["ar", "eagle3", "block"])
def test_programmatic_dependent_launch_changes_no_token(device, kind, method, spec, monkeypatch):
    # tandem.kernels.fused.pdl: each Triton kernel of the captured graphs may start while the one
    # before it runs and waits for its results in-kernel. A wait placed after a read of the previous
    # kernel's output would show here as different tokens or accepted counts (bf16: a real run's dtype)
    from tandem.kernels import fused
    from tandem.runtime.pair import load_pair

    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TANDEM_PDL", flag)
        assert bool(fused.pdl(torch.zeros(1, device="cuda"))) == (flag == "1")  # a Hopper GPU: PDL is on
        pair = load_pair(None, kind, device="cuda", dtype="bfloat16")  # fresh graphs, captured under the flag
        gen = Generator(pair.target, pair.draft, use_graphs=True, resident=True)
        runs[flag] = [gen.generate(pair.tokenizer.encode(p).ids, method, spec,
                                   gen=GenerationConfig(max_new_tokens=96, ignore_eos=True)) for p in PROMPTS]
    for off, on in zip(runs["0"], runs["1"]):
        assert on.token_ids == off.token_ids
        assert on.accept_lengths == off.accept_lengths
