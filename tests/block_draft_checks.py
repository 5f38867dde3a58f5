"""Checks of the block drafter's draft-pass kernels (tandem.kernels.block_input, and the lattice's
parent-conditioned log-probs and level beams of tandem.kernels.resident), shared by tests/test_block_drafter.py.

They run the kernels on the CPU through Triton's interpreter (in a process of its own:
`TRITON_INTERPRET=1 python tests/block_draft_checks.py`, what the test starts), against the torch
references. Each check raises AssertionError on failure and prints one line when it passes.
"""
from __future__ import annotations

import torch

from tandem.kernels import block_input as bi
from tandem.kernels import resident as res
from tandem.kernels.fused import pow2


def check_block_input() -> None:
    """The input rows equal the reference (fp32: up to the order of fc's sums; fp16: equal after the
    same roundings up to one unit where fc's fp32 sums round differently), the mask rows exactly the
    mask embedding, over row counts around the 16-row tile, feature widths that are not a multiple of
    the step and hidden sizes that are not a multiple of the column block."""
    g = torch.Generator().manual_seed(0)
    for P, T, H, Fw, V, bn, bk in ((17, 32, 96, 288, 50, 32, 128), (1, 5, 40, 100, 20, 16, 64),
                                   (9, 9, 64, 192, 30, 32, 64), (20, 35, 48, 72, 40, 32, 32)):
        tok = torch.randint(0, V, (P,), generator=g)
        feat = torch.randn(P, Fw, generator=g) * 3
        embed = torch.randn(V, H, generator=g)
        me = torch.randn(H, generator=g)
        nw = 1 + 0.1 * torch.randn(Fw, generator=g)
        fc = torch.randn(H, Fw, generator=g) / Fw ** 0.5
        want = bi.block_input_ref(tok, feat, embed, me, nw, 1e-5, fc, T)
        got = bi.launch_block_input(tok, feat, embed, me, nw, 1e-5, fc, T, bn=bn, bk=bk)
        assert got.shape == (T, H), got.shape
        assert torch.equal(got[P:], me.expand(T - P, H)), (P, T)
        err = (got - want).abs().max().item()
        assert err <= 1e-4, (P, T, H, Fw, err)
        h16 = torch.float16  # (the interpreter has no bf16 arithmetic; the GPU lane runs bf16)
        want = bi.block_input_ref(tok, feat.to(h16), embed.to(h16), me.to(h16), nw.to(h16), 1e-5, fc.to(h16), T)
        got = bi.launch_block_input(tok, feat.to(h16), embed.to(h16), me.to(h16), nw.to(h16), 1e-5, fc.to(h16), T,
                                    bn=bn, bk=bk)
        ulp = (want.float().abs() * 2.0 ** -10).clamp(min=2.0 ** -24)
        assert ((got.float() - want.float()).abs() <= 2 * ulp).all(), (P, T, H, Fw, "fp16")
    print("block input: ok")


def check_lattice_cond() -> None:
    """The parent-conditioned log-probs from each position's top K (the Markov head's bigram score
    renormalised over the K candidates and the mass outside them) equal the reference, with and
    without the head; a top K holding all the mass (the clamp) included."""
    g = torch.Generator().manual_seed(1)
    for B, K, V, R in ((16, 16, 500, 8), (4, 4, 30, 2), (1, 8, 100, 4)):
        logits = torch.randn(B, V, generator=g) * 3
        lp, tok = torch.log_softmax(logits, -1).topk(K, -1)
        u, v = torch.randn(V, R, generator=g) * 0.5, torch.randn(V, R, generator=g) * 0.5
        root = torch.tensor([7])
        for markov in (True, False):
            uu, vv = (u, v) if markov else (None, None)
            want = res.lattice_cond_ref(tok, lp, root, uu, vv)
            got = torch.empty(B, K, K)
            res._cond_kernel[(B,)](tok, lp, root, uu if markov else lp, vv if markov else lp, got, R=R if markov else 1,
                                   K=K, HAS_MARKOV=markov)
            err = (got - want).abs().max().item()
            assert err <= 1e-5, (B, K, markov, err)
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.0, 0.0]]).clamp(min=1e-30))  # all the mass in the top K
    tok = torch.tensor([[1, 2, 3, 4]])
    u = v = torch.ones(10, 2)
    want = res.lattice_cond_ref(tok, lp, torch.tensor([0]), u, v)
    got = torch.empty(1, 4, 4)
    res._cond_kernel[(1,)](tok, lp, torch.tensor([0]), u, v, got, R=2, K=4, HAS_MARKOV=True)
    assert torch.isfinite(got).all() and (got - want).abs().max().item() <= 1e-5
    print("lattice cond: ok")


