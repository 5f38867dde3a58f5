"""Drafting with a parallel block drafter: one drafter pass per target pass.

Per target pass the drafter runs once (tandem.models.block_drafter): the pending context rows
(the tokens committed since its last pass, each with the target features of the position
before it; the root last) and B - 1 mask rows after the root, causal, in one step of its own
runner (a CUDA graph per row bucket on the GPU). The context rows join its KV prefix; the
mask rows are dropped. The B distributions give the lattice, and the best-first tree over it
(`tree`) or its greedy path (`chain`) goes to the target (tandem.drafting.lattice).

After the target's pass, `observe` queues the committed tokens (accepted, then the bonus) with
the target's features of the path that produced them (root, accepted): row i of the drafter
pairs token t_i with the features of position i - 1.
"""
from __future__ import annotations

import functools

import torch

from tandem.config import SpecConfig
from tandem.drafting.lattice import best_chain, best_first_tree, unpack_lattice
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree
from tandem.verify.verifier import VerifyResult


# Context rows fed with the block in one step; longer backlogs (a long prompt) are fed first in
# chunks of this many rows, so a step never exceeds the drafter's feature buffer (and stays in
# the runner's graph buckets).
CONTEXT_CHUNK = 64


@functools.lru_cache(maxsize=256)
def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()  # [n, n], read only


class LatticeDrafter:
    needs_features = True

    def __init__(self, runner: ModelRunner, spec: SpecConfig, chain: bool = False):
        self.runner = runner
        self.model = runner.model.drafter  # the BlockDrafter behind its LatticeHead
        cfg = self.model.bconfig
        self.feature_layers = self.model.target_feature_layers
        self.block, self.k = cfg.block_size, cfg.num_candidates
        self.chain = chain
        self.nodes = spec.k if chain else spec.nodes
        self.pending: list[int] = []
        self.pending_feats: torch.Tensor | None = None  # [len(pending), F]
        self.steps = 0  # drafter passes
        self.last_lattice = None  # the last pass's Lattice (tests, bench)

    def start(self, prompt: list[int], features: torch.Tensor | None = None) -> None:
        """prompt: every prompt token; features: [len(prompt) - 1, F] the target's features of
        all but the last (the root, whose features come with the first target pass)."""
        F = self.model.bconfig.feature_size
        dev, dt = self.model.device, self.model.dtype
        feats = torch.zeros(len(prompt), F, device=dev, dtype=dt)  # row 0 has no position before it
        if features is not None and len(prompt) > 1:
            feats[1:] = features[-(len(prompt) - 1):].to(dt)
        self.runner.cache.truncate(0)
        self.pending, self.pending_feats = list(prompt), feats

    def _feed(self, tokens: list[int], feats: torch.Tensor, masks: int) -> torch.Tensor:
        """One drafter step: context rows (tokens with their features), then `masks` mask rows,
        causal; the context rows join the prefix. Returns the rows' lattice entries [T, X]."""
        cache = self.runner.cache
        P, T, prefix = len(tokens), len(tokens) + masks, cache.prefix_len
        self.model.feature_in[0, :P].copy_(feats)  # the static buffer the graphs read (mask rows ignore it)
        rows = self.runner.step(tokens + [self.model.mask_id] * masks, list(range(prefix, prefix + T)), _causal(T))
        self.steps += 1
        cache.commit(list(range(P)))  # the mask rows are dropped
        return rows

    def propose(self) -> DraftTree:
        while len(self.pending) > CONTEXT_CHUNK:  # a long backlog: context-only chunks first
            self._feed(self.pending[:CONTEXT_CHUNK], self.pending_feats[:CONTEXT_CHUNK], 0)
            self.pending, self.pending_feats = self.pending[CONTEXT_CHUNK:], self.pending_feats[CONTEXT_CHUNK:]
        P = len(self.pending)
        # near the end of the context window fewer mask rows fit (drafts past it are useless)
        masks = max(0, min(self.block - 1, self.runner.capacity - self.runner.cache.prefix_len - P))
        rows = self._feed(self.pending, self.pending_feats, masks)
        lat = unpack_lattice(rows[P - 1:P + masks], self.k)  # the root's row, then the mask rows
        self.last_lattice = lat
        root = self.pending[-1]
        self.pending = []
        if self.chain:
            return best_chain(lat, root, self.nodes)
        return best_first_tree(lat, root, self.nodes)

    def observe(self, result: VerifyResult, tree: DraftTree, features: torch.Tensor | None = None) -> None:
        """features: [accepted + 1, F] the target's features of the root and the accepted nodes."""
        if features is None:
            raise RuntimeError("a block drafter needs the target's features; enable them on the target")
        self.pending = list(result.tokens)
        self.pending_feats = features.to(self.model.dtype)
