"""Turning logits into the distribution every method samples from (temperature, top-p).

Every method, `ar` included, goes through `probs_from_logits`, so "lossless" has one meaning:
the output is distributed as sampling from exactly these probabilities, token by token.
"""
from __future__ import annotations

import torch

from tandem.config import SamplingConfig


def probs_from_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] fp32 probabilities after temperature and top-p."""
    x = logits.float()
    if sampling.greedy:
        # A point mass on the argmax: greedy is the temperature -> 0 limit.
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    # the max comes off first: x / T of a tiny T (1e-38) would overflow to inf, and inf - inf is nan;
    # (x - max) / T is <= 0, so a tiny T gives the argmax's point mass, as its limit does (and a T
    # below fp32's range, 0 once in fp32, leaves the max's 0 / 0 at 0)
    d = x - x.amax(-1, keepdim=True)
    probs = torch.softmax(torch.where(d == 0, 0.0, d / sampling.temperature), dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (cum - sorted_p) >= sampling.top_p
        drop[..., 0] = False  # (a top_p below fp32's smallest number compares as 0, which would drop it)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a [vocab] distribution with a seeded CPU generator (reproducible anywhere)."""
    return int(torch.multinomial(probs.detach().float().cpu(), 1, generator=generator).item())
