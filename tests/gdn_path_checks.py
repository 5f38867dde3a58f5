"""Checks of the GDN path kernel (tandem.kernels.gdn_path), shared by tests/test_gdn_path.py.

They run the kernel on the CPU through Triton's interpreter (a process of its own, as Triton reads
TRITON_INTERPRET when it is imported: `TRITON_INTERPRET=1 python tests/gdn_path_checks.py`), in
fp32, against the torch walk (tandem.kernels.gdn): random forests with value widths across the
32-column blocks and key widths that are not powers of two; the kernel's own exactness (a tree
node's output equals committing its parent's path and then decoding the node alone, bitwise);
and a tiny Qwen3.5 target decoding through it. Each check raises AssertionError on failure and
prints one "name: ok" line when it passes.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from tandem.config import GenerationConfig, SpecConfig
from tandem.kernels.gdn import gdn_snapshots_ref
from tandem.kernels.gdn_path import gdn_path_commit, gdn_path_tree, root_paths
from tandem.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen35Config
from tandem.runtime.hybrid import HybridTarget, generate_hybrid
from tandem.tree.draft_tree import DraftTree


def _inputs(n: int, seed: int, B: int, H: int, dk: int, dv: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, H, dk, generator=g)
    k = F.normalize(torch.randn(B, n, H, dk, generator=g), dim=-1)
    v = torch.randn(B, n, H, dv, generator=g)
    decay = -3 * torch.rand(B, n, H, generator=g)
    beta = torch.rand(B, n, H, generator=g)
    S0 = torch.randn(B, H, dk, dv, generator=g)
    return S0, q, k, v, decay, beta


def _forest(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def check_against_the_walk() -> None:
    rng = random.Random(0)
    for n, B, H, dk, dv in ((1, 1, 1, 4, 5), (9, 2, 3, 8, 32), (17, 1, 2, 6, 40), (24, 2, 1, 16, 70)):
        parents = _forest(n, rng)
        S0, q, k, v, decay, beta = _inputs(n, n, B, H, dk, dv)
        ref, snaps = gdn_snapshots_ref(S0, q, k, v, decay, beta, parents)
        paths, lens = root_paths(parents)
        S0_before = S0.clone()
        o = gdn_path_tree(S0, q, k, v, decay, beta, paths, lens)
        assert torch.equal(S0, S0_before), "the tree pass wrote the committed state"
        assert torch.allclose(o, ref, atol=1e-5, rtol=1e-5), (n, (o - ref).abs().max())
        node = rng.randrange(n)
        S = gdn_path_commit(S0.clone(), k, v, decay, beta, paths, lens, node)
        assert torch.allclose(S, snaps[node], atol=1e-5, rtol=1e-5), (n, (S - snaps[node]).abs().max())
    print("path kernel against the walk: ok")


def check_bitwise_exact() -> None:
    """A node's output in a tree pass equals: commit its parent's path, then a one-node pass of the
    node from that state; and a chain pass equals decoding its rows one at a time. Bitwise."""
    rng = random.Random(1)
    n, B, H, dk, dv = 14, 2, 2, 8, 36
    parents = _forest(n, rng)
    S0, q, k, v, decay, beta = _inputs(n, 5, B, H, dk, dv)
    o = gdn_path_tree(S0, q, k, v, decay, beta, *root_paths(parents))
    for i in range(n):
        p = parents[i]
        S = S0.clone() if p < 0 else gdn_path_commit(S0.clone(), k, v, decay, beta, *root_paths(parents), p)
        one = (slice(None), slice(i, i + 1))
        alone = gdn_path_tree(S, q[one].contiguous(), k[one].contiguous(), v[one].contiguous(),
                              decay[one].contiguous(), beta[one].contiguous(), *root_paths([-1]))
        assert torch.equal(o[:, i], alone[:, 0]), i
    chain = list(range(-1, n - 1))
    o = gdn_path_tree(S0, q, k, v, decay, beta, *root_paths(chain))
    S, rows = S0.clone(), []
    for i in range(n):
        one = (slice(None), slice(i, i + 1))
        args = [t[one].contiguous() for t in (k, v, decay, beta)]
        rows.append(gdn_path_tree(S, q[one].contiguous(), *args, *root_paths([-1])))
        S = gdn_path_commit(S, *args, *root_paths([-1]), 0)
    assert torch.equal(o, torch.cat(rows, 1))
    print("path kernel bitwise exact: ok")


def _tiny_target() -> Qwen3_5ForCausalLM:
    cfg = Qwen35Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       layer_types=("linear_attention",) * 3 + ("full_attention",), linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                       max_position_embeddings=256)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.copy_(torch.rand(p.shape, generator=g).mul(15).add(0.01).log())
            elif "norm" in name or name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        model.lm_head.weight.mul_(4.0)  # peakier logits: greedy argmaxes far from ties
    return model


class Oracle:
    """A 6-node tree each step: the ar continuation `truth` as a chain of 3, plus 3 siblings."""

    def __init__(self, truth: list[int]):
        self.truth, self.steps = truth, 0

    def start(self, prompt_ids):
        self.done, self.root = 0, prompt_ids[-1]

    def propose(self):
        truth = self.truth[self.done:self.done + 3]
        tokens = [self.root] + truth + [(t + 1) % 96 for t in truth[:2]]
        parents = [-1] + list(range(len(truth))) + [0, 1][:len(tokens) - 1 - len(truth)]
        self.steps += 1
        return DraftTree(tokens, parents, [0.0] * len(tokens))

    def observe(self, result, tree):
        self.done += len(result.tokens)
        self.root = result.bonus


def check_model(device: str = "cpu") -> None:
    """A tiny hybrid target with TANDEM_GDN_TREE=path: a tree pass's logits and committed state equal
    the walk's to fp32 rounding, and greedy tree decoding (an oracle tree holding the ar path)
    gives ar's tokens."""
    model = _tiny_target().to(device)
    rng = random.Random(2)
    prefix = [rng.randrange(96) for _ in range(9)]
    parents = [-1] + [rng.randrange(i) for i in range(1, 12)]
    tree = DraftTree([rng.randrange(96) for _ in parents], parents, [0.0] * len(parents))
    out = {}
    for kernel in ("walk", "path"):
        model.gdn_tree = kernel
        target = HybridTarget(model, capacity=48)
        target.prefill(prefix)
        logits, rec = target.logits(tree)
        assert rec.kernel == kernel
        target.commit(rec, _path(parents, len(parents) - 1))
        after, _ = target.logits(DraftTree.chain([3]))
        out[kernel] = (logits, after, target.state.delta)
    for a, b in zip(out["walk"][:2], out["path"][:2]):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    for a, b in zip(out["walk"][2], out["path"][2]):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()

    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    prompt = [5, 9, 1, 77, 30]
    ar = generate_hybrid(model, prompt, "ar", gen=gen)

    res = generate_hybrid(model, prompt, "tree", spec=SpecConfig(nodes=6), gen=gen, drafter=Oracle(ar.token_ids))
    model.gdn_tree = "walk"
    assert res.token_ids == ar.token_ids, (res.token_ids, ar.token_ids)
    assert res.target_passes < ar.target_passes
    print("hybrid target through the path kernel: ok")


if __name__ == "__main__":
    check_against_the_walk()
    check_bitwise_exact()
    check_model()
