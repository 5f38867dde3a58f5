"""Checks of an EAGLE-3 head's fused level kernels (tandem.kernels.head_level, and the gathering
input norms of tandem.kernels.fused), shared by tests/test_head_level.py.

They run the kernels on the CPU through Triton's interpreter (in a process of its own:
`TRITON_INTERPRET=1 python tests/head_level_checks.py`, what the test starts), in fp32, against
the torch references. Each check raises AssertionError on failure and prints one line when it passes.
"""
from __future__ import annotations


import torch

from tandem.kernels import fused
from tandem.kernels import head_level as hl


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol, (name, err)


def check_head_topk() -> None:
    """Tokens equal the reference's, log-probs equal up to fp32 sums, `out` exactly r + delta, over
    row counts around the 16-row tile, widths that are not a multiple of the column step, a vocabulary
    that is not a multiple of the block, one block, k from 1 to 8; the counter is left zero, so a
    second launch (a graph's replay) merges again."""
    g = torch.Generator().manual_seed(0)
    counter = torch.zeros(1, dtype=torch.int32)
    for R, H, V, k, bv, bk in ((1, 96, 1000, 4, 128, 64), (5, 64, 300, 8, 64, 32), (16, 96, 128, 1, 128, 64),
                               (17, 40, 777, 3, 256, 16), (8, 128, 4096, 8, 128, 64),
                               (16, 96, 2048, 16, 128, 64)):  # (the block drafter's lattice: 16 rows, top 16)
        r, d = torch.randn(R, H, generator=g), torch.randn(R, H, generator=g)
        nw = 1 + 0.1 * torch.randn(H, generator=g)
        lm = torch.randn(V, H, generator=g) * 2 / H ** 0.5
        out_ref, lp_ref, tok_ref = hl.head_topk_ref(r, d, nw, 1e-5, lm, k)
        for pre in (True, False):  # (the first weight step before or after the PDL wait; twice: a replay)
            out, lp, tok, _ = hl.launch_head_topk(r, d, nw, 1e-5, lm, k, counter, bv=bv, bk=bk, pre=pre)
            assert torch.equal(out, out_ref), (R, H, V)
            assert torch.equal(tok, tok_ref), (R, H, V, k, tok, tok_ref)
            _close(f"log-probs {R}x{H}x{V}", lp, lp_ref)
            assert counter.item() == 0
    # ties: equal logits go to the lower id, within a block and across blocks
    H, V = 32, 512
    lm = torch.zeros(V, H)
    lm[[3, 200, 201, 450], 0] = 1.0  # four equal best logits, in three blocks
    lm[7, 0] = 2.0
    r = torch.zeros(2, H)
    r[:, 0] = 1.0
    _, lp, tok, _ = hl.launch_head_topk(r, torch.zeros_like(r), torch.ones(H), 1e-5, lm, 4, counter, bv=128,
                                        bk=32)
    assert tok.tolist() == [[7, 3, 200, 201]] * 2, tok
    # a 16-bit model's keys hold the score's own 16 bits and the id (fp16 here: the interpreter has no
    # bf16 arithmetic; the GPU lane runs bf16): negative scores, ties, and a random case equal the reference
    lm = torch.zeros(V, H)
    lm[:, 0] = -3.0
    lm[[3, 200, 201, 450], 0] = -1.0
    lm[7, 0] = -0.5
    h16 = torch.float16
    _, lp, tok, _ = hl.launch_head_topk(r.to(h16), torch.zeros_like(r).to(h16), torch.ones(H).to(h16), 1e-5,
                                        lm.to(h16), 4, counter, bv=128, bk=32)
    assert tok.tolist() == [[7, 3, 200, 201]] * 2, tok
    assert lp[0, 1] == lp[0, 2] == lp[0, 3] < lp[0, 0] < 0, lp
    R, H, V = 5, 64, 1000
    r, d = torch.randn(R, H, generator=g).to(h16), torch.randn(R, H, generator=g).to(h16)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(h16)
    lm = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(h16)
    out_ref, lp_ref, tok_ref = hl.head_topk_ref(r, d, nw, 1e-5, lm, 4)
    out, lp, tok, _ = hl.launch_head_topk(r, d, nw, 1e-5, lm, 4, counter, bv=128, bk=32)
    assert torch.equal(out, out_ref) and torch.equal(tok, tok_ref), (tok, tok_ref)
    _close("fp16 log-probs", lp, lp_ref, 1e-2)
    print("head_topk: ok")


