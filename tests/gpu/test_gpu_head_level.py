"""GPU lane: an EAGLE-3 head's fused level kernels (tandem.kernels.head_level) compiled, against their
torch references, at the bundled head's shape and the published Llama-3.1-8B head's, fp32 and bf16,
and the fused top-k replayed in a CUDA graph (its counter must come back to zero every time).
"""
from __future__ import annotations

import pytest
import torch

from gpu_lane import NEEDS_CUDA, no_grad
from tandem.kernels import head_level as hl
from tandem.kernels.fused import rmsnorm_ref

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]

SHAPES = {"bundled-head": (384, 8192), "eagle3-llama3.1-8b": (4096, 32000)}  # (hidden, draft vocabulary)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _inputs(rows: int, H: int, V: int, dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device="cuda").mul_(scale).to(dtype)

    return rnd(rows, H), rnd(rows, H), 1 + rnd(H, scale=0.1), rnd(V, H, scale=4 * H ** -0.5)


def _check(out, lp, tok, r, d, nw, lm, k, dtype):
    out_ref, lp_ref, tok_ref = hl.head_topk_ref(r, d, nw, 1e-5, lm, k)
    assert torch.equal(out, out_ref)
    if dtype == torch.float32:
        assert torch.equal(tok, tok_ref)
        assert (lp - lp_ref).abs().max().item() < 1e-4
        return
    # bf16: the kernel rounds its own fp32 sums, cuBLAS its own, so near-ties may swap: each token the
    # kernel picks must be within a bf16 rounding of the reference's k-th best, and the log-probs close
    exact = rmsnorm_ref(out_ref, nw, 1e-5).float() @ lm.float().t()  # [R, V]
    kth = exact.gather(1, tok_ref).min(1, keepdim=True).values
    assert (exact.gather(1, tok) >= kth - 0.05 * exact.abs().amax(1, keepdim=True)).all()
    assert (lp - lp_ref).abs().max().item() < 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k", [(1, 8), (8, 8), (4, 1), (16, 4), (16, 16), (5, 3)])
