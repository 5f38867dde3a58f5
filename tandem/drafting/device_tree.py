"""The best-first tree over a block drafter's lattice, built on the device (no host round trip).

tandem.drafting.lattice builds the same tree on the host with a lazy heap; the device-resident
loop (tandem.runtime.resident) needs it inside a CUDA graph, so here it is a fixed-shape
computation:

1. **Level beams.** Level d + 1 keeps the N best children (by path score) of level d's N best
   nodes: N x K candidates, N kept. Every node of the global top N is in its level's beam: its
   parent scores at least as high, so (by induction) the parent is in the previous beam, and
   fewer than N nodes of any level beat it.
2. **Selection.** The N best nodes over all B beams (B x N candidates) are the tree. A child never
   scores above its parent (log-probs are <= 0) and ties go to the shallower node, so the set is
   prefix-closed. Sorted by (level, beam slot) it is in topological order.

Scores travel as one int64 key per candidate: an order-preserving integer image of the float
score in the high 32 bits, the complement of the candidate's flat index in the low 32. Keys are
distinct, so the top-N is the same on every device and ties break toward the lower index (the
earlier parent, the better-ranked candidate), like the host walk's stable order.

On CUDA the level loop (B sequential small top-Ns, the part that would be ~100 tiny kernels)
is one Triton program; elsewhere it is the torch reference below, which defines the semantics.
"""
from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None


