"""One config tree for Tandem: frozen dataclasses, CLI defaults are read from them.

Vocabulary used everywhere in the project (defined once, here):

- **root**: the last committed token, whose K/V is not yet in the cache; every draft tree
  (a chain is a tree with one branch) hangs from it and is verified together with it.
- **accepted tokens**: draft tokens the target agrees with, along one root-to-node path.
- **bonus token**: the token the target itself produces after the last accepted token (in
  greedy mode its argmax; with sampling a draw from the target or from a residual).
- **rejected tokens**: every other draft token of that verification pass.
- **tau**: tokens committed per target verification pass, bonus included (1.0 for `ar`).
- **node budget N**: number of draft tokens verified in one pass (the root is extra).
- **depth d**: number of draft expansion rounds; **width w**: leaves expanded per round.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

# the hybrid family (tandem.models.qwen3_5 loads it; named here for the messages of this floor)
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """A user-facing configuration error; its message is one line that says how to fix it."""


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face `config.json` a decoder-only Llama-family model needs."""

    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen copy of the HF dict
    max_position_embeddings: int = 2048
    # sliding-window attention (Mistral v0.1; Qwen2/3 with use_sliding_window): the layers that
    # use it, each row attending to the `sliding_window` positions up to its own (see from_hf)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        family = None
        for a in archs:
            family = SUPPORTED_ARCHITECTURES.get(a)
            if family:
                break
        if family is None:
            family = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
                hf.get("model_type", "")
            )
        if family is None:
            loads = ", ".join((*SUPPORTED_ARCHITECTURES, *HYBRID_ARCHITECTURES))
            if not archs and not hf.get("model_type"):
                raise ConfigError(f"config.json names no architecture (`architectures`, `model_type`); Tandem "
                                  f"loads {loads}")
            raise ConfigError(f"unsupported architecture {archs or hf.get('model_type')!r}; Tandem loads {loads}")
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            # transformers 5 moved rope settings into `rope_parameters`; 4.x used rope_theta + rope_scaling.
            rope_params = hf.get("rope_parameters") or {}
            rope_theta = float(hf.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
            scaling = hf.get("rope_scaling") or None
            if scaling is None and rope_params.get("rope_type", "default") != "default":
                scaling = rope_params
            if scaling is not None:
                if not isinstance(scaling, dict):
                    raise ConfigError(f"rope_scaling must be a JSON object (got {scaling!r})")
                rtype = scaling.get("rope_type", scaling.get("type", "default"))
                if rtype == "default":
                    scaling = None
                elif rtype != "llama3":
                    raise ConfigError(f"unsupported rope_scaling type {rtype!r}; Tandem supports 'llama3'")
                elif "factor" not in scaling:
                    raise ConfigError("rope_scaling of type 'llama3' lacks its 'factor'; re-export the checkpoint")
                else:
                    # Normalised so the 4.x (rope_scaling + rope_theta) and 5.x (rope_parameters)
                    # spellings of one config compare equal: theta lives in `rope_theta`.
                    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
                    scaling["rope_type"] = rtype
                    # (transformers 5's fallback: the model's own window; a fixed 8192 gave other frequencies)
                    scaling.setdefault("original_max_position_embeddings", int(hf.get("max_position_embeddings", 2048)))
                    float(scaling["factor"])  # a non-number is reported below
            act = hf.get("hidden_act", "silu")
            if act not in ("silu", "swish"):  # (every family here gates its MLP with SiLU)
                raise ConfigError(f"hidden_act {act!r} is not supported (Tandem's MLP is SiLU-gated: silu)")
            eos = hf.get("eos_token_id")
            eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            # transformers hard-codes the biases of Qwen2 (q/k/v: always) and Mistral (never);
            # Llama and Qwen3 read `attention_bias`, which there also puts a bias on o_proj, and
            # Llama reads `mlp_bias`. Our layers have neither, so refuse those configs.
            qkv_bias = {"qwen2": True, "mistral": False}.get(family, False)
            if family in ("llama", "qwen3") and hf.get("attention_bias"):
                raise ConfigError(f"attention_bias=true ({family} with biased q/k/v/o projections) is not supported")
            if family == "llama" and hf.get("mlp_bias"):
                raise ConfigError("mlp_bias=true (llama with biased MLP projections) is not supported")
            # Sliding-window layers, as transformers reads them: Mistral, every layer (a config
            # without the key gets its default window, 4096; null means full attention); Qwen2/3,
            # with use_sliding_window, the layers from max_window_layers on, or as `layer_types` says.
            max_pos = int(hf.get("max_position_embeddings", 2048))
            L = int(hf["num_hidden_layers"])
            window, sliding = None, ()
            types = hf.get("layer_types")
            if family == "mistral":
                window = hf.get("sliding_window", 4096)
                sliding = tuple(range(L))
            elif family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
                window = hf.get("sliding_window", 4096)
                if types:
                    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
                else:
                    sliding = tuple(range(int(hf.get("max_window_layers", 28)), L))
            if window is None or not sliding:
                window, sliding = None, ()
            elif int(window) < 1:
                raise ConfigError(f"sliding_window must be >= 1 (got {window})")
            return cls(
                family=family,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                # (a config without head_dim: transformers' default, hidden / heads, but 128 for Qwen3)
                head_dim=int(hf.get("head_dim") or (128 if family == "qwen3" else hidden // heads)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=None if scaling is None else tuple(sorted(scaling.items())),
                max_position_embeddings=max_pos,
                sliding_window=None if window is None else int(window),
                sliding_layers=sliding,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=qkv_bias,
                qk_norm=family == "qwen3",
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing the key {e.args[0]!r}; is this a Hugging Face causal-LM config?") from None
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # e.g. "hidden_size": null or "abc"
            raise ConfigError(f"config.json has a value of the wrong type ({str(e).splitlines()[0]}); re-export the checkpoint") from None

    def to_hf(self) -> dict[str, Any]:
        """A `config.json` dict that transformers loads as the matching *ForCausalLM."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.family]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
        }
        if self.family in ("llama", "mistral"):
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.family == "mistral":
            # (None: full attention; MistralConfig's default is a 4096 window)
            d["sliding_window"] = self.sliding_window if self.sliding_layers else None
        elif self.sliding_layers:
            d["use_sliding_window"] = True
            d["sliding_window"] = self.sliding_window
            d["max_window_layers"] = self.sliding_layers[0]
            d["layer_types"] = ["sliding_attention" if i in self.sliding_layers else "full_attention"
                                for i in range(self.num_hidden_layers)]
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        # NOTE: written even when unset (null): transformers would otherwise fill in its own
        # defaults (LlamaConfig: bos 1, eos 2), so the config would not read back the same.
        d["bos_token_id"] = self.bos_token_id
        if not self.eos_token_ids:
            d["eos_token_id"] = None
        else:
            d["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        return d

    @property
    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + h


SEED_RANGE = 2**64  # torch.Generator.manual_seed takes [-2**63, 2**64) and wraps negatives mod 2**64


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. temperature 0 means greedy (argmax).

    `seed` may be any integer: it is reduced modulo 2**64 on construction, which leaves every
    seed torch accepts on the random stream it already had (torch wraps negatives the same way).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", int(self.seed) % SEED_RANGE)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not (self.temperature >= 0.0) or math.isinf(self.temperature):
            raise ConfigError(f"--temperature must be a finite number >= 0 (got {self.temperature}); "
                              "use 0 for greedy decoding")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"--top-p must be in (0, 1] (got {self.top_p})")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation knobs. `k` is the chain length; `nodes`, `width`, `depth` shape the best-first tree."""

    method: str = "tree"  # ar | chain | tree | async
    k: int = 5
    # node budget N: draft tokens verified per pass (root excluded). 31, not 32: a pass verifies N + 1
    # rows, and the small model's fused kernels work in blocks of 16 rows, so 33 rows pay a third block
    # for one node that is rarely accepted (one H100, block drafter, MBPP: tau 4.52 at both, 2.75x `ar`
    # at 31 against 2.67x at 32; bench/results/h100-2026-12-07-session13/call1/).
    nodes: int = 31
    width: int = 4  # w: leaves expanded per round
    depth: int | None = None  # d: expansion rounds; default: enough to fill the budget

    def resolved_depth(self) -> int:
        return self.depth if self.depth is not None else max(1, min(12, math.ceil(self.nodes / self.width)))

    def validate(self) -> None:
        if self.k < 1:
            raise ConfigError(f"--k must be >= 1 (got {self.k})")
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1 (got {self.nodes})")
        if self.width < 1:
            raise ConfigError(f"--width must be >= 1 (got {self.width})")
        if self.depth is not None and self.depth < 1:
            raise ConfigError(f"--depth must be >= 1 (got {self.depth})")

    def capped(self, context_window: int) -> tuple[SpecConfig, list[str]]:
        """This config with N, k, w and d held to what a verify pass and the draft's tree region
        can use (see `draft_token_cap`), and one notice per value that was lowered.

        N and k (draft tokens per pass) are at most `draft_token_cap(context_window)`; w at most
        MAX_WIDTH and N's cap; d at most N's cap / w, so a tree feeds at most about N's cap draft
        rows per pass (serial `tree` feeds d x w; `async` grows at most ~2N + 17w rows anyway).
        """
        n_cap = draft_token_cap(context_window)
        nodes, k = min(self.nodes, n_cap), min(self.k, n_cap)
        width = min(self.width, MAX_WIDTH, n_cap)
        depth = None if self.depth is None else min(self.depth, max(1, n_cap // width))
        notes = []
        why = f"the cap is min({MAX_DRAFT_TOKENS}, context window {context_window} - 1)"
        if nodes != self.nodes:
            notes.append(f"--nodes {self.nodes} capped to {nodes} ({why})")
        if k != self.k:
            notes.append(f"--k {self.k} capped to {k} ({why})")
        if width != self.width:
            notes.append(f"--width {self.width} capped to {width} (at most {min(MAX_WIDTH, n_cap)} leaves per round)")
        if depth != self.depth:
            notes.append(f"--depth {self.depth} capped to {depth} (d x w fed draft rows stay within {n_cap})")
        return replace(self, nodes=nodes, k=k, width=width, depth=depth), notes


# NOTE: the largest verify pass Tandem builds. A pass of N + 1 rows attends over the whole
# cache, so its scores and mask grow as N x context; published trees stop well before this
# (tau saturates near N = 64-96 on the bundled pair, Sequoia's largest trees have 768 nodes).
MAX_DRAFT_TOKENS = 1024
MAX_WIDTH = 64  # leaves expanded per round: each round adds w x w candidates


def draft_token_cap(context_window: int) -> int:
    """The most draft tokens (N, or a chain's k) one verify pass may hold."""
    return max(1, min(MAX_DRAFT_TOKENS, context_window - 1))


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be a positive integer (got {self.max_new_tokens})")
        if any(not s for s in self.stop):
            raise ConfigError("--stop needs a non-empty string (an empty stop string would match at once)")


def lazy_exports(package: str, table: dict[str, str]):
    """A module `__getattr__` that imports each name of `table` from its module on first use, so that
    importing a package (`import tandem`: the CLI's --version and --help) does not import torch."""
    def __getattr__(name: str):
        if name in table:
            import importlib

            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
