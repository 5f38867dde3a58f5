"""EAGLE-3 heads: one Llama decoder layer that drafts from the target's own features.

The layout is the public one that vLLM (`Eagle3LlamaForCausalLM`) and SGLang
(`LlamaForCausalLMEagle3`) load for Llama-3.1-8B-Instruct heads:

    config.json        architectures [LlamaForCausalLMEagle3 | Eagle3LlamaForCausalLM], a Llama
                       config of the head (num_hidden_layers 1), vocab_size (the target's),
                       draft_vocab_size, optional target_hidden_size, and the target layers whose
                       inputs form the features in eagle_aux_hidden_state_layer_ids (top level or
                       in eagle_config; absent: (2, L // 2, L - 3) of the target)
    weights            model.safetensors or pytorch_model.bin:
      fc.weight                          [H, 3 * H_target]   target features -> hidden
      midlayer.input_layernorm.weight    [H]                 applied to the token embedding
      midlayer.hidden_norm.weight        [H]                 applied to the hidden input
      midlayer.self_attn.{q,k,v}_proj    [heads * D, 2H]     read cat(embedding, hidden)
      midlayer.self_attn.o_proj          [H, heads * D]
      midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
      norm.weight [H], lm_head.weight [draft_vocab, H]
      d2t [draft_vocab] int64            target id = draft id + d2t[draft id]
      t2d [vocab] bool                   (unused: which target ids the draft vocab holds)
      embed_tokens.weight [vocab, H]     optional; absent: the target's embeddings are shared

A row of the head is a token and a hidden state h (H wide):

    x   = cat(input_layernorm(embed(token)), hidden_norm(h))      [2H]
    r   = h + o_proj(attn(x))                                     the residual stream starts at h
    out = r + mlp(post_attention_layernorm(r))                    the pre-norm output hidden
    logits = lm_head(norm(out))                                   over the draft vocabulary

For a committed token t_i, h = fc(target features of position i - 1); for a drafted token one
level deeper in the tree, h = `out` of its parent's row (the head's own hidden state).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.config import ConfigError, ModelConfig
from tandem.models.files import check_names, check_shapes
from tandem.kernels import fused_layer
from tandem.kernels.attention import cached_attention
from tandem.kernels.fused import add_rmsnorm, embed_norms
from tandem.kernels import head_level
from tandem.kernels.resident import topk_logprobs
from tandem.models.layers import MLP, Attention, RMSNorm, fuse_decoder_layers, fused_layer_applies, rope_inv_freq

# the architecture names of the public checkpoints (SGLang / EAGLE repo, vLLM)
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    llama: ModelConfig  # the head's layer (num_hidden_layers 1; vocab_size is the target's)
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...] | None  # None: the target's default (2, L // 2, L - 3)
    norm_before_residual: bool = False  # vLLM's option: the residual starts at hidden_norm(h)

    @property
    def hidden_size(self) -> int:
        return self.llama.hidden_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Eagle3Config":
        try:
            layers = int(hf.get("num_hidden_layers", 1))
            if layers != 1:
                raise ConfigError(f"EAGLE-3 head with {layers} layers; Tandem loads one-layer heads")
            llama = ModelConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
            eagle = hf.get("eagle_config") or {}
            ids = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
            if eagle.get("use_aux_hidden_state") is False:
                raise ConfigError("EAGLE head without aux hidden states (use_aux_hidden_state false) is not EAGLE-3")
            draft_vocab = int(hf.get("draft_vocab_size") or llama.vocab_size)
            return cls(llama=llama, draft_vocab_size=draft_vocab,
                       target_hidden_size=int(hf.get("target_hidden_size") or llama.hidden_size),
                       feature_layers=None if not ids else tuple(int(i) for i in ids),
                       norm_before_residual=bool(hf.get("norm_before_residual", False)))
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"EAGLE-3 config.json has a bad value ({str(e).splitlines()[0]})") from None

    def to_hf(self, dtype: str) -> dict[str, Any]:
        d = self.llama.to_hf()
        d.update(architectures=[ARCHITECTURES[0]], model_type="llama", num_hidden_layers=1,
                 draft_vocab_size=self.draft_vocab_size, target_hidden_size=self.target_hidden_size,
                 tie_word_embeddings=False, torch_dtype=dtype)
        if self.feature_layers is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers),
                                 "use_aux_hidden_state": True}
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        return d


class Eagle3Layer(nn.Module):
    """The head's decoder layer (`midlayer` in the checkpoint): q/k/v read 2H, the rest is Llama's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, 0)
        a = self.self_attn
        self.self_attn.q_proj = nn.Linear(2 * h, a.n_heads * a.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, a.n_kv * a.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, a.n_kv * a.head_dim, bias=False)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)


