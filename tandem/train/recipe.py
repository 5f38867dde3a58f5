"""The whole recipe, one command: corpus -> tokenizer -> target -> distilled draft -> export -> metrics."""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

# Every preset value can be overridden by the matching --flag; None in argparse means "preset".
PRESETS: dict[str, dict] = {
    # One H200: under 9 minutes end to end (corpus + tokenizer ~1 min, target 5, draft 2.2,
    # eval/export < 1); the target's budget shrinks if preparation runs long (deadline_minutes).
    "full": {
        "encode_max_seconds": 90.0, "kinds": "stdlib,site", "corpus_mb": 200.0, "tokenizer_mb": 20.0,
        "vocab_size": 8192, "ctx": 512, "batch_size": 128, "target_hidden": 384, "target_layers": 8,
        "target_heads": 6, "target_kv_heads": 2, "target_intermediate": 1024, "draft_hidden": 192, "draft_layers": 4,
        "draft_heads": 3, "draft_kv_heads": 1, "draft_intermediate": 640, "target_lr": 0.0015, "draft_lr": 0.003,
        "target_warmup": 150, "draft_warmup": 100, "weight_decay": 0.1, "min_lr_frac": 0.1, "target_minutes": 5.0,
        "draft_minutes": 2.2, "target_steps": None, "draft_steps": None, "draft_ce_weight": 0.1, "eval_mb": 3.0,
        "eval_batch": 32, "ast_prompts": 64, "ast_new_tokens": 64, "save_dtype": "bfloat16", "compile": "auto",
        "deadline_minutes": 8.8, "reserve_minutes": 0.6, "threads": None,
    },
    # CPU, seconds: a tiny stdlib subset, vocab 512, two small models, fixed step counts.
    "tiny": {
        "encode_max_seconds": 0.0, "kinds": "stdlib", "corpus_mb": 0.3, "tokenizer_mb": 0.2, "vocab_size": 512,
        "ctx": 64, "batch_size": 8, "target_hidden": 64, "target_layers": 2, "target_heads": 4, "target_kv_heads": 2,
        "target_intermediate": 128, "draft_hidden": 32, "draft_layers": 1, "draft_heads": 2, "draft_kv_heads": 1,
        "draft_intermediate": 64, "target_lr": 0.003, "draft_lr": 0.003, "target_warmup": 5, "draft_warmup": 5,
        "weight_decay": 0.1, "min_lr_frac": 0.1, "target_minutes": None, "draft_minutes": None, "target_steps": 30,
        "draft_steps": 20, "draft_ce_weight": 0.1, "eval_mb": 0.1, "eval_batch": 16, "ast_prompts": 4,
        "ast_new_tokens": 16, "save_dtype": "float32", "compile": "off", "deadline_minutes": None,
        "reserve_minutes": 0.0, "threads": 1,
    },
}


