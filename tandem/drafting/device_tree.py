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

The pieces (level beams, selection, ancestors, with their Triton kernels) are pure tensor
functions in tandem.kernels.resident; this module composes them into the tree.
"""
from __future__ import annotations

import torch

from tandem.kernels.resident import (ancestors, beam_levels, beam_levels_ref, key_index, key_score,  # noqa: F401
                                     score_keys, select_nodes)


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


def best_first_tree_device(tok: torch.Tensor, cond: torch.Tensor, root: torch.Tensor, nodes: int):
    """The device counterpart of tandem.drafting.lattice.best_first_tree (same node set)."""
    width = 1 << max(0, nodes - 1).bit_length()  # a power of two >= nodes (the kernel's tile)
    scores, cands, pslots = beam_levels(cond, width)
    return select_nodes(tok, root, scores, cands, pslots, nodes)


def best_chain_device(tok: torch.Tensor, cond: torch.Tensor, root: torch.Tensor, k: int):
    """The device counterpart of tandem.drafting.lattice.best_chain: the greedy path of k nodes."""
    scores, cands, _ = beam_levels(cond[:k], 1)
    depth = torch.arange(k + 1, device=tok.device)
    token = tok[:k].gather(1, cands).reshape(-1)  # [k]
    return torch.cat([root, token]), depth - 1, depth