def lattice_tables(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows: [B, 3K + K*K] from BlockDrafter.lattice_rows, the root's row first ->
    (tok [B, K] int64 candidate ids, cond [B, K, K] float32 parent-conditioned log-probs);
    cond[0, 0] holds the root's children (given the root token itself), as unpack_lattice."""
    B = rows.shape[0]
    rows = rows.float()
    tok = rows[:, :k].long()
    cond = rows[:, 3 * k:].reshape(B, k, k)
    first = torch.cat([rows[:1, 2 * k:3 * k], cond[0, 1:]])[None]  # [1, K, K]
    return tok, torch.cat([first, cond[1:]])


def score_keys(score: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] -> int64 [..., n] keys, ordered as the scores, ties to the lower index."""
    bits = score.float().contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # monotone in the float
    n = score.shape[-1]
    return (ordered << 32) | (n - 1 - torch.arange(n, device=score.device))


def key_index(key: torch.Tensor, n: int) -> torch.Tensor:
    return (n - 1) - (key & 0xFFFFFFFF)


def key_score(key: torch.Tensor) -> torch.Tensor:
    hi = (key >> 32).int()
    return torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).view(torch.float32)


def beam_levels_ref(cond: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cond: [B, K, K] -> per level d (the nodes at depth d + 1): the `width` best nodes' scores
    [B, W] float32, candidate index at their position [B, W] and parent's slot in level d - 1's
    beam [B, W] (int64). Level 0's parent is the root (slot 0)."""
    B, K, _ = cond.shape
    dev = cond.device
    score = torch.full((width,), float("-inf"), device=dev)
    score[0] = 0.0
    cand = torch.zeros(width, dtype=torch.long, device=dev)
    scores, cands, pslots = [], [], []
    for d in range(B):
        s = (score[:, None] + cond[d].index_select(0, cand)).reshape(-1)  # [W * K]
        top = score_keys(s).topk(width).values  # sorted, distinct
        idx = key_index(top, width * K)
        score, cand = key_score(top), idx % K
        scores.append(score)
        cands.append(cand)
        pslots.append(idx // K)
    return torch.stack(scores), torch.stack(cands), torch.stack(pslots)


def beam_levels(cond: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """beam_levels_ref, as one Triton program on CUDA (TANDEM_TRITON=0: the reference)."""
    B, K, _ = cond.shape
    usable = (triton is not None and cond.is_cuda and os.environ.get("TANDEM_TRITON", "1") != "0"
              and width & (width - 1) == 0 and K & (K - 1) == 0 and width * K >= 16)
    if not usable:
        return beam_levels_ref(cond, width)
    cond = cond.float().contiguous()
    scores = torch.empty(B, width, device=cond.device)
    cands = torch.empty(B, width, dtype=torch.long, device=cond.device)
    pslots = torch.empty(B, width, dtype=torch.long, device=cond.device)
    scratch = torch.empty(width * K, dtype=torch.long, device=cond.device)
    _beam_kernel[(1,)](cond, scores, cands, pslots, scratch, B=B, W=width, K=K)
    return scores, cands, pslots


def select_tree(tok: torch.Tensor, root: torch.Tensor, scores: torch.Tensor, cands: torch.Tensor,
                pslots: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `nodes` best nodes over all level beams -> (tokens [M], parents [M], depth [M]) with
    M = nodes + 1, root first, in topological order (parents[0] = -1). root: [1] int64."""
    B, W = scores.shape
    flat = score_keys(scores.reshape(-1)).topk(nodes).values  # [N]
    sel = key_index(flat, B * W).sort().values  # depth-major: a topological order
    level, slot = sel // W, sel % W
    ids = torch.zeros(B * W, dtype=torch.long, device=tok.device)
    ids.index_copy_(0, sel, torch.arange(1, nodes + 1, device=tok.device))  # node id of each kept entry
    parent_entry = (level - 1).clamp(min=0) * W + pslots.reshape(-1).index_select(0, sel)
    parent = torch.where(level == 0, 0, ids.index_select(0, parent_entry))
    cand = cands.reshape(-1).index_select(0, sel)
    token = tok.reshape(-1).index_select(0, level * tok.shape[1] + cand)
    minus1 = torch.full((1,), -1, dtype=torch.long, device=tok.device)
    return (torch.cat([root, token]), torch.cat([minus1, parent]),
            torch.cat([torch.zeros_like(minus1), level + 1]))


def best_first_tree_device(tok: torch.Tensor, cond: torch.Tensor, root: torch.Tensor, nodes: int):
    """The device counterpart of tandem.drafting.lattice.best_first_tree (same node set)."""
    width = 1 << max(0, nodes - 1).bit_length()  # a power of two >= nodes (the kernel's tile)
    scores, cands, pslots = beam_levels(cond, width)
    return select_tree(tok, root, scores, cands, pslots, nodes)


def best_chain_device(tok: torch.Tensor, cond: torch.Tensor, root: torch.Tensor, k: int):
    """The device counterpart of tandem.drafting.lattice.best_chain: the greedy path of k nodes."""
    scores, cands, _ = beam_levels(cond[:k], 1)
    depth = torch.arange(k + 1, device=tok.device)
    token = tok[:k].gather(1, cands).reshape(-1)  # [k]
    return torch.cat([root, token]), depth - 1, depth


def ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents: [M] (root -1) -> [M, M] bool, [i, j] True when j is i or an ancestor of i.
    Reachability by squaring (I + P): log2(max_depth) small matrix products, no host loop."""
    M = parents.shape[0]
    a = torch.eye(M, device=parents.device)
    a[1:].scatter_(1, parents[1:, None].clamp(min=0), 1.0)  # (a scalar value: nothing copied from the host)
    for _ in range(max(1, max_depth - 1).bit_length()):
        a = (a @ a).clamp_(max=1.0)
    return a > 0


if triton is not None:

    @triton.jit
    def _beam_kernel(cond_ptr, score_ptr, cand_ptr, pslot_ptr, scratch_ptr, B: tl.constexpr, W: tl.constexpr,
                     K: tl.constexpr):
        # one program: the B levels run in sequence, each a sort of W * K packed keys
        WK: tl.constexpr = W * K
        w = tl.arange(0, W)
        k = tl.arange(0, K)
        flat = tl.arange(0, WK)
        score = tl.where(w == 0, 0.0, float("-inf"))
        cand = tl.zeros([W], dtype=tl.int32)
        for d in range(B):
            row = tl.load(cond_ptr + d * K * K + cand[:, None] * K + k[None, :])  # [W, K]
            s = tl.reshape(score[:, None] + row, [WK])
            bits = s.to(tl.int32, bitcast=True)
            ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            key = (ordered.to(tl.int64) << 32) | (WK - 1 - flat).to(tl.int64)
            key = tl.sort(key, 0, descending=True)
            tl.store(scratch_ptr + flat, key)
            tl.debug_barrier()
            top = tl.load(scratch_ptr + w)  # the W best
            tl.debug_barrier()
            hi64 = top >> 32
            idx = (WK - 1) - (top - (hi64 << 32)).to(tl.int32)
            hi = hi64.to(tl.int32)
            score = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
            cand = idx % K
            tl.store(score_ptr + d * W + w, score)
            tl.store(cand_ptr + d * W + w, cand.to(tl.int64))
            tl.store(pslot_ptr + d * W + w, (idx // K).to(tl.int64))
