"""Gated DeltaNet (GDN) over a draft tree without a state per node: torch references.

A GDN layer carries two recurrent states per sequence: the causal conv1d's last K - 1 inputs
(the conv state) and the gated delta rule's matrix S [heads, d_k, d_v] (the delta state).
Verifying a tree needs, for every node, the state after the node's whole root path. Keeping a
snapshot per node costs N states per layer (about 18 GB at N = 24 for a 27B target); instead
the *path walk* starts from the committed state and walks each root path, and `commit`
replays the accepted path into the committed state (SpecPilot s4.2).

Path walk used here: nodes are visited in depth-first preorder and a node's state is kept
only while some child of it is still unvisited, so at most depth + 1 states are alive at once
and every node is updated exactly once (shared path prefixes are not recomputed). The
conv state needs no walk at all: a node's conv window is a gather of its K - 1 nearest
ancestors' inputs, falling back into the committed conv state above the root.

Every node's state is computed by the same `_decay_update` on the same inputs, whether the
pass is a chain (prefill, AR decode), a tree, or the commit replay, so the replayed state
equals the walked state bit for bit, and a chain walk equals token-by-token decoding.

The *WY formulation* (`gdn_tree_wy`, SpecPilot s4.2) solves every root path at once with
matrix products instead of n rank-one updates: a node's state is the decayed committed state
plus a sum of rank-one terms k_j u_j^T over its path, and the pseudo-values u come from one
unit lower-triangular solve whose off-diagonal entries are the ancestor pairs. It equals the
walk up to fp32 rounding (not bitwise), so the exact loops keep the walk for tree passes and
use the chunked WY form for prefill, where every row is committed and all methods share it
(`gdn_chain_chunked`). Two Triton kernels compute the same on the GPU: the path kernel
(`gdn_path`: one program per node walks its root path with S in registers, bitwise the walk's
updates) and the WY kernel (`gdn_wy`: this WY form in one launch, its fp32 products as three
bf16 pieces on tensor cores).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


# ---- conv1d over a tree -------------------------------------------------------------------
def conv_windows(parents: list[int], kernel: int) -> torch.Tensor:
    """[n, kernel] long: for node i, the indices into `[conv_state (K - 1 cols) | n nodes]` of its
    K - 1 nearest ancestors' inputs (oldest first) then its own; above the tree's root the
    path continues into the committed conv state (its newest column first).

    parents: [n] in topological order; -1 marks a node hanging from the committed state.
    """
    n, past = len(parents), kernel - 1
    idx = np.empty((n, kernel), dtype=np.int64)
    for i in range(n):
        cur, committed = i, past  # committed: how far back into the conv state the walk has gone
        row = [past + i]
        for _ in range(past):
            if cur >= 0 and parents[cur] >= 0:
                cur = parents[cur]
                row.append(past + cur)
            else:
                cur, committed = -1, committed - 1
                row.append(committed)
        idx[i] = row[::-1]
    return torch.from_numpy(idx)


def conv_tree(ext: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU of every node along its own root path.

    ext: [B, K - 1 + n, C] (committed conv state, then the nodes' inputs); weight: [C, K];
    windows: [n, K] from `conv_windows`. Returns [B, n, C] in ext's dtype.
    """
    win = ext[:, windows.to(ext.device)]  # [B, n, K, C]
    # NOTE: products and sum in fp32, as the conv kernels accumulate; one rounding at the end.
    out = (win.float() * weight.t().float()).sum(2)  # [B, n, C]
    return F.silu(out).to(ext.dtype)


def conv_commit(ext: torch.Tensor, windows: torch.Tensor, last: int) -> torch.Tensor:
    """The conv state [B, C, K - 1] after the path ending at node `last`: its window minus the
    oldest column (the K - 1 newest inputs along the path)."""
    return ext[:, windows[last, 1:].to(ext.device)].transpose(1, 2).contiguous()


