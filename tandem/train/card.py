"""MODEL_CARD.md for a trained pair, written from its metrics.json."""
from __future__ import annotations

import json
from pathlib import Path


def _arch(d: dict) -> str:
    c = d["config"]
    return (f"LlamaForCausalLM, {d['params'] / 1e6:.2f}M parameters (embeddings included, tied): hidden "
            f"{c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} query heads / "
            f"{c['num_key_value_heads']} KV heads (head_dim {c['head_dim']}), SwiGLU FFN {c['intermediate_size']}, "
            f"RMSNorm eps {c['rms_norm_eps']}, RoPE theta {c['rope_theta']:g}, context {c['max_position_embeddings']}, "
            f"vocab {c['vocab_size']}")


def model_card(m: dict, command: str | None = None) -> str:
    q, c, t, d, r, tk = m["quality"], m["corpus"], m["target"], m["draft"], m["run"], m["tokenizer"]
    tm = m["timings_s"]
    cmd = command or r.get("command", "")
    lines = [
        "# Bundled draft/target pair (`tandem/assets/pair`)",
        "",
        "A small Llama-architecture **target** and a much smaller **draft** distilled from it, trained from",
        "scratch on Python source, with a shared byte-level BPE tokenizer. Both folders are standard Hugging",
        "Face checkpoints (`config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,",
        "`generation_config.json`) that load in Tandem (`tandem.models.loader.load_model`) and in transformers",
        "(`AutoModelForCausalLM.from_pretrained`). They exist to make speculative decoding measurable",
        "end to end without downloads; they are not useful language models.",
        "",
        "## How it was produced",
        "",
        (f"- command: `{cmd}` (recipe `tandem/train`, preset `{r['preset']}`; the project CLI exposes it as "
        "`tandem train-pair`)"),
        f"- device: {r.get('gpu') or r['device']}; torch {r['torch']}, Python {r['python']}",
        f"- date (UTC): {r['date_utc']}",
        f"- seed: {r['seed']}",
        (f"- wall time: {tm['total_s'] / 60:.2f} min in the recipe (corpus {tm['corpus_s']:.0f} s, tokenizer "
        f"{tm['tokenizer_s']:.0f} s, pre-tokenizing {tm['encode_s']:.0f} s, target {t['seconds'] / 60:.2f} min, "
        f"draft {d['seconds'] / 60:.2f} min, export + evaluation {tm['export_eval_s']:.0f} s)"),
        f"- weights stored as {r['save_dtype']}",
        "",
        "## Corpus",
        "",
        "Python source of the training machine's interpreter: the standard library and site-packages",
        (f"(roots: {', '.join(c['kinds'])}). Files of {c['size_filter_bytes'][0]} B to {c['size_filter_bytes'][1]} B, "
        f"clean UTF-8, no line over {c['max_line_chars']} characters, de-duplicated by content hash; under the byte "
        "cap files are taken in a fixed pseudo-random order (sha1 of the key). Each file's key is its path"),
        "relative to its root, prefixed by the root kind (`stdlib/json/decoder.py`, `site/numpy/core/x.py`);",
        (f"files with `sha1(key) % 100 < {c['heldout_percent']}` are **held out** and train nothing (tokenizer "
        "included), and training files whose content equals a held-out file's are dropped."),
        "`tandem.train.corpus.heldout_files()` / `heldout_texts()` give the same split on any machine.",
        "",
        (f"- training: {c['train_files']} files, {c['train_bytes'] / 1e6:.1f} MB, "
         f"{c['train_tokens'] / 1e6:.2f}M tokens ({c['train_bytes'] / max(1, c['train_tokens']):.2f} bytes/token) "
         f"out of {c['candidate_files']} candidate files"),
        (f"- held-out text evaluated: {c['heldout_files_evaluated']} files, "
         f"{c['heldout_bytes_evaluated'] / 1e6:.2f} MB, {q.get('heldout_tokens', 0)} tokens"),
        (f"- tokenizer: {tk['type']}, vocab {tk['vocab_size']}, trained on a {tk['trained_on_mb']:g} MB sample of the "
        f"training files; `{tk['eot']}` (id {tk['eot_id']}) separates documents and is bos/eos/pad"),
        "",
        "## Models",
        "",
        f"- **target**: {_arch(t)}.",
        (f"  Trained by next-token cross-entropy: AdamW (betas 0.9/0.95, weight decay "
        f"{m['args'].get('weight_decay')}), "
        f"peak lr {t['lr']:g}, linear warm-up then cosine to {m['args'].get('min_lr_frac')} of peak, batch "
        f"{t['batch_size']} x {t['config']['max_position_embeddings']} tokens, {t['steps']} steps "
        f"({t['tokens'] / 1e6:.0f}M tokens, {t['step_ms']:.0f} ms/step, torch.compile {t['compiled']}), "
        "bf16 autocast."),
        f"- **draft**: {_arch(d)}.",
        (f"  Distilled from the target: {d['loss']} + {d['ce_weight']:g} x data cross-entropy, peak lr {d['lr']:g}, "
        f"batch {d['batch_size']} x {d['config']['max_position_embeddings']}, {d['steps']} steps "
        f"({d['tokens'] / 1e6:.0f}M tokens, {d['step_ms']:.0f} ms/step, torch.compile {d['compiled']})."),
        "",
        "## Quality on held-out source (from metrics.json)",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| target bits per byte of source | {q['target_bits_per_byte']:.4f} |",
        f"| target loss, nats per token | {q['target_loss_nats_per_token']:.4f} |",
        f"| target top-1 next-token accuracy | {q['target_top1_accuracy']:.4f} |",
        f"| draft bits per byte | {q['draft_bits_per_byte']:.4f} |",
        f"| draft top-1 next-token accuracy | {q['draft_top1_accuracy']:.4f} |",
        f"| **draft/target top-1 agreement** | {q['draft_target_top1_agreement']:.4f} |",
        (f"| target greedy function completions that parse (`ast`) | {q['ast_parse_fraction']:.4f} "
        f"({q['ast_prompts']} headers, {q.get('ast_new_tokens')} new tokens) |"),
        f"| draft greedy function completions that parse | {q['draft_ast_parse_fraction']:.4f} |",
        "",
        "Bits per byte = summed next-token loss in nats / ln 2 / UTF-8 bytes of the held-out files; each",
        f"file is `{tk['eot']}` + its tokens, scored in non-overlapping windows of the context length.",
        "Agreement = fraction of the same positions where the draft's argmax equals the target's.",
        "Function completions: headers (`def ...:`) of top-level functions of held-out files, completed",
        "greedily (full forward per token), trimmed to the last complete line, then `ast.parse`d.",
        "",
        "## Speculative decoding (tau)",
        "",
        "to be measured with `tandem bench`",
        "",
    ]
    return "\n".join(lines)


def write_model_card(metrics_path: str | Path, out_path: str | Path, command: str | None = None) -> Path:
    m = json.loads(Path(metrics_path).read_text())
    p = Path(out_path)
    p.write_text(model_card(m, command))
    return p
