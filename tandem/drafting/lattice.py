"""The candidate lattice of a parallel drafter, and the best-first tree over it (SpecPilot s4.2).

A block drafter proposes B positions at once; position j (1-based: the j-th token after the
root) has K candidate tokens. A path through the lattice picks one candidate per position, and
its score is the sum of log p(child | parent): the child's log-prob at its position, plus the
Markov head's bigram score given the parent's token, renormalised over the position's
candidates (the mass outside the top K is kept as it was). The tree keeps the N nodes of
highest path score. It is prefix-closed by construction: a node is only offered once its parent
is in the tree, and a child never scores above its parent (log-probs are <= 0).

    cond[0][0, b]   = log p(candidate b at position 1 | root)
    cond[j][a, b]   = log p(candidate b at position j + 1 | candidate a at position j)

The tables are computed on the device in one batch and read back with one copy; the best-first
walk itself is a small heap on the host (N pops).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from tandem.tree.draft_tree import DraftTree


@dataclass
class Lattice:
    """tokens: [B, K] candidate ids per position; cond: [B, K, K] parent-conditioned log-probs
    (row 0 of cond[0] is the root's; its other rows are unused)."""

    tokens: np.ndarray
    cond: np.ndarray

    @property
    def positions(self) -> int:
        return self.tokens.shape[0]


def build_lattice(logits: torch.Tensor, k: int, root: int, markov=None) -> Lattice:
    """logits: [B, vocab] the drafter's next-token logits for the B positions after the root.
    `markov(prev [..], nxt [..]) -> [..]` is the bigram score (None: no Markov head)."""
    lf = logits.float()
    lp_all = torch.log_softmax(lf, dim=-1)
    lp, tok = lp_all.topk(min(k, lf.shape[-1]), dim=-1)  # [B, K] each
    B, K = lp.shape
    if markov is None:
        cond = lp[:, None, :].expand(B, K, K)  # the parent does not matter; top-K log-probs as they are
    else:
        prev = torch.empty(B, K, dtype=torch.long, device=tok.device)  # parent token per (position, row)
        prev[0] = root
        prev[1:] = tok[:-1]
        s = lp[:, None, :] + markov(prev[:, :, None], tok[:, None, :])  # [B, K(parent), K(child)]
        # renormalise over the candidates plus the mass outside the top K (kept as it was)
        rest = torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-6))  # [B]
        norm = torch.logaddexp(torch.logsumexp(s, dim=-1), rest[:, None])  # [B, K]
        cond = s - norm[..., None]
    host = torch.cat([tok.double().reshape(-1), cond.double().reshape(-1)]).cpu().numpy()  # one copy
    return Lattice(tokens=host[:B * K].astype(np.int64).reshape(B, K), cond=host[B * K:].reshape(B, K, K))


def unpack_lattice(rows: torch.Tensor, k: int) -> Lattice:
    """rows: [B, 3K + K*K] from BlockDrafter.lattice_rows, the root's row first -> Lattice
    (one device-to-host copy)."""
    host = rows.float().cpu().numpy()
    B = host.shape[0]
    cond = host[:, 3 * k:].reshape(B, k, k).astype(np.float64)
    cond[0, 0] = host[0, 2 * k:3 * k]  # the root's children: given the root token itself
    return Lattice(tokens=host[:, :k].astype(np.int64), cond=cond)


def best_first_tree(lat: Lattice, root: int, nodes: int, max_depth: int | None = None) -> DraftTree:
    """The `nodes` highest-scoring lattice nodes under the root, prefix-closed, as a DraftTree
    in topological order (the order they were taken). Ties break on parent, then candidate rank.

    A lazy best-first walk: the heap holds, per taken node, only its next-best child not yet
    taken; taking a node offers its parent's next child and its own best child."""
    depth_cap = lat.positions if max_depth is None else min(max_depth, lat.positions)
    cond = lat.cond
    cand_tokens = lat.tokens.tolist()
    tokens, parents, logp = [root], [-1], [0.0]
    cand_of, depth = [0], [0]  # per node: its candidate index at its position (root: 0), its depth
    # per node: its children's cond row, and their candidate order (best first) once a second
    # child is asked for; most nodes only ever offer their best child (argmax, no sort)
    ranked: list[list | None] = [None]
    heap: list[tuple[float, int, int, int]] = []  # (-score, parent, rank among its children, candidate)
    K = lat.tokens.shape[1]

    def offer(parent: int, rank: int) -> None:
        d = depth[parent]
        if d >= depth_cap or rank >= K:
            return
        r = ranked[parent]
        if r is None:
            vals = cond[d, cand_of[parent]].tolist()
            r = ranked[parent] = [vals, None]
        vals = r[0]
        if rank == 0:
            c = vals.index(max(vals))  # the first of equal maxima, like a stable sort
        else:
            if r[1] is None:
                r[1] = sorted(range(K), key=vals.__getitem__, reverse=True)  # stable
            c = r[1][rank]
        heapq.heappush(heap, (-(logp[parent] + vals[c]), parent, rank, c))

    offer(0, 0)
    while heap and len(tokens) - 1 < nodes:
        neg, parent, rank, c = heapq.heappop(heap)
        d = depth[parent]
        tokens.append(cand_tokens[d][c])
        parents.append(parent)
        logp.append(-neg)
        cand_of.append(c)
        depth.append(d + 1)
        ranked.append(None)
        offer(parent, rank + 1)  # the next sibling
        offer(len(tokens) - 1, 0)  # the new node's best child
    return DraftTree(tokens=tokens, parents=parents, logp=logp)


def best_chain(lat: Lattice, root: int, k: int) -> DraftTree:
    """The greedy path: at each position the most probable candidate given its parent."""
    tokens, c = [root], 0
    for d in range(min(k, lat.positions)):
        c = int(np.argmax(lat.cond[d, c]))
        tokens.append(int(lat.tokens[d, c]))
    return DraftTree.chain(tokens)