def _levels_layout(g: torch.Generator, w: int, depth: int, zero_prob: bool) -> tuple[torch.Tensor, ...]:
    """A node layout as HeadLevels grows it: (lp, tok, par) with cumulative log-probs."""
    total = w + (depth - 1) * w * w
    par = torch.full((total,), -1, dtype=torch.long)
    lp = torch.zeros(total)

    def children() -> torch.Tensor:
        c = torch.log_softmax(torch.randn(w + 6, generator=g), 0)[:w].sort(descending=True).values
        if zero_prob:
            c[-1] = float("-inf")  # a child of probability 0
        return c

    lp[:w] = children()
    fed = list(range(w))
    for d in range(2, depth + 1):
        base = w + (d - 2) * w * w
        for s, f in enumerate(fed):
            par[base + s * w: base + (s + 1) * w] = f
            lp[base + s * w: base + (s + 1) * w] = lp[f] + children()
        fed = (base + hl.key_index(hl.score_keys(lp[base: base + w * w]).topk(w).values, w * w)).tolist()
    return lp, torch.randint(0, 5000, (total,), generator=g), par


def check_head_select() -> None:
    """The kernel's tree equals head_select_ref's (tokens, parents, depths, ancestors) for widths 1-8,
    node budgets from 1 to every node, children of probability 0, exact ties, and a layout whose size
    is not a power of two (the padding keys rank below every real one, -inf included)."""
    g = torch.Generator().manual_seed(1)
    root = torch.tensor([42])
    cases = 0
    for w, depth in ((1, 6), (2, 5), (4, 5), (8, 4), (3, 3)):
        for zero_prob in (False, True):
            lp, tok, par = _levels_layout(g, w, depth, zero_prob)
            total = lp.shape[0]
            for n in sorted({1, min(5, total), min(16, total), min(31, total), total}):
                want = hl.head_select_ref(lp, tok, par, root, w, depth, n)
                M = n + 1
                got = (torch.zeros(M, dtype=torch.long), torch.zeros(M, dtype=torch.long),
                       torch.zeros(M, dtype=torch.long), torch.zeros(M, M, dtype=torch.bool))
                hl.launch_head_select(lp, tok, par, root, w, depth, n, got)
                for name, a, b in zip(("tokens", "parents", "depth", "ancestors"), got, want):
                    assert torch.equal(a, b), (w, depth, n, zero_prob, name, a, b)
                cases += 1
    # exact ties: every child of a node at the same log-prob (the earlier node wins)
    lp = torch.tensor([-1.0, -1.0, -2.0, -2.0, -2.0, -2.0])
    par = torch.tensor([-1, -1, 0, 0, 1, 1])
    tok = torch.arange(10, 16)
    for n in (1, 3, 5):
        want = hl.head_select_ref(lp, tok, par, root, 2, 2, n)
        got = (torch.zeros(n + 1, dtype=torch.long), torch.zeros(n + 1, dtype=torch.long),
               torch.zeros(n + 1, dtype=torch.long), torch.zeros(n + 1, n + 1, dtype=torch.bool))
        hl.launch_head_select(lp, tok, par, root, 2, 2, n, got)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (n, got, want)
    assert cases >= 40, cases
    print("head_select: ok")


