"""Training loops: the target by next-token cross-entropy, the draft by distillation from it.

Both loops train by wall time with a fixed schedule: after the warm-up (which also absorbs the
torch.compile warm-up) they measure their step time once and fix the total step count that fits
the time budget; the cosine schedule then runs over exactly those steps. `steps=` fixes the count
instead (tiny mode, tests), which makes a CPU run reproducible step for step.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.config import ModelConfig
from tandem.models.transformer import Transformer


def make_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                ctx: int, eot_id: int, torch_dtype: str = "float32") -> ModelConfig:
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
    return ModelConfig(
        family="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=ctx,
        tie_word_embeddings=True, bos_token_id=eot_id, eos_token_ids=(eot_id,), torch_dtype=torch_dtype,
    )


def init_weights(model: Transformer, std: float = 0.02) -> None:
    """GPT-2 style: N(0, 0.02) everywhere, residual output projections scaled by 1/sqrt(2L)."""
    L = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if p.ndim < 2:
            continue  # RMSNorm weights stay at 1
        s = std / math.sqrt(2 * L) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
        torch.nn.init.normal_(p, 0.0, s)


def autocast_ctx(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class TokenStream:
    """All training tokens, on the device; random (seeded) windows of ctx + 1 tokens."""

    def __init__(self, tokens: np.ndarray, device: torch.device, seed: int):
        self.data = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.device = device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)

    def __len__(self) -> int:
        return int(self.data.numel())

    def batch(self, batch_size: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        hi = len(self) - ctx - 1
        if hi <= 0:
            raise ValueError(f"corpus has {len(self)} tokens, fewer than one window of {ctx + 1}")
        off = torch.randint(0, hi, (batch_size,), generator=self.gen, device=self.device)
        w = self.data[off[:, None] + torch.arange(ctx + 1, device=self.device)[None, :]]
        return w[:, :-1], w[:, 1:]


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device):
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)


def lr_at(step: int, peak: float, warmup: int, total: int | None, min_frac: float) -> float:
    if total is not None:
        warmup = min(warmup, max(1, total // 5))
    if step < warmup:
        return peak * (step + 1) / warmup
    if total is None:
        return peak
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class LoopResult:
    steps: int
    planned_steps: int
    seconds: float
    tokens: int
    final_loss: float
    compiled: bool
    step_ms: float


def maybe_compile(fn, mode: str, device: torch.device, log):
    """torch.compile(fn) when asked (auto: on CUDA only); the caller falls back on failure."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return fn, False
    try:
        return torch.compile(fn), True
    except Exception as e:  # noqa: BLE001 - any failure means: run eagerly
        log(f"torch.compile unavailable ({type(e).__name__}: {e}); running eagerly")
        return fn, False


