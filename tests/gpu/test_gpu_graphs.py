"""GPU lane: the CUDA-graph step (ModelRunner with graphs) against the eager step, for every row
bucket (full and padded) and both attention widths the prefix reaches; and the device rounds
(one graph per round, tandem.drafting.device_rounds) against the host rounds.

The CPU parameters run the same sequences with the graph path emulated (tiny models)."""
from __future__ import annotations

import pytest
import torch

from gpu_lane import bundled_pair, cpu, cuda, graphs_for, preset_model, rel_err
from models_for_tests import tiny_model, unit_scaled_model
from tandem.runtime.runner import DEFAULT_BUCKETS, ModelRunner
from tandem.tree.draft_tree import ancestor_mask
from tandem.drafting.evolving import EvolvingTree

TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # graph vs eager, relative (norm) error


def _model(name: str, device: str, dtype: str):
    if name == "tiny":
        return tiny_model(seed=0)
    if name == "bundled-target":
        return bundled_pair(device, dtype)[0]
    return preset_model(name, 2, device, dtype)


@pytest.mark.parametrize("device,name,dtype", [
    cpu("cpu", "tiny", "float32", id="cpu-tiny-fp32"),
    cuda("cuda", "bundled-target", "float32", id="cuda-bundled-fp32"),
    cuda("cuda", "llama3-8b", "bfloat16", id="cuda-llama3-8b-2layers-bf16"),
])
def test_graph_steps_equal_eager_steps_for_every_row_bucket(device, name, dtype):
    model = _model(name, device, dtype)
    cap = 460
    graphs, eager = ModelRunner(model, cap, use_graphs=graphs_for(device)), ModelRunner(model, cap, use_graphs=False)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (230,), generator=g).tolist()
    for r in (graphs, eager):
        r.prefill(prompt)
    # every bucket full, and one row short of it (padded rows on the scratch row)
    sizes = sorted(set(DEFAULT_BUCKETS) | {b - 1 for b in DEFAULT_BUCKETS if b > 2})
    for T in sizes:
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, T)]
        depth = [0] * T
        for i in range(1, T):
            depth[i] = depth[parents[i]] + 1
        tokens = torch.randint(0, vocab, (T,), generator=g).tolist()
        P = graphs.cache.prefix_len
        positions = [P + d for d in depth]  # the root (node 0) is the next position
        mask = ancestor_mask(parents)  # [T, T]
        got, want = graphs.step(tokens, positions, mask), eager.step(tokens, positions, mask)  # [T, vocab]
        assert rel_err(got, want) < TOL[dtype], (T, rel_err(got, want))
        for a, b in ((graphs.cache.k, eager.cache.k), (graphs.cache.v, eager.cache.v)):
            assert rel_err(a[:, :, :, P:P + T], b[:, :, :, P:P + T]) < TOL[dtype], T  # the rows written
        path = [0]  # commit the root and its first-child chain, up to 3 rows: the prefix grows
        while len(path) < 3 and path[-1] in parents[1:]:
            path.append(parents.index(path[-1], 1))
        for r in (graphs, eager):
            r.cache.commit(path)
    captured = set(graphs._graphs)
    assert {key[0] for key in captured} == set(DEFAULT_BUCKETS)  # keys: (bucket, width, features)
    assert len({key[1] for key in captured}) == 2  # the prefix crossed the 256-column width bucket
    assert all((graph is None) == (device == "cpu") for graph, _ in graphs._graphs.values())


@pytest.mark.parametrize("device", [cpu("cpu", id="cpu"), cuda("cuda", id="cuda")])
def test_device_rounds_build_the_host_rounds_tree(device):
    """R rounds as one graph each and one read-back grow the tree the host loop grows (the
    runner's step per round, one sync each), with equal K/V rows, before and after a re-root."""
    if device == "cuda":
        draft, prompt = bundled_pair("cuda")[1], bundled_pair("cuda")[2][0]
    else:
        draft, prompt = unit_scaled_model(32, seed=0, head_scale=1.0, max_positions=512), [5, 9, 2, 7, 30, 1]

    def build(device_rounds: bool) -> EvolvingTree:
        t = EvolvingTree(ModelRunner(draft, 400, use_graphs=graphs_for(device)), width=4, max_rows=64,
                         device_rounds=device_rounds)
        t.start(prompt)
        t.feed_pending()
        return t

    host, dev = build(False), build(True)

    def same(rounds: int) -> None:
        for _ in range(rounds):
            assert host.expand() == 4
        assert dev.expand_rounds(rounds) == rounds
        assert (dev.tokens, dev.parents, dev.depth, dev.row) == (host.tokens, host.parents, host.depth, host.row)
        assert max(abs(a - b) for a, b in zip(dev.logp, host.logp) if a > float("-inf")) < 1e-4
        L = host.cache.length
        assert rel_err(dev.cache.k[:, :, :, :L], host.cache.k[:, :, :, :L]) < 1e-5
        assert rel_err(dev.cache.v[:, :, :, :L], host.cache.v[:, :, :, :L]) < 1e-5
        dev.check()

    same(6)
    best = max((i for i in range(1, len(host)) if host.row[i] >= 0 and host.depth[i] == 2), key=lambda i: host.logp[i])
    verified = [host.tokens[host.parents[best]], host.tokens[best]]
    assert host.reroot(verified) == dev.reroot(verified)
    same(3)
    rounds = dev._dev
    assert rounds is not None and bool(rounds._graphs) == (device == "cuda")  # real round graphs replayed
