"""A certified INT8 LM head (SpecPilot s4.1): the exact greedy argmax from fewer bytes.

The head W [V, H] gets an INT8 copy with one scale per row, q(w_v) = s_v * round(w_v / s_v). For a
hidden state h the cheap logit a_v = h . q(w_v) differs from the real h . w_v by at most
||h|| * ||w_v - q(w_v)|| (Cauchy-Schwarz). With the rounding of both computations added to that
bound, every token whose upper bound lies below the best lower bound provably cannot be the
argmax of the exact logits, and is pruned. The survivors (a handful for a confident model) are
rescored exactly, in the model dtype, from the original rows, and their argmax is returned.

The bounds, per row v (u = 2^-24 is fp32's unit roundoff, gamma_n = n u / (1 - n u)):
  quantization   ||h|| r_v,                     r_v = ||w_v - q(w_v)||
  cheap logit    gamma_{H+1} ||h|| s_v ||q_v||   (fp32 dot product in any order, then the scale)
  exact logit    gamma_H ||h|| ||w_v|| + u_dt (|a_v| + the terms above)
                 (an fp32-accumulated dot product in any order, then rounding to the model dtype:
                 u_dt = 2^-8 for bf16, 2^-11 for fp16, 0 for fp32)
so the certificate covers the exact logits however the GEMM orders its fp32 sum. It assumes fp32
accumulation: on CUDA set torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction =
False (and allow_fp16_...) where this head is used.

Where it applies: greedy decoding and greedy verification (argmax only), for the target's and the
drafters' heads. Where it does not: sampling (temperature > 0) needs the full exact distribution,
so the full head runs there; a drafter that samples its proposals needs its full distribution too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels import certified_head as ck

U32 = 2.0**-24
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SAFETY = 1 + 2.0**-30  # covers the float64 rounding of the bound arithmetic itself


def _gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


@dataclass(frozen=True)
class CertifiedArgmax:
    token: torch.Tensor  # [B] int64: the exact argmax
    survivors: torch.Tensor  # [B, V] bool: tokens that could not be pruned (rescored exactly)
    logits: torch.Tensor  # [B, V] model dtype: the exact logits of the survivors, -inf elsewhere

    @property
    def rescored_fraction(self) -> float:
        """Mean fraction of the vocabulary rescored exactly per hidden state."""
        return self.survivors.float().mean().item()


class Int8Head:
    """An INT8 copy of an LM head weight [V, H] with per-row scales and error bounds."""

    def __init__(self, weight: torch.Tensor):
        # weight: [V, H] in the model dtype; kept (not copied) for the exact rescoring
        if weight.dim() != 2 or weight.dtype not in ROUNDING:
            raise ValueError(f"an LM head weight is [vocab, hidden] fp32/bf16/fp16, got {tuple(weight.shape)} {weight.dtype}")
        self.weight = weight
        v, hidden = weight.shape
        self.q = torch.empty(v, hidden, dtype=torch.int8, device=weight.device)  # [V, H]
        self.scale = torch.empty(v, dtype=torch.float32, device=weight.device)  # [V]
        self.coef = torch.empty(v, dtype=torch.float64, device=weight.device)  # [V]: bound per unit ||h||
        self.gpu_coef = torch.empty(v, dtype=torch.float32, device=weight.device)  # [V]: the kernels' (widened)
        for lo in range(0, v, 8192):  # (in chunks: float64 copies of a 128k-token head take GBs)
            w64 = weight[lo:lo + 8192].double()  # [c, H], exact
            amax = w64.abs().amax(dim=1)  # [c]
            scale = (amax / 127).float()  # fp32 per-row scales; 0 for an all-zero row
            safe = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
            q = torch.round(w64 / safe[:, None]).clamp(-127, 127).to(torch.int8)  # [c, H]
            dq = q.double() * scale.double()[:, None]  # [c, H] q(w), exact in float64
            resid = (w64 - dq).norm(dim=1)  # [c] ||w - q(w)||
            cheap = dq.norm(dim=1) * _gamma(hidden + 1)  # [c]
            exact = w64.norm(dim=1) * _gamma(hidden)  # [c]
            self.q[lo:lo + 8192], self.scale[lo:lo + 8192] = q, scale
            self.coef[lo:lo + 8192] = (resid + cheap + exact) * SAFETY
            self.gpu_coef[lo:lo + 8192] = ck.gpu_coef(resid, cheap, exact)
        self.u_dt = ROUNDING[weight.dtype]

    @torch.no_grad()
    def token(self, h: torch.Tensor) -> torch.Tensor:
        """The exact argmax token [B] for hidden rows h [B, H]: the Triton kernels on CUDA
        (tandem.kernels.certified_head: no host sync, fixed shapes), the reference elsewhere."""
        return self.token_and_logit(h)[0]

    @torch.no_grad()
    def token_and_logit(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [B] int64, its exact logit [B] in the model dtype)."""
        if h.is_cuda and ck.triton is not None:
            tok, val, _ = ck.certified_argmax_triton(h.to(self.weight.dtype), self.q, self.scale, self.gpu_coef,
                                                     self.weight, self.u_dt)
            return tok, val.to(self.weight.dtype)
        r = self.argmax(h)
        return r.token, r.logits.gather(1, r.token[:, None]).squeeze(1)

    @torch.no_grad()
    def approx_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Cheap logits h . q(w_v) in fp32. h: [B, H] -> [B, V]. (Reference: dequantizes in fp32; a GPU
        kernel would read the int8 rows directly.)"""
        return (h.float() @ self.q.float().T) * self.scale  # [B, V]

    @torch.no_grad()
    def bounds(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lower, upper) [B, V] float64 enclosing every exact logit the model dtype's head can give."""
        a = self.approx_logits(h).double()  # [B, V]
        hn = h.double().norm(dim=-1, keepdim=True)  # [B, 1]
        slack = hn * self.coef  # [B, V]
        slack = (slack + self.u_dt * (a.abs() + slack)) * SAFETY
        return a - slack, a + slack

    @torch.no_grad()
    def argmax(self, h: torch.Tensor) -> CertifiedArgmax:
        """The exact argmax of F.linear(h, weight) (first index on ties), rescoring only survivors.
        h: [B, H] in the model dtype."""
        lower, upper = self.bounds(h)  # [B, V] each
        best_lower = lower.max(dim=-1, keepdim=True).values  # [B, 1]
        survivors = upper >= best_lower  # [B, V]; the argmax's upper bound is >= every lower bound
        survivors |= ~survivors.any(dim=-1, keepdim=True)  # a non-finite h: no certificate, rescore its row fully
        cols = survivors.any(dim=0).nonzero().squeeze(1)  # [U] union over the batch, ascending
        exact = F.linear(h.to(self.weight.dtype), self.weight[cols])  # [B, U]
        logits = torch.full(survivors.shape, float("-inf"), dtype=exact.dtype, device=exact.device)
        logits[:, cols] = exact
        logits = logits.masked_fill(~survivors, float("-inf"))  # [B, V]
        return CertifiedArgmax(logits.argmax(dim=-1), survivors, logits)