def check_eagle_qkv() -> None:
    """The q/k/v kernel with the EAGLE-3 input norms (and the gather) in its prologue equals the input
    norms then q/k/v: q, the residual bases, and the K/V rows at scattered slots, every other row untouched."""
    from tandem.kernels import fused_layer as fl

    g = torch.Generator().manual_seed(4)
    n_q, n_kv, D, cap = 3, 1, 64, 70
    for T, S, H, gather in ((1, 1, 96, True), (4, 1, 96, True), (5, 5, 128, False), (17, 4, 64, True)):
        embed = torch.randn(300, H, generator=g)
        hidden = torch.randn(S, H, generator=g)
        ids = torch.randint(0, 300, (T,), generator=g)
        src = torch.randint(0, S, (T,), generator=g) if gather else None
        we, wh = 1 + 0.1 * torch.randn(H, generator=g), 1 + 0.1 * torch.randn(H, generator=g)
        w = torch.randn((n_q + 2 * n_kv) * D, 2 * H, generator=g) / (2 * H) ** 0.5
        pos = torch.randint(0, 400, (T,), generator=g)
        slots = torch.randperm(cap, generator=g)[:T]
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D)).float()
        kv = [torch.randn(2, 1, n_kv, cap, D, generator=g) for _ in range(2)]
        kv[1].copy_(kv[0])
        want = hl.eagle_qkv_ref(ids, embed, hidden, src, we, wh, 1e-5, w, pos, inv, n_q, n_kv, kv[1][0], kv[1][1],
                                slots)
        for bk, cb in ((32, 16), (128, 32)):
            got_kv = kv[0].clone()
            got = hl.launch_eagle_qkv(ids, embed, hidden, src, we, wh, 1e-5, w, pos, inv, n_q, n_kv, got_kv[0],
                                      got_kv[1], slots, bk=bk, cb=cb)
            for name, a, b in zip(("q", "hidden", "normed hidden"), got, want):
                _close(f"eagle_qkv {name}", a, b, 1e-5)
            _close("eagle_qkv k/v", got_kv, kv[1], 1e-5)
            untouched = torch.ones(cap, dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(got_kv[..., untouched, :], kv[1][..., untouched, :])
    assert fl.BLOCK_M == 16  # (the rows 17 case spans two row blocks)
    print("eagle_qkv: ok")


def check_levels() -> None:
    """A tiny EAGLE-3 head's levels (HeadLevels) with every kernel on (the interpreter standing in for
    CUDA: the dispatchers' device test lifted) grow the same nodes as with none: the glue (the
    gather through `src`, rows, the counter, the masks, each level's glue in its top-k kernel, the
    root's in the context pass's) is checked, not only the kernels."""
    from models_for_tests import random_eagle3_head, tiny_model

    import tandem.kernels.attention as att
    import tandem.kernels.fused_layer as fl
    import tandem.kernels.resident as res
    from tandem.drafting.eagle_drafter import HeadLevels
    from tandem.runtime.runner import ModelRunner

    target = tiny_model(seed=4, hidden=128)
    tc = target.config
    head = random_eagle3_head(target, seed=5, scale=3.0)  # peaky: few near-ties between children

    def grow(w: int, depth: int) -> list[torch.Tensor]:
        runner = ModelRunner(head, capacity=64, use_graphs=False)
        lv = HeadLevels(runner, w, depth)
        prefix = 6
        ids = torch.randint(0, tc.vocab_size, (prefix,), generator=torch.Generator().manual_seed(6))
        hidden = torch.randn(prefix, tc.hidden_size, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            mask = torch.ones(prefix, runner.width_for(prefix + lv.rows), dtype=torch.bool).tril()
            lv.prefix.fill_(prefix)
            # the root's glue in the context pass's top-k (the resident loop's way) for w = 3
            root = head.layer_topk(ids, hidden, torch.arange(prefix), runner.cache, torch.arange(prefix), mask, w,
                                   rows=1, counter=lv.counter, glue=lv.glue(0, mask.shape[-1]) if w == 3 else None)
            lv._levels(mask.shape[-1], root)
        M = min(9, lv.nodes) + 1
        tree = (torch.zeros(M, dtype=torch.long), torch.zeros(M, dtype=torch.long), torch.zeros(M, dtype=torch.long),
                torch.zeros(M, M, dtype=torch.bool))
        hl.head_select(lv.lp, lv.tok, lv.par, ids[-1:], w, depth, M - 1, tree)
        return [lv.tok.clone(), lv.par.clone(), lv.lp.clone(), *tree]

    for w, depth in ((1, 4), (3, 4), (4, 3)):
        want = grow(w, depth)
        mods = (fused, hl, res, att)
        saved = [m.triton_enabled for m in mods], fl.applies
        for m in mods:
            m.triton_enabled = lambda t: True
        fl.applies = lambda x, wt, k=None: x.shape[0] <= fl.MAX_M and wt.shape[1] == (x.shape[-1] if k is None else k)
        calls = []
        real = hl.launch_head_topk
        hl.launch_head_topk = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            got = grow(w, depth)
        finally:
            for m, f in zip(mods, saved[0]):
                m.triton_enabled = f
            fl.applies, hl.launch_head_topk = saved[1], real
        assert len(calls) == depth, calls  # the context pass and every fed level went through the kernel
        for name, a, b in zip(("tok", "par", "lp", "tree tokens", "parents", "depth", "ancestors"), got, want):
            if a.dtype.is_floating_point:
                _close(f"levels {name}", a, b, 1e-4)  # cumulative log-probs, sums in another order
            else:
                assert torch.equal(a, b), (w, depth, name, a, b)
    print("levels through the fused kernels: ok")


def check_pass_views() -> None:
    """The resident loop's pass views (tandem.kernels.resident.context_view / tree_view): positions,
    slots and masks equal the torch references, widths beyond one column block included."""
    import tandem.kernels.resident as res

    for pmax, T, P, pre, width in ((9, 9, 3, 0, 32), (17, 32, 1, 40, 200), (17, 32, 17, 300, 512), (5, 5, 5, 7, 16)):
        Pt, pt = torch.tensor([P]), torch.tensor([pre])
        want = res.context_view_ref(Pt, pt, pmax, T, width, 99)
        got = (torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long),
               torch.zeros(T, width, dtype=torch.bool))
        res.launch_context_view(Pt, pt, pmax, T, width, 99, got)
        for name, a, b in zip(("positions", "slots", "mask"), got, want):
            assert torch.equal(a, b), ("context", pmax, T, P, name)
        # with the levels after the pass: the prefix advanced past its P rows, the levels' rows
        for L, w in ((7, 4), (1, 1), (3, 5)):
            lpos = torch.arange(L)[:, None].expand(L, w).contiguous()
            lslot = torch.arange(L * w).view(L, w)
            outs = {}
            for how in ("ref", "kernel"):
                pre_t = pt.clone()
                lv = (torch.zeros(1, dtype=torch.long), lpos, lslot, torch.zeros(L, w, dtype=torch.long),
                      torch.zeros(L, w, dtype=torch.long))
                views = tuple(torch.zeros_like(x) for x in got)
                (res.context_view if how == "ref" else res.launch_context_view)(Pt, pre_t, pmax, T, width, 99, views,
                                                                                lv)
                outs[how] = (pre_t,) + views + lv
            for a, b in zip(outs["kernel"], outs["ref"]):
                assert torch.equal(a, b), ("context levels", pmax, T, P, L, w)
            assert outs["ref"][0].item() == pre + P and torch.equal(outs["ref"][7], (pre + P) + lpos)
    g = torch.Generator().manual_seed(3)
    for M, pre, width in ((1, 5, 16), (33, 0, 64), (33, 100, 256), (65, 200, 300)):
        par = torch.full((M,), -1, dtype=torch.long)  # a random tree, parents first
        for i in range(1, M):
            par[i] = torch.randint(0, i, (1,), generator=g)
        depth = torch.zeros(M, dtype=torch.long)
        for i in range(1, M):
            depth[i] = depth[par[i]] + 1
        anc = res.ancestors(par, M)
        pt = torch.tensor([pre])
        want = res.tree_view_ref(pt, depth, anc, width)
        got = (torch.zeros(M, dtype=torch.long), torch.zeros(M, dtype=torch.long),
               torch.zeros(M, width, dtype=torch.bool))
        res._tree_view_kernel[(1,)](pt, depth, anc, *got, width, M=M, MP=fused.pow2(M), BW=128)
        for name, a, b in zip(("positions", "slots", "mask"), got, want):
            assert torch.equal(a, b), ("tree", M, pre, width, name)
    print("pass views: ok")


def check_commit_rows() -> None:
    """The resident loop's commit (tandem.kernels.resident.commit_rows): the cache's path rows moved to the
    prefix end as index_select then index_copy move them (a destination that is a later source included,
    and the identity rows past the accepted depth), every other row untouched, and the features gathered."""
    import tandem.kernels.resident as res

    g = torch.Generator().manual_seed(8)
    for layers, heads, rows, D, F, P in ((2, 1, 40, 64, 300, 5), (3, 2, 64, 32, 0, 9)):
        kv = torch.randn(2, layers, 1, heads, rows, D, generator=g)
        pre = 7
        path = [0, 2, 5, 9, 4][:P] if P <= 5 else [0, 1, 3, 6, 7, 5, 6, 7, 8]
        path = path[:3] + list(range(3, P))  # accepted depth 2: nodes 0, 2/1, 5/3, then identity rows
        src = torch.tensor([pre + x for x in path])
        dst = pre + torch.arange(P)
        feats = torch.randn(12, F, generator=g) if F else None
        node = torch.randint(0, 12, (P,), generator=g)
        want_kv, got_kv = kv.clone(), kv.clone()
        want_f = torch.zeros(P, F) if F else None
        got_f = torch.zeros(P, F) if F else None
        res.commit_rows_ref(want_kv, src, dst, feats, node, want_f)
        saved = res.triton_enabled
        res.triton_enabled = lambda t: True
        try:
            res.commit_rows(got_kv, src, dst, feats, node, got_f)
        finally:
            res.triton_enabled = saved
        assert torch.equal(got_kv, want_kv), (layers, heads, P)
        assert F == 0 or torch.equal(got_f, want_f)
    print("commit rows: ok")


def check_block_select() -> None:
    """The block drafter's tree selection kernel (tandem.kernels.resident.select_tree_fused, which
    shares the best-N and ancestor-mask helpers with head_select) equals select_tree_ref over level
    beams of random lattices, with and without padding (B x W not a power of two)."""
    import tandem.kernels.resident as res

    g = torch.Generator().manual_seed(6)
    for B, K, W, n in ((4, 4, 4, 8), (3, 4, 4, 10), (5, 8, 2, 9), (16, 16, 8, 32)):
        tok = torch.randint(0, 1000, (B, K), generator=g)
        cond = torch.log_softmax(torch.randn(B, K, K, generator=g), -1)
        scores, cands, pslots = res.beam_levels_ref(cond, W)
        n = min(n, B * W)
        root = torch.tensor([3])
        want = res.select_tree_ref(tok, root, scores, cands, pslots, n)
        got = (torch.zeros(n + 1, dtype=torch.long), torch.zeros(n + 1, dtype=torch.long),
               torch.zeros(n + 1, dtype=torch.long), torch.zeros(n + 1, n + 1, dtype=torch.bool))
        saved = res.triton_enabled
        res.triton_enabled = lambda t: True
        try:
            res.select_tree_fused(tok, root, scores, cands, pslots, n, got)
        finally:
            res.triton_enabled = saved
        for name, a, b in zip(("tokens", "parents", "depth", "ancestors"), got, want):
            assert torch.equal(a, b), (B, K, W, n, name, a, b)
    print("block select: ok")


if __name__ == "__main__":
    check_head_topk()
    check_head_select()
    check_eagle_qkv()
    check_levels()
    check_pass_views()
    check_commit_rows()
    check_block_select()
