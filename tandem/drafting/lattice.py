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


def best_first_trees(rows: torch.Tensor, positions: list[int], roots: list[int], k: int,
                     nodes: int) -> list[DraftTree]:
    """best_first_tree for R lattices at once, in a fixed number of tensor ops whatever R (on
    the lattices' device): a batch of block drafts then costs the host about as much as one
    (a heap walk per request grows with the batch).

    rows: [R, B, 3K + K*K] each request's lattice rows (BlockDrafter.lattice_rows: the root's
    row, then its mask rows), padded to B; positions[r]: its real rows. -> each request's
    `nodes` best nodes, in depth-major order (parents first), read back in one copy.

    Level beams, as tandem.drafting.device_tree builds one tree: level d + 1 keeps the `nodes`
    best children of level d's beam, so every node of the global best set is in its level's
    beam; then the best `nodes` over all beams. Scores in float64 with stable sorts (ties to the
    lower parent slot, then candidate), as the heap walk sums and orders them. Positions past a
    request's own are -inf, and so are the nodes a lattice too short to hold `nodes` leaves
    over: those are dropped."""
    R, B = rows.shape[:2]
    dev, W = rows.device, nodes  # W: the beam width
    rows = rows.double()
    tok = rows[:, :, :k].long()  # [R, B, K]
    cond = rows[:, :, 3 * k:].reshape(R, B, k, k).clone()  # [R, B, K(parent), K(child)]
    cond[:, 0, 0] = rows[:, 0, 2 * k:3 * k]  # the root's children: given the root token itself
    cond[torch.arange(B, device=dev)[None] >= torch.tensor(positions, device=dev)[:, None]] = float("-inf")
    score = torch.full((R, W), float("-inf"), dtype=torch.float64, device=dev)
    score[:, 0] = 0.0  # slot 0 of the root's "beam" is the root
    cand = torch.zeros(R, W, dtype=torch.long, device=dev)
    scores, cands, pslots = [], [], []
    for d in range(B):
        child = cond[:, d].gather(1, cand[:, :, None].expand(R, W, k))  # [R, W, K] the beam's children
        s = (score[:, :, None] + child).reshape(R, W * k)
        best = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :W]
        score = s.gather(1, best)
        cand = best % k
        scores.append(score)
        cands.append(cand)
        pslots.append(best // k)
    flat = torch.stack(scores, 1).reshape(R, B * W)
    top = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :nodes]  # the best over every level
    sel = top.sort(dim=1).values  # depth-major: a topological order
    level = sel // W
    ids = torch.zeros(R, B * W, dtype=torch.long, device=dev)  # tree position of each kept entry
    ids.scatter_(1, sel, torch.arange(1, nodes + 1, device=dev).expand(R, nodes))
    parent_entry = (level - 1).clamp(min=0) * W + torch.stack(pslots, 1).reshape(R, -1).gather(1, sel)
    parent = torch.where(level == 0, 0, ids.gather(1, parent_entry))
    c = torch.stack(cands, 1).reshape(R, -1).gather(1, sel)
    token = tok.reshape(R, B * k).gather(1, level * k + c)
    logp = flat.gather(1, sel)
    token, parent, logp = token.tolist(), parent.tolist(), logp.tolist()  # (one copy each, after one sync)
    out = []
    for r in range(R):
        keep = [j for j, v in enumerate(logp[r]) if v != float("-inf")]  # (-inf nodes come with their subtrees)
        if len(keep) == nodes:
            out.append(DraftTree(tokens=[roots[r]] + token[r], parents=[-1] + parent[r], logp=[0.0] + logp[r]))
            continue
        index = {j + 1: i + 1 for i, j in enumerate(keep)}
        out.append(DraftTree(tokens=[roots[r]] + [token[r][j] for j in keep],
                             parents=[-1] + [index.get(parent[r][j], 0) for j in keep],
                             logp=[0.0] + [logp[r][j] for j in keep]))
    return out
