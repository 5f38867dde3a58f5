"""Checks of the GDN WY kernel (tandem.kernels.gdn_wy), shared by tests/test_gdn_wy.py.

They run the kernel on the CPU through Triton's interpreter (a process of its own, as Triton reads
TRITON_INTERPRET when it is imported: `TRITON_INTERPRET=1 python tests/gdn_wy_checks.py`), in fp32:
- against per-node state snapshots on random forests (value widths across the 64-column blocks,
  key widths across the 32-column chunks and not powers of two, 1 to 40 nodes, and 70: past
  MAX_NODES, where the torch WY form runs), both solves;
- within one bf16 ulp of the path kernel, as SpecPilot s4.2 asks, with three bf16 pieces a
  product (one piece alone is not);
- a state carried through 64 one-node passes and commits stays with token-by-token decoding;
- a tiny Qwen3.5 target decoding through it, eager and with its passes captured (emulated).
Each check raises AssertionError on failure and prints one "name: ok" line when it passes.
"""
from __future__ import annotations

import random

import torch

from gdn_path_checks import Oracle, _forest, _inputs, _path, _tiny_target
from tandem.config import GenerationConfig, SpecConfig
from tandem.kernels.gdn import gdn_replay, gdn_snapshots_ref, gdn_tree_wy
from tandem.kernels.gdn_path import gdn_path_commit, gdn_path_tree, root_paths
from tandem.kernels.gdn_wy import SOLVES, bf16_ulps, gdn_wy_commit_, gdn_wy_tree
from tandem.runtime.hybrid import HybridTarget, generate_hybrid
from tandem.tree.draft_tree import DraftTree, ancestor_mask


def _on_path(parents: list[int], node: int) -> torch.Tensor:
    on = torch.zeros(len(parents), dtype=torch.bool)
    on[_path(parents, node)] = True
    return on


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """max |a - b| / (1 + |b|): relative for large entries, absolute near zero."""
    err = ((a - b).abs() / (1 + b.abs())).max().item()
    assert err < tol, err
    return err


def check_against_snapshots() -> None:
    rng = random.Random(0)
    for n, B, H, dk, dv in ((1, 1, 1, 4, 5), (9, 2, 3, 8, 70), (17, 1, 2, 40, 40), (24, 2, 1, 16, 130),
                            (40, 1, 2, 70, 20), (70, 1, 1, 8, 8)):  # (over MAX_NODES: the torch form)
        parents = _forest(n, rng)
        S0, q, k, v, decay, beta = _inputs(n, n, B, H, dk, dv)
        ref, snaps = gdn_snapshots_ref(S0, q, k, v, decay, beta, parents)
        anc = ancestor_mask(parents)
        S0_before = S0.clone()
        for solve in SOLVES:
            o, U, G = gdn_wy_tree(S0, q, k, v, decay, beta, anc, solve=solve)
            assert torch.equal(S0, S0_before), "the tree pass wrote the committed state"
            _close(o, ref, 1e-5)
            for node in (n - 1, rng.randrange(n)):
                S = gdn_wy_commit_(S0.clone(), k, U, G, _on_path(parents, node), node)
                _close(S, snaps[node], 1e-5)
    print("WY kernel against per-node snapshots: ok")


def check_one_bf16_ulp_of_the_path_kernel() -> None:
    """Every output and the committed state within one bf16 ulp of the path kernel's, at a GDN
    head width of 64 and a 32-node tree; the same products from one bf16 piece each miss that."""
    n, B, H, dk, dv = 32, 1, 2, 64, 64
    parents = [-1] + [random.Random(i).randrange(max(0, i - 4), i) for i in range(1, n)]  # deep, as best-first
    S0, q, k, v, decay, beta = _inputs(n, 11, B, H, dk, dv)
    q = q * dk ** -0.5
    paths, lens = root_paths(parents)
    o_path = gdn_path_tree(S0, q, k, v, decay, beta, paths, lens)
    S_path = gdn_path_commit(S0.clone(), k, v, decay, beta, paths, lens, n - 1)
    worst = {}
    for pieces in (3, 1):
        o, U, G = gdn_wy_tree(S0, q, k, v, decay, beta, ancestor_mask(parents), pieces=pieces)
        S = gdn_wy_commit_(S0.clone(), k, U, G, _on_path(parents, n - 1), n - 1, pieces=pieces)
        worst[pieces] = max(bf16_ulps(o, o_path).max().item(), bf16_ulps(S, S_path).max().item())
    assert worst[3] <= 1.0, worst
    assert worst[1] > 1.0, worst  # (the split is what keeps it there)
    o, _, _ = gdn_tree_wy(S0, q, k, v, decay, beta, ancestor_mask(parents))  # (the torch fp32 form, for scale)
    print(f"WY kernel within one bf16 ulp of the path kernel ({worst[3]:.2f} at worst with three pieces, "
          f"{worst[1]:.0f} with one; the torch WY form's outputs {bf16_ulps(o, o_path).max().item():.2f}): ok")


