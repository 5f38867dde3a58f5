"""Single-request decoding for hybrid targets (Qwen3.5: Gated DeltaNet + attention).

    while not done:
        tree   = drafter.propose()          # a DraftTree hanging from the root (ar: the root alone)
        result = target.verify(tree)        # one tree pass: attention over the KV cache under the
                                            # tree mask, GDN layers walk each root path from the
                                            # committed state; accept (greedy, or recursive
                                            # rejection sampling: lossless); commit the path
        drafter.observe(result, tree)
        emit(result.tokens)

The target keeps no recurrent state per tree node: `verify` reads the committed state, and
the commit replays the accepted path into it (tandem.models.qwen3_5, tandem.kernels.gdn).
The draft is any Tandem draft model over the same vocabulary (e.g. the bundled-style small
draft), an EAGLE-3 head, a block drafter, or a Qwen3.5 draft (tandem.runtime.hybrid_runner:
its tree rows keep their GDN inputs, not states), run by the usual drafters.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Protocol

import torch

from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.plan import RequestPlan, plan_request
from tandem.runtime.target import Launch, replayed_accept
from tandem.tree.draft_tree import DraftTree
from tandem.verify.sampling import probs_from_logits
from tandem.verify.verifier import VerifyResult, greedy_accept, rejection_accept, replay_accept

HYBRID_METHODS = ("ar", "chain", "tree")


class Drafter(Protocol):
    steps: int

    def start(self, prompt: list[int]) -> None: ...
    def propose(self) -> DraftTree: ...
    def observe(self, result: VerifyResult, tree: DraftTree) -> None: ...


class HybridTarget:
    """A hybrid target's side of verification: its KV cache (attention layers), its committed
    recurrent state (GDN layers), one tree pass per `verify`, and the commit of the path."""

    def __init__(self, model, capacity: int, graphs: bool | str | None = None):
        """graphs: capture the tree passes (runtime.hybrid_graphs; None: where they apply, on
        CUDA with the path or WY kernel; "emulate": their static buffers, run eagerly)."""
        from tandem.runtime.hybrid_graphs import HybridGraphs, graphs_apply

        self.model = model
        if graphs is None:
            graphs = graphs_apply(model)
        # (a captured pass's padding rows write one row past the plan's: the scratch row)
        self.cache = model.new_cache(capacity + 1 if graphs else capacity)
        self.state = model.new_state()
        self.graphs = HybridGraphs(model, self.state, self.cache, emulate=graphs == "emulate") if graphs else None
        self.passes = 0

    def prefill(self, tokens: list[int]) -> None:
        """Feed `tokens` as one chain and commit them all (the prompt minus its last token)."""
        if not tokens:
            return
        _, record = self.model.tree_forward(tokens, list(range(-1, len(tokens) - 1)), self.state, self.cache,
                                            prefill=True)
        self.commit(record, list(range(len(tokens))))

    def logits(self, tree: DraftTree):
        """[n, vocab] per-node logits of one tree pass, and the pass's record (commit replays it)."""
        self.passes += 1
        if self.graphs is not None:
            out = self.graphs.run(tree.tokens, tree.parents)
            if out is not None:
                return out
        return self.model.tree_forward(tree.tokens, tree.parents, self.state, self.cache)

    def commit(self, record, path: list[int]) -> None:
        """The accepted path (root first) joins the verified prefix: its K/V rows move into
        the prefix, its GDN inputs are replayed into the committed state (in place: a captured
        pass reads it where it is); the rest is dropped."""
        self.cache.commit(path)
        self.model.commit_state(self.state, record, path)

    def verify(self, tree: DraftTree, sampling: SamplingConfig | None = None,
               generator: torch.Generator | None = None, forced: int | None = None) -> VerifyResult:
        """Greedy accept, or (sampling not greedy) recursive rejection sampling over the tree with
        the target's processed distributions: the committed tokens follow the target's law.
        `forced`: acceptance replay (simulated) takes that many nodes along the draft's most
        probable path instead (tandem.verify.verifier.replay_accept); the pass and commit are real."""
        logits, record = self.logits(tree)
        if forced is not None:
            result = replay_accept(tree, logits.argmax(-1).tolist(), forced)
        elif sampling is None or sampling.greedy:
            result = greedy_accept(tree, logits.argmax(-1).tolist())
        else:
            result = rejection_accept(tree, probs_from_logits(logits, sampling), generator)
        self.commit(record, result.path)
        return result


