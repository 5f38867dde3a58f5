"""A parallel block drafter (DFlash / DSpark style): one pass proposes B positions.

The drafter is a few Llama decoder layers of the target's width that read the target's own
features. Row i of its sequence is the token at position i joined with the target's features
of position i - 1 (what the target "thought" just before it):

    x_i = embed(t_i) + fc(norm_f(f_{i-1}))                      context rows (committed tokens)
    x_j = embed(<mask>)                                         block rows, positions root+1 ..

A drafting pass feeds the pending context rows (the root last) and B - 1 mask rows after the
root, all causal; the root's row and the B - 1 mask rows give B next-token distributions: the
B positions after the root. Each position's top-K candidates with their log-probs form the
**lattice** (tandem.drafting.lattice builds the best-first tree over it).

A parallel drafter scores each position without knowing which candidate was chosen before it,
so "the the" and "cat cat" look as good as "the cat". The optional **Markov head** (DSpark)
adds a low-rank bigram score u[prev] . v[next] so a child is scored given its parent's token.

Embeddings and the LM head are the target's (shared, not stored: the drafter has the target's
hidden size); the mask token is one extra embedding row. The checkpoint is a Hugging Face
style folder: `config.json` (architectures ["TandemBlockDrafter"]) + `model.safetensors`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from tandem.config import ConfigError, ModelConfig
from tandem.kernels.block_input import block_input
from tandem.kernels.fused import add_rmsnorm
from tandem.models.files import check_names, check_shapes
from tandem.models.layers import RMSNorm, fuse_decoder_layers, rope_inv_freq
from tandem.models.transformer import DecoderLayer, additive_off_gpu

ARCHITECTURE = "TandemBlockDrafter"


@dataclass(frozen=True)
class BlockDrafterConfig:
    vocab_size: int  # the target's
    hidden_size: int  # the target's (embeddings and LM head are shared)
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_feature_layers: tuple[int, ...]  # the target layers whose inputs form the features
    block_size: int = 16  # B: positions proposed per pass
    num_candidates: int = 16  # K: lattice candidates per position
    markov_rank: int = 64  # 0: no Markov head
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def feature_size(self) -> int:
        return len(self.target_feature_layers) * self.hidden_size

    def llama(self) -> ModelConfig:
        """The decoder layers' config (and what the KV cache and runner read)."""
        return ModelConfig(family="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position_embeddings=self.max_position_embeddings, torch_dtype=self.torch_dtype)

    def to_hf(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d["target_feature_layers"] = list(self.target_feature_layers)
        return {"architectures": [ARCHITECTURE], "model_type": "tandem_block_drafter", **d}

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "BlockDrafterConfig":
        names = {f.name for f in fields(cls)} - {"extra"}
        try:
            kw = {k: hf[k] for k in names if k in hf}
            kw["target_feature_layers"] = tuple(int(i) for i in kw["target_feature_layers"])
            cfg = cls(**kw)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"block drafter config.json is missing or has a bad key ({e}); re-export it") from None
        if cfg.block_size < 1 or cfg.num_candidates < 1:
            raise ConfigError("block drafter config: block_size and num_candidates must be >= 1")
        return cfg


class BlockDrafter(nn.Module):
    """`forward(ids, positions, cache, slots, mask) -> logits [B, T, vocab]` like Transformer's,
    reading each row's target features from `feature_in` (rows with id == mask_id read none).

    The features travel in a static buffer rather than as an argument so the runner's CUDA
    graphs (tandem.runtime.runner) capture this model exactly as they capture a target:
    `set_features` writes them before a step."""

    def __init__(self, cfg: BlockDrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 max_rows: int = 256):
        super().__init__()
        self.bconfig = cfg
        self.config = cfg.llama()
        self.mask_id = cfg.vocab_size  # the extra embedding row
        # NOTE: shared with the target, not parameters of this module (not saved, not trained)
        self.shared = {"embed": embed_tokens, "lm_head": lm_head}
        h = cfg.hidden_size
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.feature_norm = RMSNorm(cfg.feature_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.feature_size, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(self.config, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.markov_rank:
            self.markov_u = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.markov_rank))
            self.markov_v = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.markov_rank))
        else:
            self.markov_u = self.markov_v = None
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        self.register_buffer("feature_in", torch.zeros(1, max_rows, cfg.feature_size), persistent=False)

    # ---- inputs ------------------------------------------------------------------------------
    def set_features(self, feats: torch.Tensor) -> None:
        """feats: [T, F] the target features of the rows about to be fed (zeros for mask rows)."""
        T = feats.shape[0]
        if T > self.feature_in.shape[1]:
            raise ValueError(f"{T} rows exceed the drafter's feature buffer of {self.feature_in.shape[1]}")
        self.feature_in[0, :T].copy_(feats)

    def embed(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """ids: [B, T] (mask_id for block rows); feats: [B, T, F] -> row inputs [B, T, hidden]."""
        is_mask = ids == self.mask_id
        tok = self.shared["embed"](ids.masked_fill(is_mask, 0))  # [B, T, h]
        x = torch.where(is_mask[..., None], self.mask_embedding.to(tok.dtype), tok)
        # mask rows read no features (whatever the static buffer holds there: no zeroing launch)
        feats = feats.to(x.dtype).masked_fill(is_mask[..., None], 0.0)
        return x + self.fc(self.feature_norm(feats))

    def input_rows(self, tok: torch.Tensor, feat: torch.Tensor, rows: int) -> torch.Tensor:
        """`embed` for a pass of P context rows then rows - P mask rows, in one launch on CUDA
        (tandem.kernels.block_input): tok [P], feat [P, F] -> x [rows, hidden]."""
        return block_input(tok, feat, self.shared["embed"].weight, self.mask_embedding, self.feature_norm.weight,
                           self.feature_norm.eps, self.fc.weight, rows)

    # ---- the pass ----------------------------------------------------------------------------
    def residual(self, x: torch.Tensor, positions: torch.Tensor, cache=None, slots=None, mask=None):
        """The decoder layers -> (x, delta): the residual stream before the last layer's update and
        that update (the final norm reads x + delta; head_topk folds the add into its launch)."""
        mask = additive_off_gpu(mask, x)
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, positions, self.inv_freq, cache, slots, mask)
        return x, delta

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, cache=None, slots=None, mask=None) -> torch.Tensor:
        x, delta = self.residual(x, positions, cache, slots, mask)
        return add_rmsnorm(x, delta, self.norm.weight, self.norm.eps)[1]

    def forward(self, input_ids, positions=None, cache=None, slots=None, mask=None,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; with `lattice_out` set, each row's lattice entries instead
        (`lattice_rows`), so the lattice is computed inside the runner's CUDA graph."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        feats = features if features is not None else self.feature_in[:, :T].expand(B, T, -1)
        h = self.hidden(self.embed(input_ids, feats), positions, cache, slots, mask)
        return self.shared["lm_head"](h)  # [B, T, vocab]

    def lattice_model(self) -> "LatticeHead":
        """This drafter as the runner's model at decoding time (one per drafter, so runners and
        their graphs are reused across requests)."""
        if "lattice" not in self.shared:
            self.shared["lattice"] = LatticeHead(self)
        return self.shared["lattice"]

    def lattice_rows(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Per row i, packed in float32 [B, T, 3K + K*K]: its top-K candidate tokens, their
        log-probs, their log-probs given the row's own token as parent (the root's row uses
        that), and given each of row i - 1's candidates as parent (a mask row uses that).
        Parent-conditioned log-probs add the Markov score and renormalise over the K
        candidates plus the mass outside them, which is kept as it was."""
        K = self.bconfig.num_candidates
        lp, tok = torch.log_softmax(logits.float(), dim=-1).topk(K, dim=-1)  # [B, T, K] each
        rest = torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-6))[..., None]  # [B, T, 1]
        prev = torch.cat([tok[:, :1], tok[:, :-1]], dim=1)  # [B, T, K] row i - 1's candidates
        if self.markov_u is None:
            own, given = lp, lp[..., None, :].expand(*lp.shape[:2], K, K)
        else:
            # (mask rows carry the mask id: clamped, their `own` entries are never read)
            own = lp + self.markov(ids.clamp(max=self.bconfig.vocab_size - 1)[..., None], tok)  # [B, T, K]
            given = lp[..., None, :] + self.markov(prev[..., :, None], tok[..., None, :])  # [B, T, K, K]
            own = own - torch.logaddexp(torch.logsumexp(own, -1, keepdim=True), rest)
            given = given - torch.logaddexp(torch.logsumexp(given, -1, keepdim=True), rest[..., None])
        return torch.cat([tok.float(), lp, own, given.flatten(-2)], dim=-1)

    def markov(self, prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """Bigram score of token `nxt` after token `prev` (broadcasting); 0 without the head."""
        if self.markov_u is None:
            return torch.zeros(torch.broadcast_shapes(prev.shape, nxt.shape), device=prev.device)
        return (self.markov_u[prev].float() * self.markov_v[nxt].float()).sum(-1)

    def markov_full(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: [...] -> bigram scores of every next token [..., vocab] (training)."""
        return self.markov_u[prev].float() @ self.markov_v.float().T

    @property
    def target_feature_layers(self) -> tuple[int, ...]:
        """The target layers whose features this drafter reads (Transformer.enable_features)."""
        return tuple(self.bconfig.target_feature_layers)

    def fuse_projections(self) -> "BlockDrafter":
        fuse_decoder_layers(self.layers)
        return self

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """What the checkpoint stores: every parameter but the shared embedding and LM head."""
        return {k: v for k, v in self.state_dict().items() if k != "feature_in"}


class LatticeHead(nn.Module):
    """A BlockDrafter whose pass returns each row's lattice entries (`lattice_rows`) instead of
    logits: the runner captures the whole lattice computation in the drafter's CUDA graph, and
    the host reads B rows of 3K + K*K floats instead of running a dozen small kernels."""

    def __init__(self, drafter: BlockDrafter):
        super().__init__()
        self.drafter = drafter
        self.config = drafter.config

    def forward(self, input_ids, positions=None, cache=None, slots=None, mask=None) -> torch.Tensor:
        return self.drafter.lattice_rows(self.drafter(input_ids, positions, cache, slots, mask), input_ids)

    def fuse_projections(self) -> "LatticeHead":
        self.drafter.fuse_projections()
        return self

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.dtype


# ---- checkpoints ---------------------------------------------------------------------------------
def save_block_drafter(model: BlockDrafter, out_dir, dtype: torch.dtype = torch.bfloat16) -> None:
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = model.bconfig.to_hf()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.own_state_dict().items()}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def load_block_drafter(path, target, device, dtype) -> BlockDrafter:
    """A block drafter checkpoint for `target` (its embeddings and LM head are shared)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(path)
    cfg = BlockDrafterConfig.from_hf(json.loads((d / "config.json").read_text()))
    tc = target.config
    if (cfg.vocab_size, cfg.hidden_size) != (tc.vocab_size, tc.hidden_size):
        raise ConfigError(f"block drafter {str(d)!r} was made for a target of vocab {cfg.vocab_size} and hidden "
                          f"{cfg.hidden_size}, but the target has {tc.vocab_size} and {tc.hidden_size}")
    if max(cfg.target_feature_layers) >= tc.num_hidden_layers:
        raise ConfigError(f"block drafter {str(d)!r} reads target layers {list(cfg.target_feature_layers)}, "
                          f"but the target has {tc.num_hidden_layers} layers")
    f = d / "model.safetensors"
    if not f.is_file():
        raise ConfigError(f"{str(d)!r} has no model.safetensors")
    with torch.device("meta"):
        model = BlockDrafter(cfg, target.model.embed_tokens, target.lm_head)
    state = load_file(str(f))
    expected = model.own_state_dict()
    check_names(state, expected, f"block drafter {str(d)!r}")
    check_shapes(state, expected, "block drafter ")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(model.config).to(device)
    model.feature_in = torch.zeros(1, 256, cfg.feature_size, device=device, dtype=dtype)
    return model.eval().requires_grad_(False)