def train_loop(name: str, model: torch.nn.Module, loss_fn, stream: TokenStream, *, batch_size: int, ctx: int,
               lr: float, warmup: int, min_lr_frac: float, weight_decay: float, budget_s: float | None,
               steps: int | None, compile_mode: str, device: torch.device, log=print,
               grad_clip: float = 1.0) -> LoopResult:
    """Minimise `loss_fn(x, y) -> (loss, aux)` over `model`'s parameters.

    Either `steps` (fixed) or `budget_s` (wall seconds for the whole loop, compile included).
    """
    from tqdm import tqdm

    if steps is None and budget_s is None:
        raise ValueError("give steps or a time budget")
    opt = make_optimizer(model, lr, weight_decay, device)
    params = [p for p in model.parameters() if p.requires_grad]
    eager_fn = loss_fn
    fn, compiled = maybe_compile(loss_fn, compile_mode, device, log)
    model.train()
    t0 = time.time()
    total = steps
    mark_step, mark_t = None, None
    step = 0
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)
    n_sum = 0
    last_loss = float("nan")
    pbar = tqdm(total=total, desc=name, file=sys.stderr, mininterval=5.0, dynamic_ncols=False, ncols=100)
    while True:
        now = time.time()
        if total is None:
            # plan once: timing starts after 3 steps (compile warm-up); plan after the LR warm-up
            # with >= 10 timed steps, or once timing has run for 10% of the budget
            if mark_step is None and step >= 3:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                mark_step, mark_t = step, time.time()
            elif mark_step is not None and step > mark_step and (
                (step - mark_step >= 10 and step >= warmup) or now - mark_t >= 0.1 * budget_s
            ):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.time()
                per_step = (now - mark_t) / (step - mark_step)
                total = max(step + 1, step + int((budget_s - (now - t0)) / per_step))
                pbar.total = total
                pbar.refresh()
                log(f"{name}: {per_step * 1e3:.1f} ms/step measured; planned {total} steps for a "
                    f"{budget_s / 60:.2f} min budget")
        if total is not None and step >= total:
            break
        if budget_s is not None and now - t0 > budget_s * 1.03 + 5:
            log(f"{name}: stopping at step {step}, over its time budget")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, warmup, total, min_lr_frac)
        x, y = stream.batch(batch_size, ctx)
        try:
            loss, aux = fn(x, y)
            loss.backward()
        except Exception as e:
            if not compiled or step > 0:
                raise
            log(f"{name}: compiled step failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "falling back to eager")
            opt.zero_grad(set_to_none=True)
            fn, compiled = eager_fn, False
            loss, aux = fn(x, y)
            loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach().float()
        aux_sum += aux.detach().float()
        n_sum += 1
        step += 1
        pbar.update(1)
        if step % 50 == 0 or step == 1 or (total is not None and step == total):
            last_loss = (loss_sum / n_sum).item()
            pbar.set_postfix(loss=f"{last_loss:.3f}", aux=f"{(aux_sum / n_sum).item():.3f}",
                             lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)
            if step % 500 == 0 or step == 1:
                log(f"{name}: step {step}/{total or '?'} loss {last_loss:.4f} aux {(aux_sum / n_sum).item():.4f} "
                    f"lr {opt.param_groups[0]['lr']:.2e} t {time.time() - t0:.0f}s")
            loss_sum.zero_()
            aux_sum.zero_()
            n_sum = 0
    if n_sum:
        last_loss = (loss_sum / n_sum).item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    pbar.close()
    secs = time.time() - t0
    model.eval()
    log(f"{name}: {step} steps in {secs:.1f}s, final loss {last_loss:.4f}, compiled={compiled}")
    return LoopResult(steps=step, planned_steps=total or step, seconds=secs, tokens=step * batch_size * ctx,
                      final_loss=last_loss, compiled=compiled, step_ms=1e3 * secs / max(1, step))


def lm_loss_fn(model: Transformer, device: torch.device):
    def fn(x, y):
        with autocast_ctx(device):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        return loss, loss.detach()

    return fn


def distill_loss_fn(draft: Transformer, target: Transformer, device: torch.device, ce_weight: float):
    """KL(target || draft) at temperature 1 (+ ce_weight * CE on the data); aux = top-1 agreement."""

    def fn(x, y):
        with autocast_ctx(device):
            # NOTE: no torch.no_grad() here: the target's parameters do not require grad, so no
            # graph is recorded anyway, and grad mode keeps the model on its plain-torch ops
            # (the inference-only Triton kernels are skipped), which torch.compile can fuse.
            t_logits = target(x).detach()
            d_logits = draft(x)
        V = d_logits.shape[-1]
        t_logp = F.log_softmax(t_logits.float().reshape(-1, V), dim=-1)
        d_logp = F.log_softmax(d_logits.float().reshape(-1, V), dim=-1)
        kl = (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()
        loss = kl
        if ce_weight:
            loss = loss + ce_weight * F.nll_loss(d_logp, y.reshape(-1))
        agree = (t_logp.argmax(-1) == d_logp.argmax(-1)).float().mean()
        return loss, agree.detach()

    return fn
