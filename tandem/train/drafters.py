"""Training feature drafters for a trained target: `tandem train-drafters --kind block`.

The target is frozen; its features and next-token distributions are computed on the fly for
every batch (no extra pass, no stored activations) and each drafter is distilled from them:
KL(target || drafter) at temperature 1 at every position it predicts.

Block drafter: a batch row is a window of L tokens. Its L context rows are the drafter's input
for the committed tokens (token t_i with the target's features of position i - 1); A anchors
a per step each add B - 1 mask rows at positions a + 1 .. a + B - 1. One attention mask runs
all of it at once: context rows are causal, and the block of anchor a sees the context up to a
and its own earlier rows, exactly what the drafter sees at decoding time when a is the root.
The context row a predicts position a + 1, and mask row a + j predicts a + j + 1: the B
lattice positions. The Markov head's bigram term is added with the true previous token.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

PRESETS = {
    # one GPU: corpus + encoding about 20 s, training 4 minutes (compile included)
    # (the bundled block drafter: these defaults; the bundled EAGLE-3 head: --corpus-mb 60 --eagle-minutes 3.5)
    "full": {"corpus_mb": 200.0, "ctx": 512, "batch_size": 32, "anchors": 16, "minutes": 4.0, "steps": None,
             "lr": 1e-3, "warmup": 100, "layers": 2, "intermediate": 1024, "block_size": 16, "candidates": 16,
             "markov_rank": 64, "position_decay": 7.0, "kinds": "stdlib,site", "compile": "auto",
             "eagle_minutes": 4.0, "eagle_steps": None, "ttt_steps": 4, "eagle_intermediate": 1024},
    # CPU, seconds
    "tiny": {"corpus_mb": 0.3, "ctx": 64, "batch_size": 4, "anchors": 4, "minutes": None, "steps": 12,
             "lr": 3e-3, "warmup": 2, "layers": 1, "intermediate": 64, "block_size": 6, "candidates": 4,
             "markov_rank": 8, "position_decay": 0.0, "kinds": "stdlib", "compile": "off",
             "eagle_minutes": None, "eagle_steps": 12, "ttt_steps": 3, "eagle_intermediate": 64},
}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--target", default=None, help="trained target checkpoint (default: the bundled target)")
    p.add_argument("--out", required=True, help="output folder: block/ (and eagle3/) inside it")
    p.add_argument("--kind", default="block", choices=["block", "eagle3", "all"], help="which drafter(s) to train")
    p.add_argument("--preset", default="full", choices=sorted(PRESETS))
    p.add_argument("--tiny", action="store_true", help="same as --preset tiny: CPU, seconds")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    choices = {"compile": ("auto", "on", "off")}  # (auto: torch.compile on CUDA)
    for k, v in PRESETS["full"].items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v) if v is not None else float, default=None,
                       choices=choices.get(k), help=f"default from the preset (full: {v})")
    return p


def block_logits(drafter, x: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's logits for every training row at once.

    x: [b, L] tokens; feats: [b, L, F] the target's features; anchors: [A] sorted root positions
    (< L - B + 1). Rows: the L context rows, then per anchor a the B - 1 mask rows at positions
    a + 1 .. a + B - 1. Returns [b, L + A * (B - 1), vocab] (Markov term not added). Row p
    (context) predicts position p + 1; mask row (a, j) predicts a + j + 1."""
    from tandem.train.trainer import autocast_ctx

    device = x.device
    B = drafter.bconfig.block_size
    b, L = x.shape
    A = anchors.numel()
    f_prev = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1).float()  # features of i - 1
    j = torch.arange(1, B, device=device)  # [B - 1]
    pos_blk = (anchors[:, None] + j[None, :]).reshape(-1)  # [A * (B - 1)]
    S = L + pos_blk.numel()
    ids = torch.cat([x, torch.full((b, pos_blk.numel()), drafter.mask_id, device=device)], dim=1)  # [b, S]
    fin = torch.cat([f_prev, torch.zeros(b, pos_blk.numel(), f_prev.shape[-1], device=device)], dim=1)
    positions = torch.cat([torch.arange(L, device=device), pos_blk])[None].expand(b, S)
    # mask [S, S]: context causal; block rows see context <= their anchor and their block's rows up to them
    mask = torch.zeros(S, S, dtype=torch.bool, device=device)
    mask[:L, :L] = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    anchor_of = anchors.repeat_interleave(B - 1)  # [A * (B - 1)]
    mask[L:, :L] = torch.arange(L, device=device)[None, :] <= anchor_of[:, None]
    blk = torch.arange(A, device=device).repeat_interleave(B - 1)
    jj = j.repeat(A)
    mask[L:, L:] = (blk[:, None] == blk[None, :]) & (jj[None, :] <= jj[:, None])
    with autocast_ctx(device):
        h = drafter.hidden(drafter.embed(ids, fin), positions, mask=mask[None, None])
        return drafter.shared["lm_head"](h).float()  # [b, S, V]


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """The loss weight of a block's mask rows, by lattice position 2 .. B: exp(-(j - 1) / decay) for
    the row j positions after the root, normalised to mean 1; decay 0: all 1 (the recipe before 2026-12-07; the bundled drafter since: 7).

    A tree accepts position j only when every position before it was accepted, so the early
    positions carry most of the tokens a pass commits; DFlash weights its block loss this way
    (a decay of ~7 for blocks of 16). [B - 1]"""
    j = torch.arange(1, block_size, dtype=torch.float32)
    if decay <= 0:
        return torch.ones_like(j)
    w = torch.exp(-(j - 1) / decay)
    return w / w.mean()


