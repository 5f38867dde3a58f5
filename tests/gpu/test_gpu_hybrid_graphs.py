"""GPU lane: a hybrid (Qwen3.5) target's tree passes captured as CUDA graphs (runtime.hybrid_graphs),
with the path kernel and the WY form (torch ops and the Triton kernel): replayed passes give the eager pass's logits and, committed,
its state; greedy decoding through them equals eager `ar` (fp32, a random target of 8 layers)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from gpu_lane import NEEDS_CUDA, no_grad
from tandem.config import GenerationConfig, SpecConfig
from tandem.runtime.hybrid import HybridTarget, generate_hybrid
from tandem.tree.draft_tree import DraftTree

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]


@pytest.fixture(scope="module")
def model():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_hybrid_check import random_target

    return random_target(512, 8, "cuda", "float32")[0]


@pytest.mark.parametrize("kernel", ["path", "wy", "wy_triton"])
def test_replayed_passes_equal_eager_ones(model, kernel, monkeypatch):
    monkeypatch.setattr(model, "gdn_tree", kernel)
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    eager, graphed = HybridTarget(model, 400, graphs=False), HybridTarget(model, 400, graphs=True)
    assert graphed.graphs is not None and not graphed.graphs.emulate
    for t in (eager, graphed):
        t.prefill(prompt[:-1])
    rng, root = random.Random(1), prompt[-1]
    for n in (1, 7, 33, 2, 64, 1, 17):
        parents = [-1] + [rng.randrange(max(0, i - 4), i) for i in range(1, n)]
        tree = DraftTree([root] + [rng.randrange(V) for _ in range(n - 1)], parents, [0.0] * n)
        (la, ra), (lb, rb) = eager.logits(tree), graphed.logits(tree)
        assert (la - lb).abs().max().item() < 2e-4, (kernel, n)
        path = [0]
        while path[-1] in parents:
            path.append(parents.index(path[-1]))
        eager.commit(ra, path)
        graphed.commit(rb, path)
        for a, b in zip(eager.state.delta, graphed.state.delta):
            assert (a - b).abs().max().item() < 2e-4
        root = tree.tokens[path[-1]]
    assert graphed.graphs.replays == 7 and all(bk.graph is not None for bk in graphed.graphs.buckets.values())


def test_greedy_decoding_through_graphs_equals_eager_ar(model, monkeypatch):
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    monkeypatch.setattr(model, "gdn_tree", "walk")
    ref = generate_hybrid(model, prompt, "ar", gen=gen).token_ids  # eager (the walk is not captured)
    monkeypatch.setattr(model, "gdn_tree", "path")
    monkeypatch.setenv("TANDEM_HYBRID_GRAPHS", "1")  # (the default; set against a stray =0 in the environment)
    from tandem.runtime.hybrid_graphs import graphs_apply

    assert graphs_apply(model)
    assert generate_hybrid(model, prompt, "ar", gen=gen).token_ids == ref
    from gpu_hybrid_check import OracleTrees

    res = generate_hybrid(model, prompt, "tree", spec=SpecConfig(nodes=32), gen=gen,
                          drafter=OracleTrees(ref, 32, V, seed=3))
    assert res.token_ids == ref and res.target_passes < len(ref)