@pytest.mark.parametrize("shape", SHAPES)
def test_head_topk_equals_the_reference(shape, rows, k, dtype):
    H, V = SHAPES[shape]
    r, d, nw, lm = _inputs(rows, H, V, dtype, seed=rows * 10 + k)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    out, lp, tok, _ = hl.head_topk(r, d, nw, 1e-5, lm, k, counter)
    assert counter.item() == 0
    _check(out, lp, tok, r, d, nw, lm, k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_topk_replayed_in_a_cuda_graph(dtype):
    """Fifty replays with new inputs each time: every merge is right (a counter left non-zero, or a
    merge that read another program's partials before they landed, would show)."""
    H, V = SHAPES["bundled-head"]
    r, d, nw, lm = _inputs(8, H, V, dtype, seed=0)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        hl.head_topk(r, d, nw, 1e-5, lm, 8, counter)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lp, tok, _ = hl.head_topk(r, d, nw, 1e-5, lm, 8, counter)
    for seed in range(50):
        r2, d2, _, _ = _inputs(8, H, V, dtype, seed=100 + seed)
        r.copy_(r2)
        d.copy_(d2)
        graph.replay()
        torch.cuda.synchronize()
        assert counter.item() == 0
        _check(out, lp, tok, r, d, nw, lm, 8, dtype)


@pytest.mark.parametrize("w,depth,n", [(1, 8, 8), (4, 6, 32), (8, 8, 32), (8, 4, 64), (10, 6, 60)])
def test_head_select_equals_the_reference(w, depth, n):
    g = torch.Generator(device="cuda").manual_seed(w * depth)
    total = w + (depth - 1) * w * w
    # a prefix-closed layout (a child's log-prob is its parent's plus a log-prob), one node of probability 0
    par = torch.where(torch.arange(total, device="cuda") < w, -1,
                      torch.randint(0, w, (total,), generator=g, device="cuda"))
    step = -torch.rand(total, generator=g, device="cuda").mul_(4)
    step[min(1, w - 1)] = float("-inf")
    lp = torch.where(par < 0, step, step + step[par.clamp(min=0)])
    tok = torch.randint(0, 128000, (total,), generator=g, device="cuda")
    root = torch.tensor([9], device="cuda")
    want = hl.head_select_ref(lp, tok, par, root, w, depth, n)
    got = (torch.zeros(n + 1, dtype=torch.long, device="cuda"), torch.zeros(n + 1, dtype=torch.long, device="cuda"),
           torch.zeros(n + 1, dtype=torch.long, device="cuda"),
           torch.zeros(n + 1, n + 1, dtype=torch.bool, device="cuda"))
    hl.head_select(lp, tok, par, root, w, depth, n, got)
    for name, a, b in zip(("tokens", "parents", "depth", "ancestors"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,gather", [(1, False), (4, True), (17, False)])
def test_eagle_qkv_equals_the_reference(rows, gather, dtype):
    """The bundled head's q/k/v (6 q heads, 2 K/V heads of 64, input 2 x 384) with the input norms in the
    prologue: q and the K/V rows as the two-kernel path computes them (bf16: within a rounding)."""
    from tandem.models.layers import rope_inv_freq
    from tandem.models.loader import read_config
    from tandem.runtime.pair import BUNDLED_TARGET

    c = read_config(BUNDLED_TARGET)
    H, D, nq, nkv, cap = 384, 64, 6, 2, 300
    g = torch.Generator(device="cuda").manual_seed(rows)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device="cuda").mul_(scale).to(dtype)

    embed, hidden = rnd(8192, H), rnd(4, H)
    ids = torch.randint(0, 8192, (rows,), device="cuda")
    src = torch.randint(0, 4, (rows,), device="cuda") if gather else None
    if not gather:
        hidden = rnd(rows, H)
    we, wh, w = 1 + rnd(H, scale=0.1), 1 + rnd(H, scale=0.1), rnd((nq + 2 * nkv) * D, 2 * H, scale=(2 * H) ** -0.5)
    pos = torch.randint(0, 400, (rows,), device="cuda")
    slots = torch.randperm(cap, device="cuda")[:rows]
    inv = rope_inv_freq(c).cuda()
    kv = [rnd(2, 1, nkv, cap, D) for _ in range(2)]
    kv[1].copy_(kv[0])
    want = hl.eagle_qkv_ref(ids, embed, hidden, src, we, wh, 1e-5, w, pos, inv, nq, nkv, kv[1][0], kv[1][1], slots)
    got = hl.eagle_qkv(ids, embed, hidden, src, we, wh, 1e-5, w, pos, inv, nq, nkv, kv[0][0], kv[0][1], slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(list(got) + [kv[0]], list(want) + [kv[1]]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < tol


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_head_topk_16bit_keys_order_negative_scores_and_ties(dtype):
    """A 16-bit model's top-k keys pack the score's own 16 bits with the id: negative scores rank as
    floats do, and equal scores go to the lower id, within a block and across blocks."""
    H, V = SHAPES["bundled-head"]
    lm = torch.zeros(V, H, device="cuda")
    lm[:, 0] = -3.0
    lm[[3, 200, 201, 4500], 0] = -1.0  # four equal scores in three blocks
    lm[7, 0] = -0.5
    r = torch.zeros(2, H, device="cuda")
    r[:, 0] = 1.0
    _, lp, tok, _ = hl.head_topk(r.to(dtype), torch.zeros_like(r).to(dtype), torch.ones(H, device="cuda").to(dtype),
                                 1e-5, lm.to(dtype), 4)
    assert tok.tolist() == [[7, 3, 200, 201]] * 2
    assert (lp[:, 1] == lp[:, 2]).all() and (lp[:, 2] == lp[:, 3]).all() and (lp[:, 1] < lp[:, 0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,prep", [(0, True), (3, True), (3, False)])
def test_head_topk_runs_the_level_glue_as_level_step_does(d, prep, dtype):
    """head_topk with a tree level's glue (in its merging program) leaves the level buffers and the next
    mask exactly as head_topk followed by level_step (its own launch) does."""
    from tandem.kernels.resident import level_step

    w, depth, width = 4, 6, 256
    H, V = SHAPES["bundled-head"]
    R = 1 if d == 0 else w
    r, dl, nw, lm = _inputs(R, H, V, dtype, seed=7 + d)
    g = torch.Generator(device="cuda").manual_seed(d)
    nodes, rows = w + (depth - 1) * w * w, (depth - 1) * w
    state = dict(d2t=torch.randint(-5, 5, (V,), generator=g, device="cuda").clamp(min=0),
                 tok=torch.randint(0, V, (nodes,), generator=g, device="cuda"),
                 par=torch.randint(-1, nodes, (nodes,), generator=g, device="cuda"),
                 lp=-torch.rand(nodes, generator=g, device="cuda") * 5,
                 fed=w + (d - 1) * w * w + torch.randperm(w * w, generator=g, device="cuda")[:w] if d else
                 torch.zeros(w, dtype=torch.long, device="cuda"),
                 ids=torch.zeros(w, dtype=torch.long, device="cuda"), src=torch.zeros(w, dtype=torch.long, device="cuda"),
                 anc=torch.rand(rows, rows, generator=g, device="cuda") < 0.3)
    prefix = torch.tensor([37], device="cuda")
    a = {k: v.clone() for k, v in state.items()}
    b = {k: v.clone() for k, v in state.items()}
    glue = hl.LevelGlue(**a, prefix=prefix, d=d, width=width, prep=prep)
    _, lp_a, tok_a, mask_a = hl.head_topk(r, dl, nw, 1e-5, lm, w, glue=glue)
    _, lp_b, tok_b, _ = hl.head_topk(r, dl, nw, 1e-5, lm, w)
    mask_b = level_step(tok_b, lp_b, b["d2t"], b["tok"], b["par"], b["lp"], b["fed"], b["ids"], b["src"], b["anc"],
                        prefix, d, width, prep)
    assert torch.equal(tok_a, tok_b) and torch.equal(lp_a, lp_b)
    for k in state:
        assert torch.equal(a[k], b[k]), k
    assert (mask_a is None) == (mask_b is None) and (mask_a is None or torch.equal(mask_a, mask_b))