def _seed(text: str) -> int:
    return int(text) % 2**32  # NOTE: np.random.seed refuses anything outside [0, 2**32)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", required=True, help="output folder: target/, draft/, metrics.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default="full",
                   help="sizes and budgets (default full: one H200, about 9 minutes)")
    p.add_argument("--tiny", action="store_true", help="same as --preset tiny: CPU, seconds")
    p.add_argument("--seed", type=_seed, default=0, help="any integer (taken modulo 2**32, numpy's seed range)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (tiny preset: 1, fastest for tiny models)")
    g = p.add_argument_group("corpus (defaults from the preset)")
    g.add_argument("--kinds", help="comma list of roots to read: stdlib,site")
    g.add_argument("--corpus-mb", type=float, help="cap on training text, MB")
    g.add_argument("--tokenizer-mb", type=float, help="training text sample for the tokenizer, MB")
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--skip-tests", action="store_true", help="skip test/tests/testing folders")
    g.add_argument("--eval-mb", type=float, help="cap on held-out text used for metrics, MB")
    g.add_argument("--encode-max-seconds", type=float, help="stop pre-tokenizing after this long (0: never)")
    g = p.add_argument_group("models and training (defaults from the preset)")
    g.add_argument("--ctx", type=int)
    g.add_argument("--batch-size", type=int)
    for who in ("target", "draft"):
        for what in ("hidden", "layers", "heads", "kv-heads", "intermediate"):
            g.add_argument(f"--{who}-{what}", type=int)
        g.add_argument(f"--{who}-lr", type=float)
        g.add_argument(f"--{who}-warmup", type=int)
        g.add_argument(f"--{who}-minutes", type=float, help=f"wall-time budget of the {who} loop")
        g.add_argument(f"--{who}-steps", type=int, help="fixed step count (overrides minutes)")
    g.add_argument("--draft-ce-weight", type=float, help="weight of data CE next to KL(target||draft)")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--min-lr-frac", type=float)
    g.add_argument("--compile", choices=["auto", "on", "off"], help="torch.compile (auto: on CUDA)")
    g.add_argument("--deadline-minutes", type=float,
                   help="whole run must end by then: the target budget shrinks if preparation ran long")
    g.add_argument("--reserve-minutes", type=float, help="kept back for export and evaluation")
    g = p.add_argument_group("export and evaluation")
    g.add_argument("--save-dtype", choices=["bfloat16", "float32"])
    g.add_argument("--eval-batch", type=int)
    g.add_argument("--ast-prompts", type=int)
    g.add_argument("--ast-new-tokens", type=int)
    g.add_argument("--check-transformers", action="store_true",
                   help="after export, compare logits with transformers (needs transformers)")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    preset = "tiny" if args.tiny else args.preset
    a = argparse.Namespace(**vars(args))
    a.preset = preset
    for k, v in PRESETS[preset].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.target_steps is None and a.target_minutes is None:
        raise SystemExit("give --target-steps or --target-minutes")
    if a.draft_steps is None and a.draft_minutes is None:
        raise SystemExit("give --draft-steps or --draft-minutes")
    return a


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    a = resolve(args)
    old_threads = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    # NOTE: training and evaluation run the model's plain-torch ops (its semantics, and what
    # torch.compile fuses), not the inference-only Triton kernels.
    old_triton = os.environ.get("TANDEM_TRITON")
    os.environ["TANDEM_TRITON"] = "0"
    try:
        return _run(a)
    finally:
        torch.set_num_threads(old_threads)
        if old_triton is None:
            os.environ.pop("TANDEM_TRITON", None)
        else:
            os.environ["TANDEM_TRITON"] = old_triton


