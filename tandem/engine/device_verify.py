"""Verifying a greedy `tree` step on the device: the drafted trees never come back to the host.

The host path reads every drafted tree back, builds and packs each one, runs the target and
reads its argmax back: two read-backs a step, and the device idle while the host packs. Here
(`launch` and `read`, Engine._verify_on_device's work) the trees stay on the device as the drafter's
captured tree left them ([6, R, n]: token, parent's tree position, rank, log-prob bits, depth,
ancestor mask; BatchedTreeDrafter.propose_device):

1. the host packs each request's n + 1 rows as a FLAT tree (every node a child of the root):
   the same rows, KV slots and mask word as any tree of n nodes, so the pack needs no tree,
   while the device is still drafting;
2. the device writes the real tokens, positions (the root's plus the depth) and ancestor masks
   over the flat tree's (kernels.tree_verify.fill_tree_rows);
3. the target pass, the argmax of every row, and each tree's accepted path: a node is accepted
   when its token is the argmax after its parent, a path when all its nodes are; the deepest
   such node's ancestor mask is the path (kernels.tree_verify.accept_paths);
4. one read-back brings each path, its bonus token, the tree's deepest depth and its tokens.

The same tokens as the host path's greedy_accept, step for step (tests/test_engine.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.batched_model import BatchedModel, PackColumns
from tandem.engine.scheduler import ScheduledRows
from tandem.kernels import tree_verify
from tandem.kernels.upload import download
from tandem.kv.paged import PagedKVPool
from tandem.tree.draft_tree import node_masks
from tandem.verify.verifier import VerifyResult

_FLAT: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = {}  # n -> a flat tree's masks, depths, node tokens


def _flat(n: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    if n not in _FLAT:
        bits, depth = node_masks([-1] + [0] * n)
        _FLAT[n] = (np.asarray(bits, dtype=np.uint64), np.asarray(depth, dtype=np.int64), [0] * n)
    return _FLAT[n]


@dataclass
class Launched:
    """A verify pass queued on the device, its accepts on their way to the host."""

    acc: torch.Tensor  # [R, 3 + n] on the device: path bits, bonus, deepest depth, the tree's tokens
    host: torch.Tensor  # [R, 3 + n] its copy on the host (pinned on a GPU: filled once `done` is)
    done: "torch.cuda.Event | None"
    logits: torch.Tensor  # [R (n + 1), V]
    n: int


def launch(model: BatchedModel, pool: PagedKVPool, decodes: list[ScheduledRows], tree: torch.Tensor, n: int
           ) -> Launched:
    """The target pass over the decodes' trees (tree [6, R, n], in their order) and the accepts, queued; the accepts' copy to the host queued behind them, so
    that more work (the drafter's next context pass: accepted_rows) can queue before `read` waits."""
    R, W = len(decodes), n + 1
    bits, depth, zeros = _flat(n)
    seqs = pool.seqs
    tokens: list[int] = []  # [R (n + 1)] the root's token, then the flat tree's placeholders
    S, prefix, tables, versions = [], [], [], []  # [R] each
    for s in decodes:
        req = s.request
        sb = seqs[req.request_id]
        tables.append(sb.blocks)
        versions.append(sb.version)
        tokens.append(req.last_token)
        tokens += zeros
        S.append(s.start + W)
        prefix.append(s.start)
    rows = model.rows(PackColumns(tokens, [W] * R, S, prefix, [True] * R, tables, np.tile(bits, R), None,
                                  np.tile(depth, R), 1, versions))
    tree_verify.fill_tree_rows(tree, rows.tokens, rows.positions, rows.row_bits)  # the real trees over the flat ones
    logits = model.forward(rows)  # [R (n + 1), V]
    acc = tree_verify.accept_paths(logits.argmax(-1), tree)  # [R, 3 + n]
    return Launched(acc, *download(acc), logits, n)


def read(launched: Launched) -> tuple[list[tuple[VerifyResult, list[int]]], list[int], torch.Tensor]:
    """Wait for the accepts (the step's one read-back) -> each decode's (result, accepted draft tokens), each tree's deepest depth, the pass's logits."""
    if launched.done is not None:
        launched.done.synchronize()
    n = launched.n
    given, deepest = [], []
    for h in launched.host.tolist():
        b, path = h[0] & 0xFFFFFFFFFFFFFFFF, []
        while b:  # the set bits, lowest first (by depth: a parent precedes its children)
            low = b & -b
            path.append(low.bit_length() - 1)
            b ^= low
        toks = h[3:]
        accepted = [toks[j - 1] for j in path[1:]]
        given.append((VerifyResult(path, accepted + [h[1]], n), accepted))
        deepest.append(h[2])
    return given, deepest, launched.logits
