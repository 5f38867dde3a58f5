"""The GDN path kernel: every tree node's gated delta rule in one Triton launch (SpecPilot s4.2).

`tandem.kernels.gdn.gdn_tree_walk` visits the nodes one after another from the host: n rank-one
updates of [B, H, dk, dv] states, each a few torch ops. Here one program takes one node, one
(sequence, head) and one block of BV value columns: it loads that block of the committed state
S0 into registers and walks the node's root path, root first, doing the walk's update at every
step, then reads the state with the node's query. Nodes share no work (a node at depth d redoes
its d ancestors' updates) but all of them run at once, and the state never leaves registers,
so a tree pass is one launch per GDN layer with no state per node in memory.

The commit runs the same program over the accepted path's last node and stores the state
instead of reading it (`gdn_path_commit`, in place). The arithmetic of a step does not depend
on where the walk started, so the state a tree pass reached at a node and the state committed
after the path to it are the same bits, and a chain pass gives bitwise what token-by-token
decoding through this kernel gives: the walk's exactness, on the GPU.

Layout: q, k [B, n, H, dk], v [B, n, H, dv], g, beta [B, n, H], all fp32 and contiguous (the
GDN layer's tensors); S0 [B, H, dk, dv] fp32. One program holds a BK x BV fp32 block
(BK = dk rounded up to a power of two; 128 x 32 at dk = 128: 32 registers a thread).
"""
from __future__ import annotations

import numpy as np
import torch

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

BV = 32  # value columns per program


def path_kernel_runs(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of `device`: CUDA with Triton, or any device under
    Triton's interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    import os

    return triton is not None and (torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def root_paths(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(paths [n, depth] int32: node i's root path, root first, padded with -1; lengths [n] int32).

    parents: [n] in topological order, -1 for a node hanging from the committed state."""
    n = len(parents)
    depth = np.zeros(n, dtype=np.int32)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    paths = np.full((n, int(depth.max(initial=1))), -1, dtype=np.int32)
    for i, p in enumerate(parents):  # a node's path is its parent's plus itself
        if p >= 0:
            paths[i, :depth[p]] = paths[p, :depth[p]]
        paths[i, depth[i] - 1] = i
    return torch.from_numpy(paths), torch.from_numpy(depth)


if triton is not None:

    @triton.jit
    def _path_kernel(s0_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, paths_ptr, lens_ptr, nodes_ptr, out_ptr,
                     n, H, DK, DV, depth, BK: tl.constexpr, BV: tl.constexpr, STORE_STATE: tl.constexpr):
        # program (r, b * H + h, value block): node nodes[r] of sequence b, head h
        r, bh, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        i = tl.load(nodes_ptr + r)
        ok, ov = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
        mk, mv = ok < DK, ov < DV
        m2 = mk[:, None] & mv[None, :]
        s_off = bh * DK * DV + ok[:, None] * DV + ov[None, :]
        S = tl.load(s0_ptr + s_off, mask=m2, other=0.0)  # [BK, BV] fp32
        L = tl.load(lens_ptr + i)
        for t in range(0, L):
            j = tl.load(paths_ptr + i * depth + t)
            row = (b * n + j) * H + h  # node j's (sequence b, head h) row
            kj = tl.load(k_ptr + row * DK + ok, mask=mk, other=0.0)  # [BK]
            vj = tl.load(v_ptr + row * DV + ov, mask=mv, other=0.0)  # [BV]
            S = S * tl.exp(tl.load(g_ptr + row))
            kv = tl.sum(S * kj[:, None], axis=0)  # [BV]: what the decayed state recalls for k
            S = S + kj[:, None] * ((vj - kv) * tl.load(beta_ptr + row))[None, :]
        if STORE_STATE:
            tl.store(out_ptr + s_off, S, mask=m2)
        else:
            qi = tl.load(q_ptr + ((b * n + i) * H + h) * DK + ok, mask=mk, other=0.0)
            o = tl.sum(S * qi[:, None], axis=0)  # [BV]
            tl.store(out_ptr + ((b * n + i) * H + h) * DV + ov, o, mask=mv)


def _launch(S0, q, k, v, g, beta, paths, lens, nodes, out, store: bool) -> None:
    B, n, H, dk = k.shape
    dv = v.shape[-1]
    for t in (S0, q, k, v, g, beta):
        assert t.dtype == torch.float32 and t.is_contiguous(), "the path kernel takes contiguous fp32 tensors"
    bk = triton.next_power_of_2(dk)
    grid = (nodes.numel(), B * H, triton.cdiv(dv, BV))
    _path_kernel[grid](S0, q, k, v, g, beta, paths, lens, nodes, out, n, H, dk, dv, paths.shape[1],
                       BK=bk, BV=BV, STORE_STATE=store)


def gdn_path_tree(S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, paths: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Per-node outputs o [B, n, H, dv] fp32 of the gated delta rule, each after its root path
    from S0 (read only); `paths`, `lens` from `root_paths`, on k's device. What `gdn_tree_walk`
    computes."""
    n = k.shape[1]
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    nodes = torch.arange(n, dtype=torch.int32, device=k.device)
    _launch(S0, q, k, v, g, beta, paths, lens, nodes, out, store=False)
    return out


def gdn_path_commit(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    paths: torch.Tensor, lens: torch.Tensor, last: int) -> torch.Tensor:
    """The state after the root path of node `last`, written over S [B, H, dk, dv] (each program
    reads its block of S before it writes it) and returned: bitwise the state `gdn_path_tree`
    read the node with."""
    nodes = torch.arange(last, last + 1, dtype=torch.int32, device=k.device)  # (a device op, no copy)
    _launch(S, k, k, v, g, beta, paths, lens, nodes, S, store=True)
    return S
