"""Method `chain` with sampling: k draft tokens in a row from a small model, verified as a
one-path tree. (A greedy chain is the best-first tree of width 1 and runs on
tandem.drafting.tree_drafter.)

Each token is drawn from the draft's processed distribution q (temperature / top-p applied as
for the target), and q is kept with the tree: recursive rejection sampling needs it to stay
lossless (tandem.verify.verifier).

The draft's KV cache holds [verified prefix | the root, then the fed chain tokens]. The k-th
token is never fed (nothing drafts after it). Verified tokens the draft has not fed yet (the
last accepted token when it was the k-th, and the bonus) wait in `pending` and are fed, as a
causal block, at the start of the next proposal.
"""
from __future__ import annotations

import torch

from tandem.config import SamplingConfig
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree
from tandem.verify.sampling import probs_from_logits
from tandem.verify.verifier import VerifyResult


class ChainDrafter:
    def __init__(self, runner: ModelRunner, sampling: SamplingConfig, k: int, generator: torch.Generator | None = None):
        self.runner, self.sampling, self.k, self.generator = runner, sampling, k, generator
        self.pending: list[int] = []
        self.steps = 0  # draft forward passes

    def start(self, prompt: list[int]) -> None:
        self.pending = list(prompt)

    def propose(self) -> DraftTree:
        """The root (pending[-1]) and k draft tokens; node j of the chain is tree row j."""
        cache = self.runner.cache
        prefix = cache.prefix_len
        T = len(self.pending)
        logits = self._step(self.pending, list(range(prefix, prefix + T)), torch.ones(T, T, dtype=torch.bool).tril())
        cache.commit(list(range(T - 1)), keep=[T - 1])  # every pending token but the root joins the prefix
        prefix = cache.prefix_len  # the root is tree row 0, at position prefix
        tokens, qs = [self.pending[-1]], []
        last = logits[-1]  # [vocab] the draft's next-token logits after the newest fed token
        for j in range(1, self.k + 1):
            token, q = self._pick(last)
            tokens.append(token)
            qs.append(q)
            if j < self.k:  # feed it: it sees the root and the chain before it (rows 0 .. j)
                last = self._step([token], [prefix + j], torch.ones(1, j + 1, dtype=torch.bool))[0]
        q = torch.stack([torch.zeros_like(qs[0])] + qs)  # [k + 1, vocab]: row i is what node i was drawn from
        return DraftTree.chain(tokens, q=q)

    def observe(self, result: VerifyResult, tree: DraftTree) -> None:
        """Move the accepted path's draft K/V into the prefix; queue what the draft never fed."""
        fed = [i for i in result.path if i < self.k]  # chain nodes 0 .. k-1 were fed, node k was not
        self.runner.cache.commit(fed)
        self.pending = [tree.tokens[i] for i in result.path if i >= self.k] + [result.bonus]

    def _step(self, tokens: list[int], positions: list[int], mask: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.runner.step(tokens, positions, mask)  # [T, vocab]

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        # logits: [vocab]
        probs = probs_from_logits(logits[None], self.sampling)[0]  # [vocab]
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator)), probs