def block_loss_fn(drafter, target, anchors: int, device: torch.device, position_decay: float = 0.0):
    """(x [b, L], y [b, L]) -> (loss, aux = top-1 agreement with the target at lattice position 1).
    position_decay: the mask rows' loss weights (position_weights)."""
    from tandem.train.trainer import autocast_ctx

    B = drafter.bconfig.block_size
    weights = position_weights(B, position_decay).to(device)  # [B - 1]

    def fn(x, y):
        b, L = x.shape
        with torch.no_grad(), autocast_ctx(device):
            t_logits = target(x)  # [b, L, V]
            feats = target.last_features  # [b, L, F]
        # anchors (shared by the batch): the root positions; their blocks end inside the window
        a = torch.randperm(L - B, device=device)[:anchors].sort().values  # [A]
        pos_blk = (a[:, None] + torch.arange(1, B, device=device)[None, :]).reshape(-1)
        d_logits = block_logits(drafter, x, feats, a)  # [b, S, V]
        prev = torch.cat([x, x[:, pos_blk]], dim=1)  # the token at each row's position: the Markov parent
        if drafter.markov_u is not None:
            d_logits = d_logits + drafter.markov_full(prev)
        # the target's distribution for each row's prediction: position p predicts p + 1
        t_rows = torch.cat([t_logits, t_logits[:, pos_blk]], dim=1).float()  # [b, S, V]
        t_logp = F.log_softmax(t_rows, -1)
        d_logp = F.log_softmax(d_logits, -1)
        kl = (t_logp.exp() * (t_logp - d_logp)).sum(-1)  # [b, S]
        # (mask rows come anchor by anchor, B - 1 each: each row's weight by its position in its block)
        loss = kl[:, :L].mean() + (kl[:, L:] * weights.repeat(a.numel())).mean()
        agree = (t_logp[:, :L].argmax(-1) == d_logp[:, :L].argmax(-1)).float().mean()
        return loss, agree.detach()

    return fn


def new_block_drafter(target, a) -> "torch.nn.Module":
    from tandem.models.block_drafter import BlockDrafter, BlockDrafterConfig

    tc = target.config
    cfg = BlockDrafterConfig(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
        target_feature_layers=target.enable_features(), block_size=a.block_size, num_candidates=a.candidates,
        markov_rank=a.markov_rank, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
        max_position_embeddings=tc.max_position_embeddings)
    m = BlockDrafter(cfg, target.model.embed_tokens, target.lm_head)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim >= 2 or name == "mask_embedding":
                std = 0.02 / math.sqrt(2 * a.layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)
    return m