def check_beam_levels() -> None:
    """The level beams (one program, B sequential top-Ws) equal beam_levels_ref exactly, with the early
    stop (a node budget) and without, over lattices whose trees stop early and ones that run every
    level (a flat lattice), ties included (every candidate equal); the one-launch tree (beams and
    selection in one program) equals the reference tree of the full levels, with a narrow first pass too
    (kept on some lattices, redone with the full beams on others), and the one-launch chain the greedy
    path's tokens."""
    g = torch.Generator().manual_seed(2)
    cases = [(torch.log_softmax(3 * torch.randn(16, 16, 16, generator=g), -1), 32, 32),
             (torch.log_softmax(0.01 * torch.randn(16, 16, 16, generator=g), -1), 32, 32),  # flat: deep trees
             (torch.log_softmax(2 * torch.randn(6, 4, 4, generator=g), -1), 8, 5),
             (torch.zeros(5, 4, 4) - 1.0, 4, 4),  # ties everywhere
             (torch.log_softmax(2 * torch.randn(8, 16, 16, generator=g), -1), 1, 1)]  # a chain's width-1 beam
    stopped = 0
    redone = set()  # whether the narrow first pass was kept (False) or followed by the full beams (True)
    for cond, W, n in cases:
        for nodes in (0, n):
            want = res.beam_levels_ref(cond, W, nodes)
            got = res.launch_beam_levels(cond, W, nodes)
            for name, a, b in zip(("scores", "cands", "pslots"), got, want):
                assert torch.equal(a, b), (cond.shape, W, nodes, name)
            stopped += bool(nodes) and bool(torch.isinf(want[0][-1]).all())
        # the tree from the stopped levels is the tree from all of them
        tok = torch.randint(0, 1000, cond.shape[:2], generator=g)
        root = torch.tensor([3])
        full = res.select_tree_ref(tok, root, *res.beam_levels_ref(cond, W), n)
        early = res.select_tree_ref(tok, root, *res.beam_levels_ref(cond, W, n), n)
        assert all(torch.equal(a, b) for a, b in zip(full, early)), (cond.shape, W, n)
        if W * cond.shape[1] >= 16:  # the one-launch tree (beams, then the selection, in one program)
            M = n + 1
            got = (torch.zeros(M, dtype=torch.long), torch.zeros(M, dtype=torch.long), torch.zeros(M, dtype=torch.long),
                   torch.zeros(M, M, dtype=torch.bool))
            res.launch_tree(tok, root, cond, W, n, got)
            for name, a, b in zip(("tokens", "parents", "depth", "ancestors"), got, full):
                assert torch.equal(a, b), (cond.shape, W, n, name)
            for narrow in (W // 2, W // 4):  # a narrow first pass, kept or followed by the full beams
                if narrow & (narrow - 1) or narrow * cond.shape[1] < 16 or cond.shape[0] * narrow < n:
                    continue
                res.launch_tree(tok, root, cond, W, n, got, narrow=narrow)
                for name, a, b in zip(("tokens", "parents", "depth", "ancestors"), got, full):
                    assert torch.equal(a, b), (cond.shape, W, n, narrow, name)
                d = res.select_tree_ref(tok, root, *res.beam_levels_ref(cond, narrow, n), n)[2]
                redone.add(not res.narrow_tree_kept(d, narrow, cond.shape[0], cond.shape[1]))
        if W == 1:  # the chain's tokens in one launch: the greedy path of the lattice
            out = torch.zeros(cond.shape[0] + 1, dtype=torch.long)
            k = cond.shape[0] - 2
            _, cands, _ = res.beam_levels_ref(cond[:k], 1)
            want = torch.cat([root, tok[:k].gather(1, cands).reshape(-1)])
            c = cond[:k].contiguous()
            res._chain_kernel[(1,)](c, torch.empty(k, 1), torch.empty(k, 1, dtype=torch.long),
                                    torch.empty(k, 1, dtype=torch.long), tok, root, out, B=k, K=cond.shape[1],
                                    BP=pow2(k))
            assert torch.equal(out[:k + 1], want), (out, want)
    assert stopped >= 1, "no case stopped early: the check would not see the stop"
    assert redone == {False, True}, f"the narrow pass was only ever {'redone' if True in redone else 'kept'}"
    print("beam levels: ok")


if __name__ == "__main__":
    check_block_input()
    check_lattice_cond()
    check_beam_levels()
