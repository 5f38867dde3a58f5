"""`--certified-head` for the serial loop: greedy verification reads the certified INT8 LM head.

While a request decodes, the target's `lm_head` is a CertifiedHead (tandem.quant.int8_head): the
exact logits of the tokens the INT8 certificate could not prune, -inf elsewhere, so every argmax
the loop takes (ar, chain, tree verification) is the full head's argmax, and the output is
unchanged. The full head is put back after the request, so the same model serves requests
without the flag (and other Generators) untouched.

On CUDA the head is Triton kernels with fixed shapes and no host sync
(tandem.kernels.certified_head), so the target's runner captures it in its CUDA graphs (a runner
of its own, so graphs captured with the full head are never replayed for it). On the CPU the
reference prunes with data-dependent shapes (a nonzero over the survivors) and the runner runs
eagerly.
"""
from __future__ import annotations

import contextlib

import torch

from tandem.config import ConfigError, SamplingConfig
from tandem.quant.int8_head import CertifiedHead

CERTIFIED_METHODS = ("auto", "ar", "chain", "tree")


def check_certified(method: str, sampling: SamplingConfig, hybrid: bool) -> None:
    """The one-line refusals: where the certified head cannot give the same output."""
    if not sampling.greedy:
        raise ConfigError("--certified-head is for greedy decoding (--temperature 0): sampling needs the full "
                          "head's exact distribution")
    if method not in CERTIFIED_METHODS:
        raise ConfigError(f"--certified-head works with --method ar, chain, tree or auto, not {method!r}")
    if hybrid:
        raise ConfigError("--certified-head covers Llama-family targets, not hybrid (Qwen3.5) ones")


class Fp32ReductionHead(CertifiedHead):
    """The certified head with fp32 accumulation forced for its own products on CUDA: its certificate
    assumes it (tandem.quant.int8_head), and cuBLAS may reduce bf16/fp16 GEMMs in lower precision
    otherwise. Only the head's calls are affected; the rest of the model runs as without the flag."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.device.type != "cuda":
            return super().forward(hidden)
        m = torch.backends.cuda.matmul
        saved = m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction
        m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = False
        try:
            return super().forward(hidden)
        finally:
            m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


@contextlib.contextmanager
def certified_lm_head(model: torch.nn.Module):
    """Swap `model.lm_head` for its CertifiedHead (built once per head weight, kept on the model)
    for the duration of the block; re-entrant (an inner use leaves the outer swap alone)."""
    full = model.lm_head
    if isinstance(full, CertifiedHead):
        yield model
        return
    head = getattr(model, "certified_head_cache", None)
    if head is None or head.weight is not full.weight:
        head = Fp32ReductionHead(full)
        # NOTE: object.__setattr__ keeps the cache out of the module tree (state_dict, .to())
        object.__setattr__(model, "certified_head_cache", head)
    model.lm_head = head
    try:
        yield model
    finally:
        model.lm_head = full
