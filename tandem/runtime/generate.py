"""Single-request decoding: `ar`, `chain` and `tree` behind one loop (`async`: async_decode.py).

    while not done:
        tree   = drafter.propose()        # a DraftTree hanging from the root (AR: the root alone)
        result = target.verify(tree)      # one target pass; accepted path + bonus token
        drafter.observe(result, tree)     # the draft keeps the accepted path's K/V
        emit(result.tokens)               # cut at EOS / stop string / max_new_tokens
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import torch

from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.drafting.chain_drafter import ChainDrafter
from tandem.drafting.tree_drafter import TreeDrafter
from tandem.quant.int8_head import CertifiedHead
from tandem.runtime.certified import certified_lm_head, check_certified
from tandem.runtime.emit import Emitter
from tandem.runtime.pair import drafter_kind, needs_draft_model
from tandem.runtime.plan import RequestPlan, plan_request
from tandem.runtime.result import GenerationResult
from tandem.runtime.runner import ModelRunner, runner_for
from tandem.runtime.target import Launch, Target, replayed_accept
from tandem.runtime.timing import PassClock
from tandem.tree.draft_tree import DraftTree

# NOTE: the records and helpers above live in their own modules so that the async workers,
# the hybrid loop and the engine import them without importing this loop (no import circle);
# they stay importable from here for existing callers.
__all__ = ["METHODS", "Emitter", "GenerationResult", "Generator", "Launch", "PassClock", "Target",
           "replayed_accept"]

METHODS = ("auto", "ar", "chain", "tree", "async", "tlv")


class Generator:
    """Holds a target (and optional draft) model and decodes one request at a time."""

    def __init__(self, target_model, draft_model=None, tokenizer=None, use_graphs: bool | None = None,
                 certified_head: bool = False, resident: bool | None = None):
        self.target_model, self.draft_model, self.tokenizer = target_model, draft_model, tokenizer
        self.use_graphs = use_graphs
        # greedy verification through the certified INT8 LM head (tandem.runtime.certified)
        self.certified_head = certified_head
        # the device-resident loop for greedy ar / block-drafter chain and tree (None: on CUDA)
        self.resident = resident
        self._runners: dict[str, ModelRunner] = {}
        from tandem.runtime.auto import AutoSelector

        self.auto = AutoSelector()  # --method auto's measurements, kept for this engine

    def close(self) -> None:
        """Stop the worker processes that method `async` started over gloo / nccl (they serve
        every request of this engine; garbage collection and exit stop them too)."""
        from tandem.runtime.workers import close_pools

        close_pools(self._runners)

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def context_window(self) -> int:
        ctx = self.target_model.config.max_position_embeddings
        if self.draft_model is not None:
            ctx = min(ctx, self.draft_model.config.max_position_embeddings)
        return ctx

    def _runner(self, which: str, model, capacity: int) -> ModelRunner:
        return runner_for(self._runners, which, model, capacity, self.use_graphs)

    def _drafter(self, method: str, spec: SpecConfig, sampling: SamplingConfig, g: torch.Generator,
                 plan: RequestPlan):
        """The drafter for `method` over this Generator's draft: a small draft model (chain, tree)
        or a parallel block drafter (its lattice: best path for chain, best-first tree for tree)."""
        from tandem.drafting.feature_drafters import feature_drafter

        drafter = feature_drafter(self.draft_model, spec, method == "chain", plan.target_rows,
                                  lambda model, rows: self._runner("draft", model, rows))
        if drafter is not None:
            return drafter
        draft_runner = self._runner("draft", self.draft_model, plan.draft_rows)
        if method == "tree":
            return TreeDrafter(draft_runner, spec)
        if sampling.greedy:
            # a greedy chain is the best-first tree of width 1: k nodes, k - 1 of them fed, so
            # it runs on the device rounds too (one host sync per chain instead of k - 1)
            return TreeDrafter(draft_runner, SpecConfig(method="tree", nodes=spec.k, width=1, depth=spec.k - 1))
        # a sampled chain keeps each token's draft distribution q for rejection sampling
        return ChainDrafter(draft_runner, sampling, spec.k, g)

    def _resident(self, method: str, sampling: SamplingConfig, forced_accepts) -> bool:
        """Whether this request runs the device-resident loop (tandem.runtime.resident): greedy
        `ar`, and `chain` / `tree` with a block drafter, an EAGLE-3 head or a small draft model
        (a plain Transformer), greedy or sampled: on by default on CUDA with graphs (each path
        validated on the H200: tests/gpu/test_gpu_resident.py). `resident=True` forces it (tests
        run it on the CPU), TANDEM_RESIDENT=0 turns it off (the host-driven loop)."""
        from tandem.models.block_drafter import BlockDrafter
        from tandem.models.eagle3 import Eagle3Head
        from tandem.models.transformer import Transformer

        if self.certified_head or method not in ("ar", "chain", "tree"):
            return False
        if forced_accepts is not None and not sampling.greedy:
            return False  # (replay of a sampled trace: the host loop)
        if method != "ar" and type(self.draft_model) not in (BlockDrafter, Eagle3Head, Transformer):
            return False  # (a hybrid draft's recurrent state cannot take tree rows)
        if self.resident is not None:
            return self.resident
        if os.environ.get("TANDEM_RESIDENT", "") == "0":
            return False
        return (self.target_model.device.type == "cuda" and self.use_graphs is not False
                and os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0")

    def _generate_resident(self, prompt_ids: list[int], method: str, spec: SpecConfig, sampling: SamplingConfig,
                           gen: GenerationConfig, max_new: int, eos: set[int], on_tokens,
                           forced_accepts: list[int] | None = None) -> GenerationResult:
        from tandem.runtime.resident import resident_loop

        drafting = method != "ar"
        draft_model = self.draft_model if drafting else None
        if hasattr(draft_model, "target_feature_layers"):  # before the target's graphs are captured: they must write the features
            self.target_model.enable_features(draft_model.target_feature_layers)
        # the caches hold the prompt, the new tokens and the steps queued past the end (rounded up,
        # so requests of other lengths reuse the runners and their captured graphs)
        if draft_model is None:
            deepest = 0
        elif hasattr(draft_model, "bconfig"):
            deepest = draft_model.bconfig.block_size
        else:
            deepest = spec.k if method == "chain" else spec.resolved_depth()
        # (a step commits at most deepest + 1 rows; a draft pass writes at most 2 x deepest + a tree)
        slack = 4 * (deepest + 1) + 2 * deepest + 2 * max(spec.nodes, spec.k, spec.width * (deepest + 1)) + 2
        rows = min(max(512, 1 << (len(prompt_ids) + max_new + slack - 1).bit_length()), self.context_window + slack)
        target = self._runner("target", self.target_model, rows)
        draft = None
        if draft_model is not None:
            model = draft_model.lattice_model() if hasattr(draft_model, "bconfig") else draft_model
            draft = self._runner("draft", model, rows + slack)
        loop = resident_loop(target, draft, spec, method == "chain")
        t0 = time.perf_counter()
        target.prefill(prompt_ids[:-1])
        if draft is not None:  # the prompt's context rows, fed until at most one step's worth is left
            pending, feats = loop.feed_prompt(prompt_ids, target.last_features if len(prompt_ids) > 1 else None)
        else:
            pending, feats = [prompt_ids[-1]], None
        prefix, dprefix = target.cache.prefix_len, draft.cache.prefix_len if draft is not None else 0
        loop.start(prefix, dprefix, pending, feats, sampling, forced_accepts)
        emitter = Emitter(max_new, eos, gen, self.tokenizer, on_tokens, t0)
        steps, draft_s, verify_s = loop.run(emitter, prefix, dprefix, len(pending))
        if self.target_model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return emitter.result(GenerationResult, method, len(prompt_ids), seconds, steps if drafting else 0,
                              draft_seconds=draft_s if drafting else 0.0, verify_seconds=verify_s, loop="resident",
                              passes_past_end=steps - len(emitter.accept_lengths))

    def _split(self, k: int, prompt_ids: list[int], spec: SpecConfig, transport: str) -> tuple[int, int]:
        """The x : k-x split, searched on the first request (tandem.runtime.placement), then kept."""
        from tandem.runtime.placement import search_split

        key = ("split", transport, k, spec.nodes, spec.width)
        if key not in self._runners:
            self._runners[key], _ = search_split(self.target_model, self.draft_model, prompt_ids, spec, transport, k)
        best = self._runners[key]
        return best.target, best.draft

    def generate(self, prompt_ids: list[int], method: str = "tree", spec: SpecConfig = SpecConfig(),
                 sampling: SamplingConfig = SamplingConfig(), gen: GenerationConfig = GenerationConfig(),
                 on_tokens: Callable[[list[int]], None] | None = None, transport: str = "auto",
                 forced_accepts: list[int] | None = None, tensor_parallel_size: int = 1,
                 draft_tensor_parallel_size: int = 1, split_search: int | None = None) -> GenerationResult:
        """Decode one request. `forced_accepts` (acceptance replay): the accepted-token count of
        each target pass comes from this recorded list instead of the target (simulated acceptance;
        the tokens are meaningless, the costs real)."""
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        spec.validate(), sampling.validate(), gen.validate()
        if not prompt_ids:
            raise ConfigError("the prompt is empty; give at least one token of text")
        if self.certified_head and not isinstance(self.target_model.lm_head, CertifiedHead):
            check_certified(method, sampling, getattr(self.target_model, "is_hybrid", False))
            with certified_lm_head(self.target_model):  # this request only; the full head comes back after
                return self.generate(prompt_ids, method, spec, sampling, gen, on_tokens, transport, forced_accepts,
                                     tensor_parallel_size, draft_tensor_parallel_size, split_search)
        # Qwen3.5 (runtime/hybrid.py): ar, chain and tree in the hybrid loop, async inline, and
        # auto's measured trial below over those (a tree's GDN paths cost more rows than
        # attention's, so whether it pays is measured, not assumed)
        hybrid = getattr(self.target_model, "is_hybrid", False) and method not in ("async", "auto")
        if hybrid:
            if method not in ("ar", "chain", "tree"):
                raise ConfigError(f"hybrid targets (Qwen3.5) run auto, ar, chain, tree and async, not {method!r}")
            from tandem.runtime.hybrid import generate_hybrid

            return generate_hybrid(self.target_model, prompt_ids, method, self.draft_model, spec, gen, self.tokenizer,
                                   on_tokens, use_graphs=self.use_graphs, sampling=sampling,
                                   forced_accepts=forced_accepts)
        if getattr(self.draft_model, "is_hybrid", False) and method != "ar" and \
                not getattr(self.target_model, "is_hybrid", False):
            raise ConfigError("a Qwen3.5 (hybrid) draft drafts for Qwen3.5 targets only (their loop keeps its "
                              "recurrent state); pair this target with an attention-only draft")
        if method == "auto":  # the measured fastest method (tandem.runtime.auto); --method overrides
            if (tensor_parallel_size, draft_tensor_parallel_size) != (1, 1) or split_search is not None:
                raise ConfigError("--tensor-parallel-size / --split-search need --method async, not auto")
            if len(prompt_ids) >= self.context_window:
                raise ConfigError(f"prompt is {len(prompt_ids)} tokens but the context window is "
                                  f"{self.context_window}; shorten the prompt")
            chosen = self.auto.choose(self, prompt_ids, spec, sampling)  # a method and its shape
            res = self.generate(prompt_ids, chosen.method, chosen.spec, sampling, gen, on_tokens=on_tokens,
                                forced_accepts=forced_accepts)
            self.auto.update(chosen.label, res.decode_tokens_per_s)
            res.auto_pick = chosen.label
            return res
        if method != "ar" and self.draft_model is None:
            raise ConfigError(f"method {method!r} needs a draft model; pass --draft DIR or use --method ar")
        searching = split_search is not None
        if ((tensor_parallel_size, draft_tensor_parallel_size) != (1, 1) or searching) and method != "async":
            raise ConfigError(f"--tensor-parallel-size / --draft-tensor-parallel-size / --split-search work with "
                              f"--method async (its process transports), not {method!r}")
        ctx = self.context_window
        spec, _ = spec.capped(ctx)  # the CLI prints the notices; here the caps only keep memory bounded
        if searching:
            if (tensor_parallel_size, draft_tensor_parallel_size) != (1, 1):
                raise ConfigError("give either --split-search K or the two tensor-parallel sizes, not both")
            tensor_parallel_size, draft_tensor_parallel_size = self._split(split_search, prompt_ids, spec, transport)
        if len(prompt_ids) >= ctx:
            raise ConfigError(
                f"prompt is {len(prompt_ids)} tokens but the context window is {ctx}; shorten the prompt")
        max_new = min(gen.max_new_tokens, ctx - len(prompt_ids))
        eos = set() if gen.ignore_eos else set(self.target_model.config.eos_token_ids)
        why = needs_draft_model(method, drafter_kind(self.draft_model))
        if method == "async" and why:
            raise ConfigError(why)
        if method == "async":  # SwiftSpec: draft and target as separate workers (runtime/async_decode.py)
            from tandem.runtime.async_decode import generate_async

            return generate_async(self.target_model, self.draft_model, prompt_ids, spec, sampling,
                                  dataclasses.replace(gen, max_new_tokens=max_new), eos, transport=transport,
                                  on_tokens=on_tokens, tokenizer=self.tokenizer, use_graphs=self.use_graphs,
                                  runners=self._runners, forced_accepts=forced_accepts,
                                  tensor_parallel_size=tensor_parallel_size,
                                  draft_tensor_parallel_size=draft_tensor_parallel_size)
        if method == "tlv":  # two-level verification, greedy (runtime/tlv.py)
            from tandem.runtime.tlv import check_tlv, generate_tlv

            check_tlv(self.draft_model, sampling, forced_accepts)
            return generate_tlv(self, prompt_ids, spec, gen, max_new, eos, on_tokens)
        if self._resident(method, sampling, forced_accepts):
            return self._generate_resident(prompt_ids, method, spec, sampling, gen, max_new, eos, on_tokens,
                                           forced_accepts)
        plan = plan_request(method, len(prompt_ids), max_new, spec)
        g = torch.Generator().manual_seed(sampling.seed)
        drafter = None if method == "ar" else self._drafter(method, spec, sampling, g, plan)
        features = getattr(drafter, "needs_features", False)
        if features:  # before the target's runner captures its graphs: they must write the features
            self.target_model.enable_features(drafter.feature_layers)
        if self.certified_head:  # a runner of its own: its graphs hold the certified head, not the full one
            # (on CUDA the head's kernels have fixed shapes and capture; the CPU reference prunes
            # with data-dependent shapes, so there it runs eagerly or with emulated graphs)
            cuda = self.target_model.device.type == "cuda"
            target_runner = runner_for(self._runners, "target-certified", self.target_model, plan.target_rows,
                                       self.use_graphs if cuda else ("emulate" if self.use_graphs == "emulate" else False))
        else:
            target_runner = self._runner("target", self.target_model, plan.target_rows)
        target = Target(target_runner, sampling, g)
        if drafter is not None and not features:
            drafter.start(prompt_ids)

        t0 = time.perf_counter()
        target.runner.prefill(prompt_ids[:-1])
        if features:  # a feature drafter starts from the prompt's target features
            drafter.start(prompt_ids, target.runner.last_features if len(prompt_ids) > 1 else None)
        emitter = Emitter(max_new, eos, gen, self.tokenizer, on_tokens, t0)
        clock = PassClock(self.target_model.device)
        root = prompt_ids[-1]
        while True:
            clock.mark()
            tree = drafter.propose() if drafter is not None else DraftTree.chain([root])  # ar: the root alone
            clock.mark()
            result = target.verify(tree, replayed_accept(forced_accepts, len(emitter.accept_lengths)))
            clock.mark()
            if features:
                drafter.observe(result, tree, target.path_features)
            elif drafter is not None:
                drafter.observe(result, tree)
            if emitter.emit(tree, result):
                break
            root = result.bonus
        if self.target_model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        draft_s, verify_s = clock.totals()
        return emitter.result(GenerationResult, method, len(prompt_ids), seconds, drafter.steps if drafter else 0,
                              draft_seconds=draft_s, verify_seconds=verify_s)