class HybridTargetWorker:
    """The async workers' target (runtime.async_workers: launch / ready / finish / profile) over a
    hybrid target: the tree pass and the commit of HybridTarget, on the calling thread (the
    inline transport: each pass runs when the draft asks for its result)."""

    def __init__(self, target: HybridTarget, sampling: SamplingConfig, generator: torch.Generator):
        self.target, self.sampling, self.generator = target, sampling, generator
        self.busy_s = 0.0
        self.path_features = None  # (feature drafters do not run async)

    def ctx(self):
        return contextlib.nullcontext()

    def launch(self, tree: DraftTree, now: bool = False, forced: int | None = None) -> Launch:
        return Launch(tree, None, forced=forced)  # run in finish: the pass and its commit go together

    def ready(self, launch) -> bool:
        return True

    def finish(self, launch) -> VerifyResult:
        t0 = time.perf_counter()
        result = self.target.verify(launch.tree, self.sampling, self.generator, launch.forced)
        self.busy_s += time.perf_counter() - t0
        return result

    def profile(self, nodes: int, repeats: int = 3) -> float:
        """Median seconds of a chain pass of nodes + 1 rows; the cache and the state are left as
        they were (the rows are dropped, nothing is committed)."""
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.target.model.tree_forward([0] * (nodes + 1), list(range(-1, nodes)), self.target.state,
                                           self.target.cache)
            if self.target.model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            self.target.cache.commit([])  # drop the tree rows
        return sorted(times)[len(times) // 2]


def hybrid_drafter(method: str, draft_model, spec: SpecConfig, plan: RequestPlan,
                   use_graphs: bool | str | None = None) -> Drafter | None:
    """The drafter of `method` over an attention-only draft model: a best-first tree (tree) or
    the width-1 tree that a greedy chain is (chain); None for ar."""
    if method == "ar":
        return None
    from tandem.drafting.feature_drafters import feature_drafter
    from tandem.drafting.tree_drafter import TreeDrafter
    from tandem.models.transformer import Transformer
    from tandem.runtime.runner import ModelRunner

    # feature drafters read the target's features (the loop passes them)
    drafter = feature_drafter(draft_model, spec, method == "chain", plan.target_rows,
                              lambda model, rows: ModelRunner(model, rows, use_graphs))
    if drafter is not None:
        return drafter
    if getattr(draft_model, "is_hybrid", False):  # a Qwen3.5 draft: its GDN inputs kept per tree row
        from tandem.runtime.hybrid_runner import HybridDraftRunner

        runner = HybridDraftRunner(draft_model, plan.draft_rows)
        sub = spec if method == "tree" else SpecConfig(method="tree", nodes=spec.k, width=1, depth=spec.k - 1)
        drafter = TreeDrafter(runner, sub)
        drafter.tree.device_rounds = False  # (the device rounds drive ModelRunner's graphs)
        return drafter
    if not isinstance(draft_model, Transformer):
        raise ConfigError(f"method {method!r} with a hybrid target needs a small draft model (llama / qwen families), "
                          f"an EAGLE-3 head or a block drafter, not a {type(draft_model).__name__}")
    runner = ModelRunner(draft_model, plan.draft_rows, use_graphs)
    if method == "tree":
        return TreeDrafter(runner, spec)
    return TreeDrafter(runner, SpecConfig(method="tree", nodes=spec.k, width=1, depth=spec.k - 1))


def generate_hybrid(target_model, prompt_ids: list[int], method: str = "tree", draft_model=None,
                    spec: SpecConfig = SpecConfig(), gen: GenerationConfig = GenerationConfig(), tokenizer=None,
                    on_tokens: Callable[[list[int]], None] | None = None, drafter: Drafter | None = None,
                    use_graphs: bool | str | None = None, sampling: SamplingConfig = SamplingConfig(),
                    forced_accepts: list[int] | None = None):
    """Decoding of one request with a hybrid target. Greedy: `ar`, `chain` and `tree` give the
    same tokens. Sampled: the drafters' best-first trees are point masses, so recursive rejection
    sampling keeps the target's distribution. `drafter` (optional) replaces the one built from
    `draft_model`. `forced_accepts`: acceptance replay (simulated, benchmarks only): pass i accepts
    forced_accepts[i % len] nodes; the tokens are then not a decoding of anything."""
    from tandem.runtime.emit import Emitter
    from tandem.runtime.result import GenerationResult

    if method not in HYBRID_METHODS:
        raise ConfigError(f"method {method!r} is not available for hybrid targets; choose one of "
                          f"{', '.join(HYBRID_METHODS)}")
    spec.validate(), gen.validate(), sampling.validate()
    if not prompt_ids:
        raise ConfigError("the prompt is empty; give at least one token of text")
    if method != "ar" and draft_model is None and drafter is None:
        raise ConfigError(f"method {method!r} needs a draft model; pass --draft DIR or use --method ar")
    cfg = target_model.config
    if draft_model is not None and draft_model.config.vocab_size > cfg.vocab_size:
        raise ConfigError(f"the draft's vocabulary ({draft_model.config.vocab_size}) is larger than the target's "
                          f"({cfg.vocab_size}); speculative decoding needs one shared vocabulary")
    ctx = cfg.max_position_embeddings
    if draft_model is not None:
        ctx = min(ctx, draft_model.config.max_position_embeddings)
    if len(prompt_ids) >= ctx:
        raise ConfigError(f"prompt is {len(prompt_ids)} tokens but the context window is {ctx}; shorten the prompt")
    spec, _ = spec.capped(ctx)
    max_new = min(gen.max_new_tokens, ctx - len(prompt_ids))
    plan = plan_request(method, len(prompt_ids), max_new, spec, hybrid=True)
    if drafter is None:
        drafter = hybrid_drafter(method, draft_model, spec, plan, use_graphs)
    eos = set() if gen.ignore_eos else set(cfg.eos_token_ids)
    feature_layers = getattr(draft_model, "target_feature_layers", None) if method != "ar" else None
    if feature_layers:  # EAGLE-3 head / block drafter: the target keeps its features on every pass
        target_model.enable_features(feature_layers)
    target = HybridTarget(target_model, plan.target_rows)

    t0 = time.perf_counter()
    target.prefill(prompt_ids[:-1])
    if drafter is not None:
        if feature_layers:  # the features of the prompt's rows before the root
            prompt_feats = target_model.last_features[0] if len(prompt_ids) > 1 else None
            drafter.start(prompt_ids, prompt_feats)
        else:
            drafter.start(prompt_ids)
    emitter = Emitter(max_new, eos, gen, tokenizer, on_tokens, t0)
    root = prompt_ids[-1]
    g = torch.Generator().manual_seed(sampling.seed)  # as the attention-only loop seeds a request
    while True:
        tree = drafter.propose() if drafter is not None else DraftTree.chain([root])  # ar: the root alone
        forced = replayed_accept(forced_accepts, target.passes) if drafter is not None else None
        result = target.verify(tree, sampling, g, forced)
        if drafter is not None and feature_layers:  # the root's and the accepted nodes' features
            drafter.observe(result, tree, target_model.last_features[0][result.path])
        elif drafter is not None:
            drafter.observe(result, tree)
        if emitter.emit(tree, result):
            break
        root = result.bonus
    if target_model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return emitter.result(GenerationResult, method, len(prompt_ids), seconds, drafter.steps if drafter else 0)