class Eagle3Head(nn.Module):
    """`forward(ids, positions, cache, slots, mask) -> logits [B, T, draft_vocab]` like a target's,
    reading each row's hidden input from the static buffer `hidden_in` and writing each row's
    pre-norm output hidden to `hidden_out` (so the runner's CUDA graphs capture it as they capture
    a target; `set_hidden` fills the input before a step). `layer(...)` is the same pass with the
    hidden as an argument, returning (logits, hidden out) (tree levels, training)."""

    def __init__(self, cfg: Eagle3Config, embed_tokens: nn.Embedding | None = None, max_rows: int = 256):
        super().__init__()
        self.econfig = cfg
        self.config = cfg.llama  # what the KV cache and the runner read
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg.llama)
        self.norm = RMSNorm(h, cfg.llama.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.embed_tokens = None  # own embeddings, when the checkpoint has them
        # NOTE: shared with the target, not a submodule (not saved, not trained)
        self.shared = {"embed": embed_tokens}
        self.register_buffer("inv_freq", rope_inv_freq(cfg.llama), persistent=False)
        self.register_buffer("hidden_in", torch.zeros(1, max_rows, h), persistent=False)
        self.register_buffer("hidden_out", torch.zeros(1, max_rows, h), persistent=False)

    def materialize_buffers(self, device, dtype: torch.dtype) -> None:
        """The non-persistent buffers of a head built on the meta device (RoPE frequencies and the
        hidden-state buffers), made real on `device`."""
        self.inv_freq = rope_inv_freq(self.econfig.llama).to(device)
        self.hidden_in = torch.zeros(self.hidden_in.shape, device=device, dtype=dtype)
        self.hidden_out = torch.zeros(self.hidden_out.shape, device=device, dtype=dtype)

    # ---- inputs ------------------------------------------------------------------------------
    def _embedding(self) -> nn.Embedding:
        """Its own embeddings when the checkpoint has them, else the target's."""
        return self.embed_tokens if self.embed_tokens is not None else self.shared["embed"]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embedding()(ids)

    def embed_weight(self) -> torch.Tensor:
        """The embedding table [V, H] `embed` reads."""
        return self._embedding().weight

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3 * H_target] -> the head's hidden input [..., H]. A draft's few rows on
        CUDA: the fused layers' Triton linear (launched with PDL, unlike cuBLAS: tandem.kernels.fused.pdl)."""
        x = feats.to(self.fc.weight.dtype)
        if x.dim() == 2 and fused_layer.linear_applies(x, self.fc.weight):
            return fused_layer.launch_linear(x, self.fc.weight)
        return self.fc(x)

    def set_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: [T, H] the hidden inputs of the rows about to be fed through `forward`."""
        T = hidden.shape[0]
        if T > self.hidden_in.shape[1]:
            raise ValueError(f"{T} rows exceed the head's hidden buffer of {self.hidden_in.shape[1]}")
        self.hidden_in[0, :T].copy_(hidden)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's."""
        return draft_ids + self.d2t[draft_ids]

    # ---- the pass ----------------------------------------------------------------------------
    def layer(self, ids, hidden, positions, cache=None, slots=None, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions: [B, T]; hidden: [B, T, H] -> (logits [B, T, draft_vocab], out [B, T, H])."""
        m = self.midlayer
        hidden = hidden.to(self.fc.weight.dtype)
        if cache is not None and fused_layer_applies(m.self_attn, m.mlp, hidden, cache, 2 * hidden.shape[-1]):
            return self._fused_layer(ids, hidden, positions, cache, slots, mask)
        hn = m.hidden_norm(hidden)
        x = torch.cat([m.input_layernorm(self.embed(ids)), hn], dim=-1)  # [B, T, 2H]
        r = (hn if self.econfig.norm_before_residual else hidden) + m.self_attn(x, positions, self.inv_freq, cache,
                                                                                   slots, mask)
        out = r + m.mlp(m.post_attention_layernorm(r))  # [B, T, H]
        return self.lm_head(self.norm(out)), out

    def _fused_layer(self, ids, hidden, positions, cache, slots, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer` in eight launches where it was sixteen (tandem.kernels.fused_layer): the embedding
        and both input norms, (q/k/v, RoPE, K/V store), attention, o_proj, (residual add, norm,
        gate/up, SiLU * up), down_proj, (residual add, the final norm), lm_head."""
        m, a = self.midlayer, self.midlayer.self_attn
        _, T, hid = hidden.shape
        H, D = a.n_heads, a.head_dim
        x, hn = embed_norms(ids.reshape(T), self.embed_weight(), hidden.reshape(T, hid), m.input_layernorm.weight,
                            m.hidden_norm.weight, m.input_layernorm.eps)  # [T, 2H], [T, H]
        k, v = cache.layer_kv(a.layer_idx)
        _, q = fused_layer.norm_qkv_rope_store(x, None, None, 0.0, a.qkv_weight, a.qkv_bias, positions.reshape(T),
                                               self.inv_freq, H, a.n_kv, k, v, slots.reshape(T))
        width = mask.shape[-1]
        att = fused_layer.linear(cached_attention(q[None], k[:, :, :width], v[:, :, :width], mask).reshape(T, H * D),
                                 a.o_proj.weight)
        base = hn if self.econfig.norm_before_residual else hidden.reshape(T, hid)
        r, h = head_level.norm_gate_up_silu(base, att, m.post_attention_layernorm.weight,
                                            m.post_attention_layernorm.eps, m.mlp.gate_up_weight)
        out, normed = add_rmsnorm(r, fused_layer.linear(h, m.mlp.down_proj.weight), self.norm.weight, self.norm.eps)
        return self.lm_head(normed)[None], out[None]

    def layer_topk(self, ids, hidden, positions, cache, slots, mask, k: int, rows: int | None = None,
                   src: torch.Tensor | None = None, counter: torch.Tensor | None = None,
                   glue: head_level.LevelGlue | None = None):
        """`layer` over one sequence's T rows, then the k best children of its last `rows` rows (all:
        None), for a tree level. ids, positions, slots: [T]; hidden: [T, H], or [S, H] read through
        src [T] (row t's hidden is hidden[src[t]]: a level reads its parents' outputs); mask [T, W].
        glue: the level's glue to run on those children (tandem.kernels.resident.level_step).
        Returns (log-probs [rows, k] float32, draft ids [rows, k] int64, out [rows, H], the glue's
        next mask or None).

        With the fused layer (CUDA), tandem.kernels.head_level: the input norms and the gather ride
        in the q/k/v kernel's prologue, and the residual add, the final norm, the LM head, the
        top-k and the glue are one kernel (`counter`: its static int32 [1] zero, for CUDA graphs);
        else `layer`, a top-k and the glue."""
        m, a = self.midlayer, self.midlayer.self_attn
        T = ids.shape[0]
        rows = T if rows is None else rows
        if (cache is None or not head_level.enabled(hidden) or a.qkv_bias is not None
                or not fused_layer_applies(m.self_attn, m.mlp, hidden[None], cache, 2 * hidden.shape[-1])):
            if src is not None:
                hidden = hidden.index_select(0, src)
            logits, out = self.layer(ids[None], hidden[None], positions[None], cache, slots[None], mask[None, None])
            lp, tok = topk_logprobs(logits[0, T - rows:], k)
            return lp, tok, out[0, T - rows:], None if glue is None else glue.run(tok, lp)
        hidden = hidden.to(self.fc.weight.dtype)
        H, D = a.n_heads, a.head_dim
        kc, vc = cache.layer_kv(a.layer_idx)
        # the input norms (and the gather) in the q/k/v kernel's prologue
        q, hidden, hn = head_level.eagle_qkv(ids, self.embed_weight(), hidden, src, m.input_layernorm.weight,
                                             m.hidden_norm.weight, m.input_layernorm.eps, a.qkv_weight, positions,
                                             self.inv_freq, H, a.n_kv, kc, vc, slots)  # [T, H, D], [T, h], [T, h]
        width = mask.shape[-1]
        att = cached_attention(q[None], kc[:, :, :width], vc[:, :, :width], mask[None, None])  # [1, T, H, D]
        att = fused_layer.linear(att.reshape(T, H * D), a.o_proj.weight)
        base = hn if self.econfig.norm_before_residual else hidden
        r, h = head_level.norm_gate_up_silu(base, att, m.post_attention_layernorm.weight,
                                            m.post_attention_layernorm.eps, m.mlp.gate_up_weight)
        down = fused_layer.linear(h[T - rows:], m.mlp.down_proj.weight)  # only the rows whose children are wanted
        out, lp, tok, nxt = head_level.head_topk(r[T - rows:], down, self.norm.weight, self.norm.eps,
                                                 self.lm_head.weight, k, counter, glue)
        return lp, tok, out, nxt

    def forward(self, input_ids, positions=None, cache=None, slots=None, mask=None) -> torch.Tensor:
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        logits, out = self.layer(input_ids, self.hidden_in[:, :T].expand(B, T, -1), positions, cache, slots, mask)
        self.hidden_out[:, :T].copy_(out[:1])
        return logits  # [B, T, draft_vocab]

    @property
    def draft_vocab_size(self) -> int:
        return self.econfig.draft_vocab_size

    @property
    def level_hidden_size(self) -> int:
        """Width of the hidden state a level feeds its children (HeadLevels)."""
        return self.config.hidden_size

    @property
    def target_feature_layers(self) -> tuple[int, ...]:
        """The target layers whose features this head reads (Transformer.enable_features)."""
        return tuple(self.econfig.feature_layers)

    def fuse_projections(self) -> "Eagle3Head":
        fuse_decoder_layers([self.midlayer])
        return self

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The tensors of the public layout (t2d derived from d2t)."""
        state = {k: v for k, v in self.state_dict().items()}
        V = self.config.vocab_size
        t2d = torch.zeros(V, dtype=torch.bool, device=self.d2t.device)
        t2d[self.to_target(torch.arange(self.econfig.draft_vocab_size, device=self.d2t.device))] = True
        state["t2d"] = t2d
        return state


# ---- checkpoints ---------------------------------------------------------------------------------
def save_eagle3(model: Eagle3Head, out_dir, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors in the public layout (floats in `dtype`; d2t, t2d as they are)."""
    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    name = str(dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(model.econfig.to_hf(name), indent=2) + "\n")
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().to("cpu").contiguous()
             for k, v in model.checkpoint_state().items()}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    st, pt = d / "model.safetensors", d / "pytorch_model.bin"
    try:
        if st.is_file():
            state = load_file(str(st))
        elif pt.is_file():
            state = torch.load(str(pt), map_location="cpu", weights_only=True)
        else:
            raise ConfigError(f"EAGLE-3 head {str(d)!r} has neither model.safetensors nor pytorch_model.bin")
    except ConfigError:
        raise
    except Exception as e:  # a damaged file: one line, not a traceback
        raise ConfigError(f"cannot read the EAGLE-3 head's weights in {str(d)!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{str(pt)!r} does not hold a state dict")
    # some exports prefix the layer's names with "model." (SGLang accepts both spellings)
    return {k.removeprefix("model."): v for k, v in state.items()}


