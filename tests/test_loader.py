"""Checkpoint loading: sharded checkpoints, every bad input -> a one-line ConfigError, and the
`ModelConfig.to_hf()` / `from_hf()` round trip (also through transformers' AutoConfig)."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_FAMILIES
from tandem.config import ConfigError, ModelConfig
from tandem.models.loader import load_model, load_tokenizer, read_config

SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def _ids(vocab: int = 320) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(7))


def _hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


# ---------------------------------------------------------------------------- sharded checkpoints
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied embeddings; q/k/v biases
def test_sharded_checkpoint_loads_and_matches(tiny_checkpoint, shared_tiny_checkpoint, family):
    sharded = tiny_checkpoint(family, save_kwargs={"max_shard_size": "20KB"})
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2 and all(SHARD_RE.fullmatch(s) for s in shards), shards
    assert {SHARD_RE.fullmatch(s).group(2) for s in shards} == {f"{len(shards):05d}"}
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()

    ours = load_model(sharded)
    single = load_model(shared_tiny_checkpoint(family))  # same seed, one file
    sd_a, sd_b = ours.state_dict(), single.state_dict()
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    ids = _ids()
    with torch.no_grad():
        out = ours(ids)
    assert (out - _hf_logits(sharded, ids)).abs().max() < 1e-4

    # without the index the shards are still found by name
    (sharded / "model.safetensors.index.json").unlink()
    again = load_model(sharded)
    assert all(torch.equal(again.state_dict()[k], sd_a[k]) for k in sd_a)


def test_index_naming_a_missing_shard(tiny_checkpoint):
    d = tiny_checkpoint("mistral", save_kwargs={"max_shard_size": "20KB"})
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ConfigError) as e:
        load_model(d)
    _assert_one_line(e.value, victim.name)


# ---------------------------------------------------------------------------- bad inputs
def _assert_one_line(err: BaseException, *fragments: str) -> None:
    msg = str(err)
    assert isinstance(err, ConfigError)
    assert msg and "\n" not in msg and "\r" not in msg, msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


_DELETE = object()


def _edit_weights(d: Path, fn) -> None:
    f = d / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def _bad_missing_tensor(d):
    _edit_weights(d, lambda s: s.pop("model.layers.1.mlp.down_proj.weight"))


def _bad_shape(d):
    def f(s):
        s["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    _edit_weights(d, f)


def _bad_extra_tensor(d):
    def f(s):
        s["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    _edit_weights(d, f)


def _bad_truncated(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])


BAD_CHECKPOINTS = {
    # name: (family, mutate(dir), load kwargs, distinctive message fragments)
    "no_config": ("llama", lambda d: (d / "config.json").unlink(), {}, ["no config.json"]),
    "config_not_json": ("llama", lambda d: (d / "config.json").write_text('{"vocab_size": 320,'), {},
                        ["config.json is not valid JSON"]),
    "config_not_object": ("llama", lambda d: (d / "config.json").write_text("[1, 2]"), {}, ["must hold a JSON object"]),
    "gpt2": ("llama", lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2"), {},
             ["unsupported architecture", "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3_5ForCausalLM"]),
    "no_architecture": ("llama", lambda d: _edit_config(d, architectures=_DELETE, model_type=_DELETE), {},
                        ["config.json names no architecture (`architectures`, `model_type`)"]),
    "missing_key": ("qwen2", lambda d: _edit_config(d, hidden_size=_DELETE), {}, ["missing the key 'hidden_size'"]),
    "null_value": ("qwen2", lambda d: _edit_config(d, num_attention_heads=None), {}, ["wrong type"]),
    "non_numeric_value": ("qwen2", lambda d: _edit_config(d, intermediate_size="big"), {}, ["wrong type"]),
    "no_weights": ("mistral", lambda d: (d / "model.safetensors").unlink(), {}, ["has no model.safetensors"]),
    "missing_tensor": ("mistral", _bad_missing_tensor, {}, ["lacks 1 tensor", "model.layers.1.mlp.down_proj.weight"]),
    "shape_mismatch": ("mistral", _bad_shape, {}, ["model.layers.0.self_attn.k_proj.weight", "(48, 64)", "(32, 64)"]),
    "unexpected_tensor": ("mistral", _bad_extra_tensor, {}, ["model.layers.0.self_attn.o_proj.bias", "does not describe"]),
    "truncated_weights": ("mistral", _bad_truncated, {}, ["damaged"]),
    "unknown_dtype": ("llama", lambda d: None, {"dtype": "float8"}, ["unknown dtype 'float8'", "bfloat16"]),
    # transformers 5 spelling (rope_parameters) and 4.x spelling (rope_scaling with "type")
    "rope_yarn": ("llama", lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                      "rope_theta": 1e4}), {},
                  ["unsupported rope_scaling type 'yarn'", "llama3"]),
    "rope_yarn_legacy": ("llama", lambda d: _edit_config(d, rope_parameters=_DELETE, rope_theta=1e4,
                                                          rope_scaling={"type": "yarn", "factor": 4.0}), {},
                         ["unsupported rope_scaling type 'yarn'"]),
    "rope_llama3_no_factor": ("llama", lambda d: _edit_config(d, rope_parameters={"rope_type": "llama3",
                                                                                  "rope_theta": 1e4}), {},
                              ["lacks its 'factor'"]),
    # variants transformers builds with extra biases that our layers lack: refuse, never drop them
    "llama_attention_bias": ("llama_untied", lambda d: _edit_config(d, attention_bias=True), {}, ["attention_bias"]),
    "qwen3_attention_bias": ("qwen3", lambda d: _edit_config(d, attention_bias=True), {}, ["attention_bias"]),
    "llama_mlp_bias": ("llama_untied", lambda d: _edit_config(d, mlp_bias=True), {}, ["mlp_bias"]),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_gives_one_line_config_error(tiny_checkpoint, case):
    family, mutate, kwargs, fragments = BAD_CHECKPOINTS[case]
    d = tiny_checkpoint(family, tokenizer=False)
    load_model(d)  # sanity: loads before the damage
    mutate(d)
    with pytest.raises(ConfigError) as e:
        load_model(d, **kwargs)
    _assert_one_line(e.value, *fragments)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_model(tmp_path / "nope")
    _assert_one_line(e.value, "does not exist", "nope")
    with pytest.raises(ConfigError):
        read_config(tmp_path / "nope")


def test_directory_without_config_is_a_config_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        load_model(tmp_path)
    _assert_one_line(e.value, "no config.json")


def test_tokenizer_present_and_missing(tiny_checkpoint):
    d = tiny_checkpoint("qwen3")
    tok = load_tokenizer(d)
    assert tok.decode(tok.encode("tandem héllo").ids) == "tandem héllo"
    (d / "tokenizer.json").unlink()
    with pytest.raises(ConfigError) as e:
        load_tokenizer(d)
    _assert_one_line(e.value, "no tokenizer.json")
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(d)
    _assert_one_line(e.value, "cannot read")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_error_is_not_reported_as_damaged_file(shared_tiny_checkpoint):
    with pytest.raises(Exception) as e:
        load_model(shared_tiny_checkpoint("llama"), device="cuda")
    assert "damaged" not in str(e.value)


def test_qwen2_biases_load_even_if_config_says_attention_bias_false(tiny_checkpoint):
    """transformers ignores `attention_bias` for Qwen2 (always biased q/k/v); so must we."""
    d = tiny_checkpoint("qwen2", tokenizer=False)
    _edit_config(d, attention_bias=False)
    ours = load_model(d)
    assert ours.config.attention_bias and ours.model.layers[0].self_attn.v_proj.bias is not None
    ids = _ids()
    with torch.no_grad():
        assert (ours(ids) - _hf_logits(d, ids)).abs().max() < 1e-4


def test_legacy_rope_scaling_spelling_equals_rope_parameters(tiny_checkpoint):
    """4.x configs (rope_theta + rope_scaling with "type") read the same as 5.x rope_parameters."""
    d = tiny_checkpoint("llama", tokenizer=False)
    new = read_config(d)
    params = json.loads((d / "config.json").read_text())["rope_parameters"]
    legacy = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")} | {"type": "llama3"}
    _edit_config(d, rope_parameters=_DELETE, rope_theta=params["rope_theta"], rope_scaling=legacy)
    assert read_config(d) == new
    assert dict(new.rope_scaling)["original_max_position_embeddings"] == 16


@pytest.mark.parametrize("family,edit", [
    # llama3 rope without original_max_position_embeddings: transformers 5 takes the model's window
    # (a fixed 8192 gave other frequencies: tokens parted from transformers' at the 15th)
    ("llama", lambda d, c: _edit_config(d, rope_parameters={k: v for k, v in c["rope_parameters"].items()
                                                               if k != "original_max_position_embeddings"})),
    # a Qwen3 config without head_dim: transformers' Qwen3 default is 128, not hidden / heads
    ("qwen3", lambda d, c: _edit_config(d, head_dim=_DELETE)),
])
def test_configs_missing_a_key_read_as_transformers_reads_them(tiny_checkpoint, family, edit):
    overrides = {"head_dim": 128} if family == "qwen3" else {}
    d = tiny_checkpoint(family, tokenizer=False, **overrides)
    edit(d, json.loads((d / "config.json").read_text()))
    ours, ids = load_model(d), _ids()
    if family == "llama":
        assert dict(ours.config.rope_scaling)["original_max_position_embeddings"] == ours.config.max_position_embeddings
    else:
        assert ours.config.head_dim == 128
    with torch.no_grad():
        assert (ours(ids) - _hf_logits(d, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_an_mlp_activation_other_than_silu_is_refused(tiny_checkpoint, act):
    """Every family here gates its MLP with SiLU; another hidden_act ran as SiLU, silently wrong."""
    d = tiny_checkpoint("llama", tokenizer=False)
    _edit_config(d, hidden_act=act)
    with pytest.raises(ConfigError, match=f"hidden_act '{act}' is not supported"):
        load_model(d)
    _edit_config(d, hidden_act="swish")  # (transformers' other name for SiLU)
    load_model(d)


# ---------------------------------------------------------------------------- to_hf round trip
HANDMADE = ModelConfig(
    family="llama", vocab_size=100, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=6, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=5e5,
    rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                  ("original_max_position_embeddings", 64), ("rope_type", "llama3")),
    max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(3, 7),
    torch_dtype="bfloat16",
)


def _configs():
    return [pytest.param(f, id=f) for f in TINY_FAMILIES] + [
        pytest.param(HANDMADE, id="handmade-llama3"),
        pytest.param(dataclasses.replace(HANDMADE, family="qwen3", rope_scaling=None, head_dim=16, qk_norm=True,
                                         bos_token_id=1, eos_token_ids=(2,)), id="handmade-qwen3"),
    ]


@pytest.mark.parametrize("which", _configs())
def test_to_hf_round_trip_and_autoconfig(shared_tiny_checkpoint, tmp_path, which):
    from transformers import AutoConfig

    cfg = read_config(shared_tiny_checkpoint(which, tokenizer=False)) if isinstance(which, str) else which
    hf = cfg.to_hf()
    json.dumps(hf)  # serialisable as config.json
    assert ModelConfig.from_hf(hf) == cfg

    (tmp_path / "config.json").write_text(json.dumps(hf))
    auto = AutoConfig.from_pretrained(tmp_path)
    assert type(auto).__name__ == hf["architectures"][0].replace("ForCausalLM", "Config")
    assert auto.head_dim == cfg.head_dim and auto.num_key_value_heads == cfg.num_key_value_heads
    assert auto.tie_word_embeddings == cfg.tie_word_embeddings
    rope = auto.rope_parameters
    assert rope["rope_theta"] == cfg.rope_theta
    assert rope["rope_type"] == ("default" if cfg.rope_scaling is None else "llama3")
    # what transformers made of it reads back as the same ModelConfig
    assert ModelConfig.from_hf(auto.to_dict()) == cfg


def test_sliding_window_layers_are_read_as_transformers_reads_them(tiny_checkpoint):
    d = tiny_checkpoint("mistral", tokenizer=False)
    _edit_config(d, max_position_embeddings=32768, sliding_window=4096)  # Mistral-7B-v0.1
    cfg = read_config(d)
    assert (cfg.max_position_embeddings, cfg.sliding_window, cfg.sliding_layers) == (32768, 4096, (0, 1))
    _edit_config(d, sliding_window=_DELETE)  # transformers' default window applies
    assert read_config(d).sliding_window == 4096
    _edit_config(d, sliding_window=None)  # v0.2+: full attention
    assert (read_config(d).sliding_window, read_config(d).sliding_layers) == (None, ())
    assert ModelConfig.from_hf(read_config(d).to_hf()) == read_config(d)
    q = tiny_checkpoint("qwen2", tokenizer=False)
    _edit_config(q, use_sliding_window=False, sliding_window=4096, max_window_layers=0)
    assert read_config(q).sliding_layers == ()  # off unless use_sliding_window
    _edit_config(q, use_sliding_window=True, layer_types=_DELETE)  # from max_window_layers on
    assert read_config(q).sliding_layers == (0, 1)
    _edit_config(q, layer_types=["full_attention", "sliding_attention"])
    cfg = read_config(q)
    assert cfg.sliding_layers == (1,) and ModelConfig.from_hf(cfg.to_hf()) == cfg
    _edit_config(q, sliding_window=0)
    with pytest.raises(ConfigError, match="sliding_window must be >= 1"):
        read_config(q)
