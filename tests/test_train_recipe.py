"""The training recipe (tandem.train): tiny end-to-end run, export parity, tokenizer, held-out split."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from tandem.train import add_arguments, run
from tandem.train import corpus as C

SOURCE = '''\
import os, sys  # comment with unicode: déjà vu — λ
\tTAB = "\\t"


class Foo(Bar, metaclass=Meta):
    """Docstring with 'quotes' and trailing spaces   """

    def method(self, x: int = 0x1F, *args, **kw) -> dict[str, int]:
        if x >= 10 and not args:
            return {f"k{i}": i ** 2 for i in range(x)}
        raise ValueError(r"bad \\d+ value %r" % (x,))
'''


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--tiny", "--out", str(out), "--device", "cpu"])
    assert run(args) == 0
    return out


def test_tiny_recipe_writes_metrics_and_checkpoints(tiny_run):
    m = json.loads((tiny_run / "metrics.json").read_text())
    q = m["quality"]
    for key in ("target_bits_per_byte", "draft_target_top1_agreement", "ast_parse_fraction"):
        assert key in q
    assert 0 < q["target_bits_per_byte"] < 8
    assert 0 <= q["draft_target_top1_agreement"] <= 1
    assert m["corpus"]["train_files"] > 0 and m["corpus"]["train_tokens"] > 0
    for who in ("target", "draft"):
        d = tiny_run / who
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json"):
            assert (d / f).is_file(), f"{who}/{f} missing"
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert m["draft"]["params"] < m["target"]["params"]


@pytest.mark.parametrize("who", ["target", "draft"])
def test_export_loads_in_tandem_and_transformers_with_matching_logits(tiny_run, who):
    transformers = pytest.importorskip("transformers")
    from tandem.models.loader import load_model

    path = tiny_run / who
    ours = load_model(path, "cpu", "float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # tied embeddings survive the round trip in transformers
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(ids)
        b = theirs(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_source_in_tokenizers_and_transformers(tiny_run):
    transformers = pytest.importorskip("transformers")
    from tandem.models.loader import load_tokenizer

    path = tiny_run / "target"
    fast = load_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    texts = [SOURCE] + C.heldout_texts(limit=3, kinds=("stdlib",))
    for text in texts:
        ids = fast.encode(text, add_special_tokens=False).ids
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf(text)["input_ids"] == ids  # no bos/eos added by default
        assert fast.decode(ids, skip_special_tokens=False) == text
        assert hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
        assert hf.decode(ids) == text
    eot = fast.token_to_id("<|endoftext|>")
    assert hf.eos_token_id == eot and hf.bos_token_id == eot


def test_heldout_split_is_a_pure_function_of_the_key():
    # fixed values: sha1(key) % 100 < 2, identical on every machine
    assert [k for k in (f"stdlib/m{i}.py" for i in range(300)) if C.is_heldout(k)] == [
        "stdlib/m36.py", "stdlib/m175.py", "stdlib/m200.py"]
    assert not C.is_heldout("stdlib/json/decoder.py")


def test_heldout_split_is_stable_and_disjoint_from_training():
    first = C.heldout_files(kinds=("stdlib",))
    assert first, "the stdlib should have held-out files"
    assert C.heldout_files(kinds=("stdlib",)) == first
    assert C.heldout_files(limit=2, kinds=("stdlib",)) == first[:2]
    keys = C.heldout_keys(kinds=("stdlib",))
    assert all(C.is_heldout(k) and k.startswith("stdlib/") for k in keys)
    corp = C.build_corpus(400_000, kinds=("stdlib",), log=lambda *_: None)
    assert corp.train_keys and corp.heldout_keys == keys
    assert not set(corp.train_keys) & set(keys)
    assert not any(C.is_heldout(k) for k in corp.train_keys)
    held_hashes = {C.content_hash(t) for t in corp.heldout_texts}
    assert not held_hashes & {C.content_hash(t) for t in corp.train_texts}
    # texts and files agree, in order
    assert C.heldout_texts(limit=3, kinds=("stdlib",)) == [C.read_source(p) for p in first[:3]]


def test_padded_greedy_generation_matches_one_by_one():
    from tandem.models.transformer import Transformer
    from tandem.train.evaluate import greedy_generate
    from tandem.train.trainer import init_weights, make_config

    torch.manual_seed(0)
    model = Transformer(make_config(64, 32, 2, 4, 2, 64, 64, 0))
    init_weights(model, std=0.2)
    model.eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    batched = greedy_generate(model, prompts, 8, 0, torch.device("cpu"))
    single = [greedy_generate(model, [p], 8, 0, torch.device("cpu"))[0] for p in prompts]
    assert batched == single


def test_bundled_pair_loads_in_tandem_and_transformers():
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    from tandem.models.loader import load_model, load_tokenizer

    root = Path(__file__).resolve().parents[1] / "tandem" / "assets" / "pair"
    assert (root / "target" / "model.safetensors").is_file(), "the bundled pair is missing from this checkout"
    ids = torch.randint(0, 8192, (1, 48), generator=torch.Generator().manual_seed(1))
    sizes = {}
    for who in ("target", "draft"):
        ours = load_model(root / who, "cpu", "float32")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(root / who), dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-4, rtol=1e-4)
        sizes[who] = sum(p.numel() for p in ours.parameters())
        assert load_tokenizer(root / who).get_vocab_size() == ours.config.vocab_size
    assert (root / "target" / "tokenizer.json").read_bytes() == (root / "draft" / "tokenizer.json").read_bytes()
    assert 10e6 <= sizes["target"] <= 20e6 and 1e6 <= sizes["draft"] <= 4e6