def certified_argmax(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The exact greedy token after each hidden state, through the model's certified INT8 head.
    hidden: [T, H] (the final-norm output) -> [T] int64, equal to model.lm_head(hidden).argmax(-1).
    The Int8Head is built once per model and head weight (kept on the model as `int8_head`)."""
    weight = model.lm_head.weight
    head = getattr(model, "int8_head", None)
    if head is None or head.weight is not weight:
        head = Int8Head(weight)
        model.int8_head = head
    return head.token(hidden.reshape(-1, hidden.shape[-1])).reshape(hidden.shape[:-1])


class CertifiedHead(torch.nn.Module):
    """An LM head for greedy decoding only: the logits of the tokens the INT8 certificate could not
    prune, exact (the same values the full head gives them), and -inf for every other token, so
    argmax is the full head's argmax and only the survivors' rows of W are read exactly.

    NOTE: never for sampling, a temperature or top-p: the pruned tokens' probabilities are gone."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("the certified head covers bias-free LM heads only")
        self.weight = linear.weight  # the same Parameter (tied embeddings stay tied)
        self.int8 = Int8Head(linear.weight.detach())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., V]
        flat = hidden.reshape(-1, hidden.shape[-1])  # [B, H]
        if flat.is_cuda:  # (the kernels: the argmax's exact logit, -inf elsewhere; no host sync)
            tok, val = self.int8.token_and_logit(flat)
            logits = torch.full((flat.shape[0], self.weight.shape[0]), float("-inf"), dtype=val.dtype,
                                device=flat.device)  # [B, V]
            logits.scatter_(1, tok[:, None], val[:, None])
            return logits.reshape(*hidden.shape[:-1], -1)
        return self.int8.argmax(flat).logits.reshape(*hidden.shape[:-1], -1)


def use_certified_head(model: torch.nn.Module) -> torch.nn.Module:
    """Opt-in model transform for greedy decoding and greedy verification: replace `model.lm_head`
    by a CertifiedHead, in place (idempotent), and return the model. Anything that takes the
    argmax of the model's logits (`ar`, `tree`, `chain`, TLV's exact pass) then reads the INT8 head
    and rescores only survivors, and its tokens are unchanged. Not for sampling (see CertifiedHead)."""
    if not isinstance(model.lm_head, CertifiedHead):
        model.lm_head = CertifiedHead(model.lm_head)
    return model