def _tokens(a, tokenizer, log):
    """Training tokens: the recipe's corpus (held-out files excluded), encoded with the target's tokenizer."""
    import numpy as np

    from tandem.train import corpus as corpus_mod
    from tandem.train.tokenizer import EOT, encode_texts

    kinds = tuple(k for k in a.kinds.split(",") if k)
    corp = corpus_mod.build_corpus(int(a.corpus_mb * 1e6), kinds=kinds, max_heldout_bytes=0, log=log)
    eot = tokenizer.token_to_id(EOT)
    parts = [np.asarray([eot] + ids, dtype=np.int32) for ids in encode_texts(tokenizer, corp.train_texts)]
    return np.concatenate(parts), len(corp.train_texts)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from tandem.models.block_drafter import save_block_drafter
    from tandem.models.loader import load_model, load_tokenizer
    from tandem.runtime.pair import BUNDLED_TARGET
    from tandem.train.trainer import TokenStream, train_loop

    import os

    # NOTE: training runs the models' plain-torch ops (their semantics), not the inference kernels
    os.environ["TANDEM_TRITON"] = "0"
    preset = "tiny" if args.tiny else args.preset
    a = argparse.Namespace(**vars(args))
    for k, v in PRESETS[preset].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if not a.position_decay >= 0:
        from tandem.config import ConfigError

        raise ConfigError(f"--position-decay must be >= 0 (0: every block position weighs alike; got {a.position_decay})")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    from tandem.bench.env import ensure_out_dir

    out = ensure_out_dir(a.out)  # (a file there, or no permission: one line, before any work)
    tdir = Path(a.target) if a.target else BUNDLED_TARGET

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    t0 = time.time()
    target = load_model(tdir, device, "float32")
    tok = load_tokenizer(tdir)
    stream_np, n_files = _tokens(a, tok, log)
    log(f"corpus: {n_files} files, {len(stream_np) / 1e6:.2f}M tokens in {time.time() - t0:.0f}s")
    stream = TokenStream(stream_np, device, a.seed)
    ctx = min(a.ctx, target.config.max_position_embeddings)
    metrics = {}
    if a.kind in ("block", "all"):
        drafter = new_block_drafter(target, a).to(device)
        res = train_loop("block", drafter, block_loss_fn(drafter, target, a.anchors, device, a.position_decay), stream,
                         batch_size=a.batch_size, ctx=ctx, lr=a.lr, warmup=a.warmup, min_lr_frac=0.1,
                         weight_decay=0.0, budget_s=None if a.steps else a.minutes * 60, steps=a.steps,
                         compile_mode=a.compile, device=device, log=log)
        save_block_drafter(drafter, out / "block", dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        metrics["block"] = {"steps": res.steps, "seconds": round(res.seconds, 1), "final_loss": res.final_loss,
                            "config": drafter.bconfig.to_hf(), "tokens": res.tokens, "position_decay": a.position_decay,
                            "compiled": res.compiled, "step_ms": round(res.step_ms, 2)}
        log(f"block drafter -> {out / 'block'}")
    if a.kind in ("eagle3", "all"):
        try:
            from tandem.train.eagle3 import train_eagle3
        except ImportError:
            log("error: this build has no EAGLE-3 training")
            return 2
        metrics["eagle3"] = train_eagle3(target, stream, a, device, out / "eagle3", log)
    metrics["run"] = {"preset": preset, "device": str(device), "target": str(tdir), "torch": torch.__version__,
                      "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "corpus_files": n_files,
                      "corpus_tokens": int(len(stream_np))}
    (out / "drafters_metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    log(f"done in {(time.time() - t0) / 60:.2f} min")
    return 0