def load_eagle3(path, target, device, dtype: torch.dtype) -> Eagle3Head:
    """An EAGLE-3 head for `target` (whose embeddings it shares unless it ships its own)."""
    from tandem.models.transformer import default_feature_layers

    d = Path(path)
    try:
        hf = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {str(d / 'config.json')!r}: {str(e).splitlines()[0]}") from None
    cfg = Eagle3Config.from_hf(hf)
    tc = target.config
    L = tc.num_hidden_layers
    # the head's positions follow the target's: its context window is the target's
    cfg = Eagle3Config(llama=_with_max_pos(cfg.llama, tc.max_position_embeddings),
                       draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.target_hidden_size,
                       feature_layers=cfg.feature_layers or default_feature_layers(L),
                       norm_before_residual=cfg.norm_before_residual)
    if cfg.llama.vocab_size != tc.vocab_size or cfg.target_hidden_size != tc.hidden_size:
        raise ConfigError(f"EAGLE-3 head {str(d)!r} was made for a target of vocab {cfg.llama.vocab_size} and hidden "
                          f"{cfg.target_hidden_size}, but the target has {tc.vocab_size} and {tc.hidden_size}")
    if (len(cfg.feature_layers) != 3 or max(cfg.feature_layers) >= L):
        raise ConfigError(f"EAGLE-3 head {str(d)!r} reads target layers {list(cfg.feature_layers)}; it needs three "
                          f"of the target's {L}")
    state = _read_weights(d)
    own_embed = "embed_tokens.weight" in state
    if not own_embed and cfg.hidden_size != tc.hidden_size:
        raise ConfigError(f"EAGLE-3 head {str(d)!r} has hidden size {cfg.hidden_size} and no embed_tokens; the "
                          f"target's embeddings ({tc.hidden_size} wide) cannot be shared")
    with torch.device("meta"):
        model = Eagle3Head(cfg, target.model.embed_tokens)
        if own_embed:
            model.embed_tokens = nn.Embedding(tc.vocab_size, cfg.hidden_size)
    state.pop("t2d", None)
    if "d2t" not in state:
        if cfg.draft_vocab_size != tc.vocab_size:
            raise ConfigError(f"EAGLE-3 head {str(d)!r} has a reduced vocabulary ({cfg.draft_vocab_size}) but no d2t")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "lm_head.weight" not in state and hf.get("tie_word_embeddings"):
        state["lm_head.weight"] = state.get("embed_tokens.weight", target.model.embed_tokens.weight)
    expected = {k: v for k, v in model.state_dict().items() if k not in ("hidden_in", "hidden_out")}
    check_names(state, expected, f"EAGLE-3 head {str(d)!r}")
    check_shapes(state, expected, "EAGLE-3 head ")
    d2t = state.pop("d2t").to(device=device, dtype=torch.long)
    ids = torch.arange(cfg.draft_vocab_size, device=device) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= tc.vocab_size:
        raise ConfigError(f"EAGLE-3 head {str(d)!r}: d2t maps draft ids outside the target's vocabulary")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False, assign=True)
    model.d2t = d2t
    model.materialize_buffers(device, dtype)
    return model.eval().requires_grad_(False)


def _with_max_pos(c: ModelConfig, n: int) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(c, max_position_embeddings=max(n, c.max_position_embeddings))
