"""Byte-level BPE tokenizer for Python source, trained with `tokenizers`, saved for transformers too."""
from __future__ import annotations

import json
from pathlib import Path

EOT = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int, max_bytes: int | None = None):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts` (the first `max_bytes` of them).

    `<|endoftext|>` is id 0: the document separator in training, and the bos/eos token.
    No post-processor: encoding adds no special tokens, so `encode(text)` round-trips exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if max_bytes is not None:
        sample, total = [], 0
        for t in texts:
            if sample and total >= max_bytes:
                break
            sample.append(t)
            total += len(t.encode("utf-8"))
        texts = sample
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json, loadable by AutoTokenizer."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    eot_id = tok.token_to_id(EOT)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "pad_token": EOT,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {
            str(eot_id): {"content": EOT, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
        },
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (d / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}, indent=2) + "\n")


def encode_texts(tok, texts: list[str], batch: int = 2048) -> list[list[int]]:
    """Token ids of each text (parallel inside `tokenizers`), no special tokens added."""
    enc = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # _fast skips offsets
    out: list[list[int]] = []
    for i in range(0, len(texts), batch):
        out.extend(e.ids for e in enc(texts[i:i + batch], add_special_tokens=False))
    return out
