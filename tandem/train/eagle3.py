"""Distilling an EAGLE-3 head for a trained target: `tandem train-drafters --kind eagle3`.

The target is frozen; each batch's target features and next-token distributions are computed on
the fly. The head (tandem.models.eagle3, draft vocabulary = the target's, d2t zeros) minimises
KL(target || head) at every position, with EAGLE-3's **training-time test**: the head is
unrolled for K steps so it learns to read its own hidden states, as it does at decoding time.

Step 0 is the context pass: row i is token t_i with fc(features of position i - 1), causal.
Step k >= 1 plays the depth-k tree node whose root is at i - k: row i is token t_i with the
head's output hidden of step k - 1 at row i - 1 (its parent), at position i, and attends to what
that node sees when decoding: the context rows <= i - k, its ancestors (step j's row
i - (k - j), 1 <= j < k) and itself. Every step predicts the target's distribution at position i;
rows i < k have no root and are left out of the loss. The K/V of earlier steps are kept (with
their gradients) so each step runs its L rows once, against a bool mask over all rows so far.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.kernels.fused import rope_ref

# step k's loss weight (EAGLE-3 weighs deeper steps less)
STEP_DECAY = 0.8


class UnrollKV:
    """A differentiable stand-in for the KV cache over the unrolled steps: `store` ropes the new
    rows' q (in place) and k and returns the K/V of every step so far (Attention's cache path)."""

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def store(self, layer, qkv, positions, inv_freq, n_q, slots, width):
        # qkv: [B, T, n_q + 2 n_kv, D]
        n_kv = (qkv.shape[2] - n_q) // 2
        # NOTE: the plain-torch RoPE, whatever TANDEM_TRITON says: the kernel has no backward
        qkv[:, :, :n_q + n_kv] = rope_ref(qkv[:, :, :n_q + n_kv], positions, inv_freq)
        self.k.append(qkv[:, :, n_q:n_q + n_kv].transpose(1, 2))  # [B, n_kv, T, D]
        self.v.append(qkv[:, :, n_q + n_kv:].transpose(1, 2))
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)


def unroll_mask(L: int, k: int, device) -> torch.Tensor:
    """[L, (k + 1) * L] bool: what row i of step k attends to among the rows of steps 0 .. k."""
    i = torch.arange(L, device=device)[:, None]
    c = torch.arange(L, device=device)[None, :]
    parts = [c <= i - k] + [c == i - (k - j) for j in range(1, k + 1)]
    return torch.cat(parts, dim=1)


def unrolled(head, x: torch.Tensor, hidden: torch.Tensor, steps: int, device: torch.device) -> list[torch.Tensor]:
    """x: [b, L] tokens; hidden: [b, L, H] step 0's hidden inputs (fc of the previous position's
    features) -> each step's logits [b, L, draft_vocab] (see the module docstring)."""
    from tandem.train.trainer import autocast_ctx

    b, L = x.shape
    positions = torch.arange(L, device=device)[None].expand(b, L)
    kv = UnrollKV()
    out_logits = []
    for k in range(steps):
        with autocast_ctx(device):
            logits, out = head.layer(x, hidden, positions, kv, None, unroll_mask(L, k, device)[None, None])
        out_logits.append(logits)
        # the next step's row i reads this step's output at row i - 1 (its parent)
        hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
    return out_logits


def eagle3_loss_fn(head, target, ttt_steps: int, device: torch.device):
    """(x [b, L], y [b, L]) -> (loss, aux = step 0's top-1 agreement with the target)."""
    from tandem.train.trainer import autocast_ctx

    def fn(x, y):
        with torch.no_grad(), autocast_ctx(device):
            t_logits = target(x)  # [b, L, V]
            feats = target.last_features  # [b, L, F]
        t_logp = F.log_softmax(t_logits.float(), -1)
        t_p = t_logp.exp()
        f_prev = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)  # features of position i - 1
        with autocast_ctx(device):
            hidden = head.project(f_prev.float())  # [b, L, H]
        total, weights = 0.0, 0.0
        for k, logits in enumerate(unrolled(head, x, hidden, ttt_steps, device)):
            d_logp = F.log_softmax(logits.float(), -1)
            kl = (t_p * (t_logp - d_logp)).sum(-1)  # [b, L]
            total = total + STEP_DECAY ** k * kl[:, k:].mean()  # rows i < k have no root
            weights += STEP_DECAY ** k
            if k == 0:
                agree = (t_logp.argmax(-1) == d_logp.argmax(-1)).float().mean()
        return total / weights, agree.detach()

    return fn


def new_head(target, a):
    """A head of the target's width and heads, its LM head and final norm copied from the target."""
    from tandem.config import ModelConfig
    from tandem.models.eagle3 import Eagle3Config, Eagle3Head

    tc = target.config
    llama = ModelConfig(family="llama", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                        intermediate_size=int(a.eagle_intermediate), num_hidden_layers=1,
                        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                        head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                        rope_scaling=tc.rope_scaling, max_position_embeddings=tc.max_position_embeddings)
    cfg = Eagle3Config(llama=llama, draft_vocab_size=tc.vocab_size, target_hidden_size=tc.hidden_size,
                       feature_layers=target.enable_features())
    head = Eagle3Head(cfg, target.model.embed_tokens)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.ndim >= 2:
                std = 0.02 / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)
        head.lm_head.weight.copy_(target.lm_head.weight)
        head.norm.weight.copy_(target.model.norm.weight)
    return head


def train_eagle3(target, stream, a, device: torch.device, out_dir, log) -> dict:
    """Train a head for `target` on `stream` (a TokenStream) with the preset's eagle_* keys; save
    it to out_dir in the public EAGLE-3 layout; return its metrics."""
    from tandem.models.eagle3 import save_eagle3
    from tandem.train.trainer import train_loop

    head = new_head(target, a).to(device)
    ctx = min(int(a.ctx), target.config.max_position_embeddings)
    steps = int(a.eagle_steps) if a.eagle_steps else None
    ttt = int(a.ttt_steps)
    res = train_loop("eagle3", head, eagle3_loss_fn(head, target, ttt, device), stream,
                     batch_size=int(a.batch_size), ctx=ctx, lr=float(a.lr), warmup=int(a.warmup), min_lr_frac=0.1,
                     weight_decay=0.0, budget_s=None if steps else float(a.eagle_minutes) * 60, steps=steps,
                     compile_mode="off", device=device, log=log)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    save_eagle3(head, out_dir, dtype=dtype)
    log(f"EAGLE-3 head -> {out_dir}")
    return {"steps": res.steps, "seconds": round(res.seconds, 1), "final_loss": res.final_loss, "ttt_steps": ttt,
            "tokens": res.tokens, "config": head.econfig.to_hf(str(dtype).removeprefix("torch."))}