def _run(a: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from tandem.models.loader import load_model
    from tandem.models.transformer import Transformer
    from tandem.train import corpus as corpus_mod
    from tandem.train.evaluate import ast_parse_eval, score_pair
    from tandem.train.export import export_hf, parity_check
    from tandem.train.tokenizer import EOT, encode_texts, train_tokenizer
    from tandem.train.trainer import TokenStream, distill_loss_fn, init_weights, lm_loss_fn, make_config, train_loop

    t_start = time.time()
    from tandem.bench.env import ensure_out_dir

    out = ensure_out_dir(a.out)  # (a file there, or no permission: one line, before any work)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    _log(f"tandem.train preset={a.preset} device={device}{' (' + gpu + ')' if gpu else ''} torch={torch.__version__} "
         f"python={platform.python_version()} seed={a.seed}")
    timings: dict[str, float] = {}

    # 1. corpus
    t = time.time()
    kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
    corp = corpus_mod.build_corpus(int(a.corpus_mb * 1e6), kinds=kinds, skip_tests=a.skip_tests,
                                   max_heldout_bytes=int(a.eval_mb * 1e6), log=_log)
    timings["corpus_s"] = time.time() - t
    if not corp.train_texts or not corp.heldout_texts:
        _log("error: empty corpus (no training or no held-out files found)")
        return 2

    # 2. tokenizer, on a sample of training texts in stable-hash order (never held-out text)
    t = time.time()
    order = sorted(range(len(corp.train_keys)), key=lambda i: (corpus_mod.stable_hash(corp.train_keys[i]), i))
    tok = train_tokenizer([corp.train_texts[i] for i in order], a.vocab_size, int(a.tokenizer_mb * 1e6))
    eot = tok.token_to_id(EOT)
    vocab = tok.get_vocab_size()
    timings["tokenizer_s"] = time.time() - t
    _log(f"tokenizer: vocab {vocab}, {EOT} = {eot}, trained in {timings['tokenizer_s']:.1f}s")

    # 3. pre-tokenize, in the same stable-hash order: <eot> doc <eot> doc ...
    # NOTE: a time guard (--encode-max-seconds) stops early if this machine tokenizes slowly;
    # stopping in hash order is the same as a smaller --corpus-mb cap (and is logged).
    t = time.time()
    parts: list[np.ndarray] = []
    used: list[int] = []
    chunk = 512
    for c0 in range(0, len(order), chunk):
        if a.encode_max_seconds and time.time() - t > a.encode_max_seconds:
            _log(f"warning: tokenizing is slow; stopped after {len(used)} of {len(order)} files "
                 f"(--encode-max-seconds {a.encode_max_seconds})")
            break
        idx = order[c0:c0 + chunk]
        for x in encode_texts(tok, [corp.train_texts[i] for i in idx]):
            parts.append(np.asarray([eot] + x, dtype=np.int32))
        used.extend(idx)
    stream = np.concatenate(parts)
    del parts
    if len(used) < len(order):
        keep = sorted(used)
        corp.train_keys = [corp.train_keys[i] for i in keep]
        corp.train_texts = [corp.train_texts[i] for i in keep]
    train_bytes = corp.train_bytes
    timings["encode_s"] = time.time() - t
    _log(f"encoded {len(stream) / 1e6:.2f}M tokens ({train_bytes / max(1, len(stream)):.2f} bytes/token) "
         f"in {timings['encode_s']:.1f}s")
    held_ids = encode_texts(tok, corp.heldout_texts)
    held_bytes = corp.heldout_bytes
    with gzip.open(out / "corpus_manifest.txt.gz", "wt") as f:
        f.write("# train\n" + "\n".join(corp.train_keys) + "\n")
        f.write("# heldout (evaluated)\n" + "\n".join(corp.heldout_keys) + "\n")

    # 4. target
    target_cfg = make_config(vocab, a.target_hidden, a.target_layers, a.target_heads, a.target_kv_heads,
                             a.target_intermediate, a.ctx, eot)
    draft_cfg = make_config(vocab, a.draft_hidden, a.draft_layers, a.draft_heads, a.draft_kv_heads,
                            a.draft_intermediate, a.ctx, eot)
    target = Transformer(target_cfg)
    init_weights(target)
    target.to(device)
    _log(f"target: {target_cfg.num_params / 1e6:.2f}M params ({a.target_hidden}h x {a.target_layers}L, "
         f"{a.target_heads}/{a.target_kv_heads} heads, ffn {a.target_intermediate}, ctx {a.ctx}, tied)")
    _log(f"draft:  {draft_cfg.num_params / 1e6:.2f}M params ({a.draft_hidden}h x {a.draft_layers}L, "
         f"{a.draft_heads}/{a.draft_kv_heads} heads, ffn {a.draft_intermediate}, tied)")
    toks = TokenStream(stream, device, a.seed)
    target_budget = None if a.target_steps else a.target_minutes * 60
    draft_budget = None if a.draft_steps else a.draft_minutes * 60
    if target_budget is not None and a.deadline_minutes:
        left = a.deadline_minutes * 60 - (time.time() - t_start) - (draft_budget or 0) - a.reserve_minutes * 60
        if left < target_budget:
            _log(f"preparation ran long: target budget cut from {target_budget:.0f}s to {max(30.0, left):.0f}s")
            target_budget = max(30.0, left)
    res_t = train_loop("target", target, lm_loss_fn(target, device), toks, batch_size=a.batch_size, ctx=a.ctx,
                       lr=a.target_lr, warmup=a.target_warmup, min_lr_frac=a.min_lr_frac,
                       weight_decay=a.weight_decay, budget_s=target_budget, steps=a.target_steps,
                       compile_mode=a.compile, device=device, log=_log)

    # 5. draft, distilled from the target
    target.requires_grad_(False).eval()
    torch.manual_seed(a.seed + 1)
    draft = Transformer(draft_cfg)
    init_weights(draft)
    draft.to(device)
    if draft_budget is not None and a.deadline_minutes:
        left = a.deadline_minutes * 60 - (time.time() - t_start) - a.reserve_minutes * 60
        if left < draft_budget:
            _log(f"running late: draft budget cut from {draft_budget:.0f}s to {max(20.0, left):.0f}s")
            draft_budget = max(20.0, left)
    toks.gen.manual_seed(a.seed + 1)
    res_d = train_loop("draft", draft, distill_loss_fn(draft, target, device, a.draft_ce_weight), toks,
                       batch_size=a.batch_size, ctx=a.ctx, lr=a.draft_lr, warmup=a.draft_warmup,
                       min_lr_frac=a.min_lr_frac, weight_decay=a.weight_decay, budget_s=draft_budget,
                       steps=a.draft_steps, compile_mode=a.compile, device=device, log=_log)

    # 6. export, then evaluate what was exported (bf16-rounded weights if saved so)
    t = time.time()
    export_hf(target, tok, out / "target", a.save_dtype)
    export_hf(draft, tok, out / "draft", a.save_dtype)
    del target, draft, toks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _log(f"exported {out / 'target'} and {out / 'draft'} ({a.save_dtype}); evaluating on held-out source")
    quality: dict = {}
    errors: list[str] = []
    try:  # NOTE: evaluation failures are recorded, never lose the exported pair
        tgt = load_model(out / "target", device, "float32")
        drf = load_model(out / "draft", device, "float32")
        quality.update(score_pair(tgt, drf, held_ids, held_bytes, eot, a.ctx, device, a.eval_batch))
        quality.update(ast_parse_eval(tgt, tok, corp.heldout_texts, a.ast_prompts, a.ast_new_tokens, eot, a.ctx,
                                      device))
        draft_ast = ast_parse_eval(drf, tok, corp.heldout_texts, a.ast_prompts, a.ast_new_tokens, eot, a.ctx,
                                   device)
        quality["draft_ast_parse_fraction"] = draft_ast["ast_parse_fraction"]
    except Exception as e:  # noqa: BLE001
        errors.append(f"evaluation: {type(e).__name__}: {e}")
        _log(f"error: {errors[-1]}")
    timings["export_eval_s"] = time.time() - t
    if a.check_transformers:
        try:
            quality["transformers_max_abs_logit_diff"] = {
                who: parity_check(out / who) for who in ("target", "draft")}
        except Exception as e:  # noqa: BLE001
            errors.append(f"transformers parity: {type(e).__name__}: {e}")
            _log(f"error: {errors[-1]}")
    timings["total_s"] = time.time() - t_start

    metrics = {
        "quality": quality,
        "corpus": {
            "kinds": list(kinds), "candidate_files": corp.candidates,
            "train_files": len(corp.train_texts), "train_bytes": train_bytes, "train_tokens": len(stream),
            "heldout_files_evaluated": len(corp.heldout_texts), "heldout_bytes_evaluated": held_bytes,
            "heldout_percent": corpus_mod.HELDOUT_PERCENT, "skipped_unreadable": corp.skipped_unreadable,
            "skipped_duplicate": corp.skipped_duplicate,
            "size_filter_bytes": [corpus_mod.MIN_BYTES, corpus_mod.MAX_BYTES],
            "max_line_chars": corpus_mod.MAX_LINE_CHARS,
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": vocab, "eot": EOT, "eot_id": eot,
                      "trained_on_mb": a.tokenizer_mb},
        "target": {"params": target_cfg.num_params, "config": _cfg_dict(target_cfg), **dataclasses.asdict(res_t),
                   "lr": a.target_lr, "batch_size": a.batch_size},
        "draft": {"params": draft_cfg.num_params, "config": _cfg_dict(draft_cfg), **dataclasses.asdict(res_d),
                  "lr": a.draft_lr, "batch_size": a.batch_size, "ce_weight": a.draft_ce_weight,
                  "loss": "KL(target||draft), T=1"},
        "timings_s": timings,
        "run": {"argv": list(sys.argv), "command": _command_line(),
                "preset": a.preset, "seed": a.seed, "device": str(device), "gpu": gpu, "torch": torch.__version__,
                "python": platform.python_version(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                "save_dtype": a.save_dtype, "host_cpus": os.cpu_count()},
        "args": {k: v for k, v in vars(a).items()},
    }
    if errors:
        metrics["errors"] = errors
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    if errors:
        return 1
    try:
        from tandem.train.card import write_model_card

        write_model_card(out / "metrics.json", out / "MODEL_CARD.md")
    except Exception as e:  # noqa: BLE001 - the card is a convenience
        _log(f"warning: MODEL_CARD.md not written ({type(e).__name__}: {e})")
    q = quality
    _log(f"target: {q['target_bits_per_byte']:.4f} bits/byte ({q['target_loss_nats_per_token']:.3f} nats/token), "
         f"top-1 acc {q['target_top1_accuracy']:.3f}; draft: {q['draft_bits_per_byte']:.4f} bits/byte, "
         f"agreement with target {q['draft_target_top1_agreement']:.3f}; ast-parse {q['ast_parse_fraction']:.3f} "
         f"(draft {q['draft_ast_parse_fraction']:.3f}) over {q['ast_prompts']} headers")
    _log(f"done in {timings['total_s'] / 60:.2f} min -> {out}")
    return 0


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].replace("\\", "/").endswith("tandem/train/__main__.py"):
        argv[0:1] = ["python", "-m", "tandem.train"]
    return " ".join(argv)


def _cfg_dict(cfg) -> dict:
    return {k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "torch_dtype")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.train", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
