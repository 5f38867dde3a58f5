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

3. **A narrow pass first** (the one-launch kernel on CUDA). Steps 1-2 with beams of N / 2 give the
   same tree whenever it holds fewer than N / 2 nodes at every level: each level's worst beam entry
   is then outside the tree, and every node the narrow beams dropped scores below that entry (or
   below an ancestor that did). Otherwise the kernel runs the full beams too. At the bundled block
   drafter's lattices the narrow tree is kept 94% of the time (bench/gpu_draft_kernels.py).

The pieces (level beams, selection, ancestors, with their Triton kernels) are pure tensor
functions in tandem.kernels.resident; this module composes them into the tree.
"""
from __future__ import annotations

import torch

from tandem.kernels.resident import beam_levels, select_tree_fused, tree_fused


def best_first_tree_device(tok: torch.Tensor, cond: torch.Tensor, root: torch.Tensor, nodes: int,
                           out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The device counterpart of tandem.drafting.lattice.best_first_tree (same node set):
    (tokens [M], parents [M], depth [M], ancestors [M, M]), M = nodes + 1, written into `out`
    when given (the resident loop's static buffers)."""
    if out is None:
        M, dev = nodes + 1, tok.device
        out = (torch.zeros(M, dtype=torch.long, device=dev), torch.zeros(M, dtype=torch.long, device=dev),
               torch.zeros(M, dtype=torch.long, device=dev), torch.zeros(M, M, dtype=torch.bool, device=dev))
    width = 1 << max(0, nodes - 1).bit_length()  # a power of two >= nodes (the kernel's tile)
    if tree_fused(tok, root, cond, width, nodes, out):  # one launch on CUDA
        return out
    scores, cands, pslots = beam_levels(cond, width, nodes)  # (the levels stop where no deeper node can be kept)
    select_tree_fused(tok, root, scores, cands, pslots, nodes, out)
    return out


def chain_tokens(tok: torch.Tensor, cond: torch.Tensor, root: torch.Tensor, k: int) -> torch.Tensor:
    """The greedy path's tokens [k + 1], root first: a level beam of width 1."""
    _, cands, _ = beam_levels(cond[:k], 1)
    return torch.cat([root, tok[:k].gather(1, cands).reshape(-1)])


def best_chain_device(tok: torch.Tensor, cond: torch.Tensor, root: torch.Tensor, k: int):
    """The device counterpart of tandem.drafting.lattice.best_chain: the greedy path of k nodes
    (tokens, parents, depth)."""
    depth = torch.arange(k + 1, device=tok.device)
    return chain_tokens(tok, cond, root, k), depth - 1, depth