def check_carried_state() -> None:
    """64 one-node passes, each committed: the state stays with token-by-token decoding's (the walk's
    updates) to fp32 rounding, no drift that grows with the steps."""
    n, B, H, dk, dv = 64, 1, 2, 16, 24
    S0, q, k, v, decay, beta = _inputs(n, 4, B, H, dk, dv)
    S_wy, S_ref = S0.clone(), S0.clone()
    errs = []
    for i in range(n):
        one = (slice(None), slice(i, i + 1))
        args = [t[one].contiguous() for t in (q, k, v, decay, beta)]
        o, U, G = gdn_wy_tree(S_wy, *args, torch.ones(1, 1, dtype=torch.bool))
        S_ref_next = gdn_replay(S_ref, *args[1:], [0])
        o_ref = (S_ref_next * args[0][:, 0, :, :, None]).sum(-2)
        _close(o[:, 0], o_ref, 1e-5)
        S_wy = gdn_wy_commit_(S_wy, args[1], U, G, torch.ones(1, dtype=torch.bool), 0)
        S_ref = S_ref_next
        errs.append(_close(S_wy, S_ref, 1e-5))
    assert max(errs[-8:]) < 1e-5
    print("WY kernel's committed state carried over 64 steps: ok")


def check_model(device: str = "cpu") -> None:
    """A tiny hybrid target with gdn_tree = "wy_triton": a tree pass's logits and committed state
    equal the walk's to fp32 rounding, eager and replayed from its captured buckets (emulated);
    greedy tree decoding (an oracle tree holding the ar path) gives ar's tokens."""
    model = _tiny_target().to(device)
    rng = random.Random(2)
    prefix = [rng.randrange(96) for _ in range(9)]
    parents = [-1] + [rng.randrange(i) for i in range(1, 12)]
    tree = DraftTree([rng.randrange(96) for _ in parents], parents, [0.0] * len(parents))
    out = {}
    for kernel, graphs in (("walk", False), ("wy_triton", False), ("wy_triton", "emulate")):
        model.gdn_tree = kernel
        target = HybridTarget(model, capacity=48, graphs=graphs)
        target.prefill(prefix)
        logits, rec = target.logits(tree)
        assert rec.kernel == kernel
        target.commit(rec, _path(parents, len(parents) - 1))
        after, _ = target.logits(DraftTree.chain([3]))
        out[kernel, graphs] = (logits, after, target.state.delta)
    for key in (("wy_triton", False), ("wy_triton", "emulate")):
        for a, b in zip(out["walk", False][:2], out[key][:2]):
            assert torch.allclose(a, b, atol=1e-4), (key, (a - b).abs().max())
        for a, b in zip(out["walk", False][2], out[key][2]):
            assert torch.allclose(a, b, atol=1e-5), (key, (a - b).abs().max())

    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    prompt = [5, 9, 1, 77, 30]
    model.gdn_tree = "walk"
    ar = generate_hybrid(model, prompt, "ar", gen=gen)

    model.gdn_tree = "wy_triton"
    try:
        res = generate_hybrid(model, prompt, "tree", spec=SpecConfig(nodes=6), gen=gen, drafter=Oracle(ar.token_ids))
        plain = generate_hybrid(model, prompt, "ar", gen=gen)
    finally:
        model.gdn_tree = "walk"
    assert res.token_ids == ar.token_ids == plain.token_ids, (res.token_ids, ar.token_ids)
    assert res.target_passes < ar.target_passes
    print("hybrid target through the WY kernel: ok")


if __name__ == "__main__":
    check_against_snapshots()
    check_one_bf16_ulp_of_the_path_kernel()
    check_carried_state()
    check_model()
