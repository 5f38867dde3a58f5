"""Checks of deterministic mode's batch invariance, shared by tests/test_invariant_kernels.py.

`model_rows_alone_and_among` runs a deterministic BatchedModel (whatever its kernels are).
The `check_*` functions run the batch-invariant Triton kernels (tandem.kernels.invariant_gemm,
invariant_attention) on the CPU through Triton's interpreter, in fp32 (the interpreter's bf16 is
not the GPU's). Triton reads TRITON_INTERPRET when it is imported, so they run in a process of
their own: `TRITON_INTERPRET=1 python tests/invariant_checks.py` (what the test starts). Each
check raises AssertionError on failure; the script prints one line per passed check.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tandem.engine import invariant
from tandem.engine.batched_model import BatchedModel, BatchRows, Capacity, Segment, paged_attention_ref
from tandem.kernels import invariant_attention as ia
from tandem.kernels import invariant_gemm as ig
from tandem.kv.paged import PagedKVPool


@torch.no_grad()
def model_rows_alone_and_among(model, use_graphs: bool | str | None = None
                               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """A deterministic BatchedModel's logits for the same rows computed two ways, as pairs
    (alone, among) that batch invariance makes bitwise equal, and whether the "among" passes
    ran in graph buckets:

    - a 9-token prefill chunk in a pass of its own / between two other requests' chunks (in a
      graph bucket of 32 rows, 7 of them padding, when use_graphs is "emulate" or True);
    - the 3-node tree [-1, 0, 0] after it, alone / beside another request's decode row;
    - each tree node / the AR step feeding the same tokens at the same positions (another
      request that committed the prompt and the node's parent as ordinary columns)."""
    g = torch.Generator().manual_seed(3)
    V = model.config.vocab_size
    a, b, c = (torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 13, 3))
    pool = PagedKVPool.for_model(model, num_blocks=32, block_size=8)
    alone = BatchedModel(model, pool, deterministic=True)
    among = BatchedModel(model, pool, deterministic=True, max_seqs=4, max_seq_blocks=4, use_graphs=use_graphs)

    def run(bm: BatchedModel, segments: list[Segment]) -> torch.Tensor:
        return bm.forward(bm.rows(segments)).clone()  # [logit rows, V]

    pairs = []
    chunk = run(alone, [Segment.chunk(a, 0, [0, 1], logits=True)])  # [9, V]
    both = run(among, [Segment.chunk(b, 0, [4, 5], logits=True), Segment.chunk(a, 0, [0, 1], logits=True),
                       Segment.chunk(c, 0, [8], logits=True)])  # [25, V]
    pairs.append((chunk, both[13:22]))
    nodes, parents = [5, 6, 7], [-1, 0, 0]
    tree = run(alone, [Segment.tree(nodes, parents, 9, [0, 1])])  # [3, V]
    pairs.append((tree, run(among, [Segment.chunk([1], 13, [4, 5], logits=True),
                                    Segment.tree(nodes, parents, 9, [0, 1])])[1:]))
    for i in (1, 2):  # the AR step of node i: the prompt and node 0 committed, node i fed at position 10
        run(alone, [Segment.chunk(a + [nodes[0]], 0, [12, 13])])
        pairs.append((tree[i:i + 1], run(alone, [Segment.chunk([nodes[i]], 10, [12, 13], logits=True)])))
    return pairs, bool(among._graphs)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within rounding: a relative (norm) error of 1e-5 in fp32, 1e-2 in 16-bit floats."""
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
    return err < (1e-5 if want.dtype == torch.float32 else 1e-2)


def check_gemm(shapes=((96, 64, False), (200, 130, True)), rows=(1, 37, 64), device="cpu",
               dtype=torch.float32) -> None:
    """For each (N, K, bias): the first m rows of the product of max(rows) + 66 rows (two row tiles
    or more) are bitwise the product of those m rows alone, for m in `rows`; a single row at
    row 0 of its tile equals itself deep in another tile; other rows' contents do not matter; and
    the product is within rounding of F.linear (a K that is not a tile multiple, with a bias)."""
    g = torch.Generator(device=device).manual_seed(0)
    M = max(rows) + 66

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    for N, K, bias in shapes:
        w, b, x = randn(N, K), randn(N) if bias else None, randn(M, K)
        full = ig.linear(x, w, b)  # [M, N]
        assert close(full, F.linear(x, w, b)), (N, K)
        for m in rows:
            assert torch.equal(ig.linear(x[:m], w, b), full[:m]), (N, K, m)
        for i in (5, 36, M - 1):  # a row alone (row 0 of its tile) and among others
            assert torch.equal(ig.linear(x[i:i + 1], w, b)[0], full[i]), (N, K, i)
        other = x.clone()
        other[1:] = randn(M - 1, K)
        assert torch.equal(ig.linear(other, w, b)[0], full[0]), (N, K)
        assert torch.equal(ig.linear(x[None, :7], w, b)[0], full[:7])  # [..., K] input
    print("gemm: ok")


def check_attention(device="cpu", dtype=torch.float32, H: int = 6, Hkv: int = 2, D: int = 32) -> None:
    """A tree node's output is bitwise the AR row's with the same visible sequence (same K/V,
    same query), in a 1-word and a 2-word tree; a row's output is the same alone and among rows of
    other requests; padding rows of a bucket come out as zeros; and the outputs are within
    rounding of the SDPA reference and of deterministic mode's torch reference."""
    g = torch.Generator(device=device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    bs = 8
    k, v = randn(64 * bs + 1, Hkv, D), randn(64 * bs + 1, Hkv, D)  # [slots, Hkv, D]
    # request A: 37 committed columns, then a tree; request B: the same committed K/V in other
    # blocks, then the tree path of one node as ordinary (AR) columns
    for parents in ([-1, 0, 0, 1, 3, 2], [-1] + list(range(69)) + [0, 70]):  # 6 nodes; a 72-node tree (2 words)
        n, start = len(parents), 37
        blocks_a = list(range(0, -(-(start + n) // bs)))
        blocks_b = list(range(30, 30 + len(blocks_a)))
        slot = lambda blocks, c: blocks[c // bs] * bs + c % bs  # noqa: E731
        tree = Segment.tree(list(range(n)), parents, start, blocks_a)
        node = n - 1
        path = [i for i in range(n) if tree.bits[node] >> i & 1]  # the node's ancestors and itself, in order
        src = [slot(blocks_a, c) for c in range(start)] + [slot(blocks_a, start + i) for i in path]
        dst = [slot(blocks_b, c) for c in range(start + len(path))]
        k[dst], v[dst] = k[src], v[src]
        ar_pos = start + len(path) - 1
        ar = Segment.chunk([0], ar_pos, blocks_b)
        q = randn(n, H, D)
        rows_t = BatchRows.build([tree], q.device, q.dtype, bs)
        assert rows_t.words == (2 if n > 64 else 1)
        out_t = ia.paged(q, k, v, rows_t)  # [n, H, D]
        assert close(out_t, paged_attention_ref(q, k, v, rows_t))
        out_a = ia.paged(q[node:node + 1], k, v, BatchRows.build([ar], q.device, q.dtype, bs))
        assert torch.equal(out_a[0], out_t[node]), parents
        # the AR row among other requests' rows (a chunk, another tree), placed last
        others = [Segment.chunk(list(range(5)), 3, [60, 61]), Segment.tree([1, 2, 3], [-1, 0, 0], 11, [62, 63])]
        qs = torch.cat([randn(8, H, D), q[node:node + 1]])
        rows_m = BatchRows.build(others + [ar], q.device, q.dtype, bs)
        out_m = ia.paged(qs, k, v, rows_m)
        assert torch.equal(out_m[-1], out_t[node]), parents
        assert close(out_m, paged_attention_ref(qs, k, v, rows_m))
        cols = torch.tensor([dst], device=device)
        ref = invariant.attention(q[node:node + 1], k, v, cols, torch.ones_like(cols, dtype=torch.bool))
        assert close(out_t[node], ref[0])
    # a graph bucket of 4 rows holding 2: its padding rows (request 0, nothing seen) give zeros
    cap = Capacity(4, 1, 4, 1, 1)
    host = np.empty(cap.size, dtype=np.int64)
    T, S, offsets, nl = BatchRows.pack([Segment.chunk([0, 1], 0, [0])], host, cap, bs, 64 * bs, 16)
    rows_p = BatchRows(torch.from_numpy(host).to(device), cap, 2, T, S, offsets, nl, bs, 16, dtype, graph=4)
    out_p = ia.paged(randn(4, H, D), k, v, rows_p)
    assert torch.equal(out_p[2:], torch.zeros_like(out_p[2:]))
    print("attention: ok")


def check_model() -> None:
    """Deterministic mode end to end with the invariant attention kernel in the pass (the CUDA path,
    routed to the interpreter on the CPU): model_rows_alone_and_among's pairs bitwise equal through
    an emulated graph bucket, and an engine's greedy output for a request one and the same with `ar`
    alone, with `tree` alone and with `tree` among 3 others, and equal to the single-request loop's
    `ar` (fp32). (One layer: the interpreter runs a program in ~50 ms.)

    NOTE: the row-wise products stay on their torch invariant path here. The interpreter runs the
    GEMM kernel's tl.dot as numpy's matmul, whose result for a row depends on the row's position in
    the tile (numpy 2.2-2.3 with OpenBLAS 0.3.29: a row at tile position 3 differs in the last bit
    from the same row at 0), so it cannot show the GPU's row invariance across positions;
    check_gemm checks the kernel's M-independence at fixed positions, and the GPU lane checks the
    whole pass in bf16 (tests/gpu/test_gpu_invariant.py)."""
    from models_for_tests import noisy_copy, tiny_model
    from tandem.config import GenerationConfig, SpecConfig
    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.engine.request import SamplingParams
    from tandem.runtime.generate import Generator

    calls = {"gemm": 0, "attention": 0}
    gemm, attention, enabled = ig.linear, ia.paged, ig.triton_enabled

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    # the attention dispatch's CUDA test answered yes for CPU tensors: BatchedModel takes its CUDA path
    ia.triton_enabled = lambda t: not torch.is_grad_enabled()
    ig.linear, ia.paged = counted("gemm", gemm), counted("attention", attention)
    try:
        model = tiny_model(seed=0, hidden=128, layers=1)  # head_dim 32: a size the attention kernel takes
        pairs, graphed = model_rows_alone_and_among(model, use_graphs="emulate")
        assert graphed
        for alone, among in pairs:
            assert torch.equal(alone, among)
        assert calls["gemm"] == 0 and calls["attention"] > 0, calls
        g = torch.Generator().manual_seed(5)
        prompt = torch.randint(0, 95, (12,), generator=g).tolist()
        others = [torch.randint(0, 95, (n,), generator=g).tolist() for n in (3, 9, 14)]
        draft = noisy_copy(model, 0.1)
        outs = set()
        for method, n in (("ar", 1), ("tree", 1), ("tree", 4)):
            e = Engine(model, draft if method == "tree" else None,
                       config=EngineConfig(method=method, spec=SpecConfig(nodes=8, width=2), block_size=8,
                                           deterministic=True, debug_check=True))
            req = e.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
            for o in others[:n - 1]:
                e.add_request(o, SamplingParams(max_tokens=8, ignore_eos=True))
            outs.add(tuple({o.request_id: o for o in e.run()}[req.request_id].token_ids))
        assert len(outs) == 1, outs
        want = Generator(model, None).generate(prompt, "ar", gen=GenerationConfig(max_new_tokens=8, ignore_eos=True))
        assert list(outs.pop()) == want.token_ids
    finally:
        ig.linear, ia.paged = gemm, attention
        ig.triton_enabled = ia.triton_enabled = enabled
    print(f"model: ok ({calls['attention']} attention launches)")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (the kernels then run on the CPU)"
    sys.path.insert(0, str(Path(__file__).parent))  # (models_for_tests)
    torch.set_num_threads(1)
    with torch.no_grad():
        for check in (check_gemm, check_attention, check_model):
            check()
    sys.exit(0)
