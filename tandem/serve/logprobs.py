"""LogprobEngine: the batched engine, also recording the target's log-probabilities of each new token.

Every committed token has a target distribution in the verify pass that committed it, whatever
the method: with `path` the accepted nodes (root first) of a tree whose rows produced `logits`,
new token j (the accepted draft tokens, then the bonus) was drawn against row `path[j]`. So
logprobs come for ar, chain and tree alike, from the target's raw distribution (log-softmax of
its logits, before temperature and top_p: vLLM's default "raw" logprobs), never the draft's.

NOTE: the engine hooks used are overriding `Engine._accept` (either of its signatures, the
result passed through unchanged) and `Engine._reads_accepts`: a step where no request asked for
logprobs verifies its greedy trees on the device as a plain engine's does (tandem.engine.
device_verify), without the per-request `_accept`; nothing in tandem/engine/ changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.tree.draft_tree import DraftTree
from tandem.verify.verifier import VerifyResult


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k most likely tokens and their logprobs, best first


class LogprobEngine(Engine):
    def __init__(self, *args, **kwargs):
        # (before the engine starts: its warm-up request's steps already ask _reads_accepts)
        self.logprob_topk: dict[str, int] = {}  # request id -> alternatives wanted (0: the token's own only)
        self.logprobs: dict[str, list[TokenLogprob]] = {}  # request id -> per committed token (may run past a cut)
        super().__init__(*args, **kwargs)

    def want_logprobs(self, request_id: str, top: int) -> None:
        self.logprob_topk[request_id] = top
        self.logprobs[request_id] = []

    def forget(self, request_id: str) -> None:
        self.logprob_topk.pop(request_id, None)
        self.logprobs.pop(request_id, None)

    def _reads_accepts(self, requests) -> bool:
        wanted = self.logprob_topk
        return bool(wanted) and any(r.request_id in wanted for r in requests)

    def _accept(self, req: Request, tree: DraftTree, logits: torch.Tensor, *rest) -> VerifyResult:
        """rest: (argmax) with logits [the tree's rows, vocab], or (lo, argmax) with logits of the
        whole pass, the tree's rows from lo (Engine._accept's newer signature)."""
        result = super()._accept(req, tree, logits, *rest)
        k = self.logprob_topk.get(req.request_id)
        if k is not None:
            if len(rest) == 2:
                logits = logits[rest[0]:rest[0] + len(tree.tokens)]  # [the tree's rows, vocab]
            lp = torch.log_softmax(logits[result.path].float(), dim=-1)  # [len(path), vocab]
            tokens = torch.tensor(result.tokens, device=lp.device)  # [len(path)]
            own = lp.gather(1, tokens[:, None])[:, 0].tolist()
            if k > 0:
                vals, idx = lp.topk(k, dim=-1)  # [len(path), k]
                tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
            else:
                tops = [()] * len(own)
            self.logprobs[req.request_id] += [TokenLogprob(t, o, top) for t, o, top in zip(result.tokens, own, tops)]
        return result