# ---- gated delta rule over a tree ---------------------------------------------------------
def _decay_update(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> torch.Tensor:
    """One gated delta-rule step: S <- exp(g) S + k (beta (v - (exp(g) S)^T k))^T.

    S: [B, H, dk, dv] fp32; k: [B, H, dk]; v: [B, H, dv]; g (log decay), beta: [B, H].
    """
    S = S * g.exp()[..., None, None]
    kv_mem = (S * k[..., None]).sum(-2)  # [B, H, dv]: what S recalls for k
    delta = (v - kv_mem) * beta[..., None]
    return S + k[..., None] * delta[..., None, :]


def _read(S: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (S * q[..., None]).sum(-2)  # [B, H, dv]


def gdn_tree_walk(S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, parents: list[int]) -> torch.Tensor:
    """Per-node outputs of the gated delta rule, each after its own root path from S0.

    S0: [B, H, dk, dv] fp32 committed state (read only); q, k: [B, n, H, dk] fp32 (q already
    scaled); v: [B, n, H, dv]; g, beta: [B, n, H]; parents: [n], -1 = hangs from S0.
    Returns o: [B, n, H, dv] fp32.
    """
    n = len(parents)
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        (roots if p < 0 else children[p]).append(i)
    pending = [len(c) for c in children]  # children not yet visited
    live: dict[int, torch.Tensor] = {}  # states of nodes with unvisited children
    stack = roots[::-1]
    while stack:
        i = stack.pop()
        p = parents[i]
        S = _decay_update(S0 if p < 0 else live[p], k[:, i], v[:, i], g[:, i], beta[:, i])
        out[:, i] = _read(S, q[:, i])
        if p >= 0:
            pending[p] -= 1
            if pending[p] == 0:
                del live[p]
        if children[i]:
            live[i] = S
            stack.extend(children[i][::-1])  # depth first, children in index order
    return out


def gdn_replay(S0: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               path: list[int]) -> torch.Tensor:
    """The delta state after the nodes `path` (a root path, root first), replayed from S0 with
    the inputs the walk used: bitwise the state the walk had at path[-1]. Returns [B, H, dk, dv]."""
    S = S0
    for i in path:
        S = _decay_update(S, k[:, i], v[:, i], g[:, i], beta[:, i])
    return S


def gdn_snapshots_ref(S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-node-snapshot baseline the walk replaces (tests only): nodes in index order,
    every node's state kept. Returns (o [B, n, H, dv], states [n, B, H, dk, dv])."""
    states, outs = [], []
    for i, p in enumerate(parents):
        S = _decay_update(S0 if p < 0 else states[p], k[:, i], v[:, i], g[:, i], beta[:, i])
        states.append(S)
        outs.append(_read(S, q[:, i]))
    return torch.stack(outs, 1), torch.stack(states)


# ---- WY: every root path as matrix products -----------------------------------------------
# With a_i = exp(g_i), G_i the sum of g over node i's root path (itself included) and u_i a
# pseudo-value, each node's state after its path is
#     S_i = exp(G_i) S0 + sum_{j on the path to i, i included} exp(G_i - G_j) k_j u_j^T,
# which the update S_i = a_i S_p + k_i (beta_i (v_i - (a_i S_p)^T k_i))^T satisfies when
#     u_i + beta_i sum_{j strict ancestor of i} exp(G_i - G_j) (k_i . k_j) u_j
#         = beta_i (v_i - exp(G_i) S0^T k_i).
# Nodes are in topological order, so that system is unit lower triangular: one solve for all
# paths at once, and o_i = S_i^T q_i is two more products. Only ancestor pairs enter, so the
# tree's other branches never leak into a node (the chain is the causal special case).
def path_log_decay(g: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """[B, H, n] fp32: G_i, the sum of the log decays g [B, n, H] over node i's root path (i
    included); anc: [n, n] bool ancestor-or-self mask (tandem.tree.draft_tree.ancestor_mask)."""
    return g.transpose(1, 2) @ anc.to(g.dtype).t()


def gdn_tree_wy(S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, anc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-node outputs of the gated delta rule over a tree, all paths at once (the WY form).

    S0: [B, H, dk, dv] fp32 (read only); q (scaled), k: [B, n, H, dk] fp32; v: [B, n, H, dv];
    g, beta: [B, n, H]; anc: [n, n] bool ancestor-or-self mask, on S0's device.
    Returns (o [B, n, H, dv] fp32, U [B, H, n, dv] pseudo-values, G [B, H, n] path log decays):
    `gdn_wy_commit` turns U and G into the state after any root path.
    """
    G = path_log_decay(g, anc)  # [B, H, n]
    # NOTE: masked before the exp: for a non-ancestor pair G_i - G_j may be large and positive
    diff = G[..., :, None] - G[..., None, :]  # [B, H, n, n]
    decay = torch.where(anc, diff, float("-inf")).exp()  # exp(G_i - G_j) on ancestor-or-self pairs, else 0
    K, Q, V = k.transpose(1, 2), q.transpose(1, 2), v.transpose(1, 2)  # [B, H, n, d]
    eG = G.exp()[..., None]  # [B, H, n, 1]
    b = beta.transpose(1, 2)[..., None]  # [B, H, n, 1]
    # the solve reads only the strict lower triangle (unitriangular), so the diagonal of the
    # product may stay as it is
    L = b * (K @ K.transpose(-1, -2)) * decay  # [B, H, n, n]
    rhs = b * (V - eG * (K @ S0))  # [B, H, n, dv]
    U = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    o = eG * (Q @ S0) + ((Q @ K.transpose(-1, -2)) * decay) @ U  # [B, H, n, dv]
    return o.transpose(1, 2), U, G


def gdn_wy_commit(S0: torch.Tensor, k: torch.Tensor, U: torch.Tensor, G: torch.Tensor, path: list[int]
                  ) -> torch.Tensor:
    """The delta state [B, H, dk, dv] after the root path `path` (root first) of a WY pass:
    exp(G_last) S0 + sum over the path of exp(G_last - G_j) k_j u_j^T, one product."""
    idx = torch.tensor(path, device=U.device)
    last = G[..., path[-1]]  # [B, H]
    w = (last[..., None] - G[..., idx]).exp()[..., None]  # [B, H, m, 1]
    Kp = k.transpose(1, 2)[:, :, idx]  # [B, H, m, dk]
    return last.exp()[..., None, None] * S0 + Kp.transpose(-1, -2) @ (w * U[:, :, idx])


def gdn_chain_chunked(S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain (prefill) in WY chunks of `chunk` rows, the state carried from chunk to chunk.
    Shapes as `gdn_tree_walk`. Returns (o [B, n, H, dv] fp32, the state after the last row)."""
    n = q.shape[1]
    outs, S = [], S0
    w = min(chunk, n)
    causal = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        sl = slice(s, e)
        o, U, G = gdn_tree_wy(S, q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], causal[:e - s, :e - s])
        outs.append(o)
        S = gdn_wy_commit(S, k[:, sl], U, G, list(range(e - s)))
    return torch.cat(outs, 1), S
