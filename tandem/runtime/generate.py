"""Single-request decoding: `ar`, `chain` and `tree` behind one loop (`async`: async_decode.py).

    while not done:
        tree   = drafter.propose()        # a DraftTree hanging from the root (AR: the root alone)
        result = target.verify(tree)      # one target pass; accepted path + bonus token
        drafter.observe(result, tree)     # the draft keeps the accepted path's K/V
        emit(result.tokens)               # cut at EOS / stop string / max_new_tokens
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.drafting.chain_drafter import ChainDrafter
from tandem.drafting.tree_drafter import TreeDrafter, tree_rows
from tandem.runtime.runner import ModelRunner, runner_for
from tandem.tree.draft_tree import DraftTree, ancestor_mask
from tandem.verify.sampling import probs_from_logits
from tandem.verify.verifier import VerifyResult, greedy_accept, rejection_accept, replay_accept

METHODS = ("auto", "ar", "chain", "tree", "async")


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens (EOS included when generation stopped on it)
    prompt_tokens: int
    method: str
    target_passes: int
    draft_steps: int
    accept_lengths: list[int]  # accepted draft tokens per target pass (bonus excluded)
    seconds: float
    ttft: float  # seconds from start to the first new token
    finish_reason: str  # eos | length | stop
    stop_trimmed_text: str | None = None  # text cut before the stop string, when one matched
    per_depth: list[tuple[int, int]] = field(default_factory=list)  # (offered, accepted) per depth 1..
    # seconds spent drafting and verifying over the request (serial loop: device time between
    # CUDA events on the GPU, host time on the CPU; None where not measured)
    draft_seconds: float | None = None
    verify_seconds: float | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tau(self) -> float:
        """Tokens committed per target verification pass, bonus included (1.0 for ar)."""
        return self.new_tokens / max(1, self.target_passes)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first (excludes prefill)."""
        dt = self.seconds - self.ttft
        return (self.new_tokens - 1) / dt if dt > 0 and self.new_tokens > 1 else 0.0


@dataclass
class Launch:
    """A target pass in flight: the tree, its per-node output, and the event marking its end."""

    tree: DraftTree
    out: torch.Tensor | None  # [n] argmax (greedy, replay) or [n, vocab] probs; None: not run yet
    event: torch.cuda.Event | None = None
    forced: int | None = None  # acceptance replay: accept count taken from a trace
    start: torch.cuda.Event | None = None  # recorded before the pass on the stream (busy time)


class Target:
    """The target model's side of verification: one pass over a tree, accept, commit the path.

    `verify(tree)` is `finish(launch(tree))`. The split serves the async workers: on a CUDA
    `stream` the pass is queued and an event marks its end (`ready` polls it) while the draft
    keeps working; `deferred` queues nothing until `finish` (the deterministic inline transport).
    """

    def __init__(self, runner: ModelRunner, sampling: SamplingConfig, generator: torch.Generator,
                 stream: torch.cuda.Stream | None = None, deferred: bool = False):
        self.runner, self.sampling, self.generator = runner, sampling, generator
        self.stream, self.deferred = stream, deferred
        # seconds the target was busy verifying: stream time between two events on a CUDA
        # stream, host time of the pass and the accept otherwise (the async timeline)
        self.busy_s = 0.0
        self.path_features: torch.Tensor | None = None  # [accepted + 1, F] of the last pass, see finish

    def ctx(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def launch(self, tree: DraftTree, now: bool = False, forced: int | None = None) -> Launch:
        if self.deferred and not now:
            return Launch(tree, None, forced=forced)
        prefix = self.runner.cache.prefix_len
        start = None
        with self.ctx():
            if self.stream is not None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            logits = self.runner.step(tree.tokens, [prefix + d for d in tree.depth],
                                      ancestor_mask(tree.parents))  # [n, vocab]
            greedy = self.sampling.greedy or forced is not None
            if greedy:  # a graph step computed the argmax already (one launch less)
                out = self.runner.last_argmax if self.runner.last_argmax is not None else logits.argmax(-1)  # [n]
            else:
                out = probs_from_logits(logits, self.sampling)  # [n, V]
            event = None
            if self.stream is not None:
                if greedy:
                    out = out.to("cpu", non_blocking=True)  # read only after the event
                event = torch.cuda.Event(enable_timing=True)
                event.record(self.stream)
        return Launch(tree, out, event, forced, start)

    def ready(self, launch: Launch) -> bool:
        return launch.event is None or launch.event.query()

    def finish(self, launch: Launch) -> VerifyResult:
        t0 = time.perf_counter()
        if launch.out is None:
            launch = self.launch(launch.tree, now=True, forced=launch.forced)
        if launch.event is not None:
            launch.event.synchronize()
        if launch.start is not None:
            self.busy_s += launch.start.elapsed_time(launch.event) / 1e3
            t0 = time.perf_counter()  # the pass itself was timed on the stream
        tree = launch.tree
        with self.ctx():
            if launch.forced is not None:
                result = replay_accept(tree, launch.out.tolist(), launch.forced)
            elif self.sampling.greedy:
                result = greedy_accept(tree, launch.out.tolist())
            else:
                if tree.q is not None and tree.q.shape[-1] != launch.out.shape[-1]:
                    tree.q = _pad_vocab(tree.q, launch.out.shape[-1])
                result = rejection_accept(tree, launch.out, self.generator)
            if self.runner.last_features is not None:
                # the accepted path's target features [accepted + 1, F] (feature drafters read them);
                # gathered now: the runner's buffer is overwritten by the next pass
                self.path_features = self.runner.last_features[result.path]
            self.runner.cache.commit(result.path)
        self.busy_s += time.perf_counter() - t0
        return result

    def verify(self, tree: DraftTree, forced_accept: int | None = None) -> VerifyResult:
        """One pass over the tree; `forced_accept` replays a recorded acceptance (simulated)."""
        return self.finish(self.launch(tree, now=True, forced=forced_accept))


def _pad_vocab(q: torch.Tensor, v: int) -> torch.Tensor:
    out = torch.zeros(q.shape[0], v, dtype=q.dtype, device=q.device)
    n = min(v, q.shape[-1])
    out[:, :n] = q[:, :n]
    return out


class Emitter:
    """Cuts committed tokens at EOS / stop string / max_new_tokens, streams them and records the
    per-pass figures; the serial loop and the async workers both emit through it."""

    def __init__(self, max_new: int, eos: set[int], gen: GenerationConfig, tokenizer, on_tokens, t0: float):
        self.max_new, self.eos, self.gen, self.tokenizer, self.on_tokens, self.t0 = \
            max_new, eos, gen, tokenizer, on_tokens, t0
        self.out: list[int] = []
        self.accept_lengths: list[int] = []
        self.per_depth: dict[int, list[int]] = {}  # depth -> [passes offering it, passes accepting it]
        self.ttft = 0.0
        self.finish = "length"
        self.stop_text: str | None = None

    def emit(self, tree: DraftTree, result: VerifyResult) -> bool:
        """Record one pass; returns True when generation is over."""
        self.accept_lengths.append(result.accepted)
        depth = tree.depth
        for k in {depth[i] for i in range(1, len(tree))}:  # per depth: offered, and accepted that deep
            rec = self.per_depth.setdefault(k, [0, 0])
            rec[0] += 1
            rec[1] += int(result.accepted >= k)
        new = result.tokens[: self.max_new - len(self.out)]
        for i, t in enumerate(new):
            if t in self.eos:
                new, self.finish = new[: i + 1], "eos"
                break
        self.out += new
        if not self.ttft:
            self.ttft = time.perf_counter() - self.t0
        if self.on_tokens is not None:
            self.on_tokens(new)
        if self.finish == "eos":
            return True
        if self.gen.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(self.out)
            hit = min((text.find(s) for s in self.gen.stop if s in text), default=-1)
            if hit >= 0:
                self.finish, self.stop_text = "stop", text[:hit]
                return True
        return len(self.out) >= self.max_new

    def result(self, cls: type[GenerationResult], method: str, prompt_len: int, seconds: float, draft_steps: int,
               **extra) -> GenerationResult:
        return cls(token_ids=self.out, prompt_tokens=prompt_len, method=method,
                   target_passes=len(self.accept_lengths), draft_steps=draft_steps,
                   accept_lengths=self.accept_lengths, seconds=seconds, ttft=self.ttft, finish_reason=self.finish,
                   stop_trimmed_text=self.stop_text,
                   per_depth=[(v[0], v[1]) for _, v in sorted(self.per_depth.items())], **extra)


class PassClock:
    """Draft and verify time of every pass without stalling the loop: CUDA events recorded on the
    stream (read once, after the request's final sync), host time on the CPU. `mark()` is called
    before the draft, between draft and verify, and after the verify."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def totals(self) -> tuple[float, float]:
        """(draft seconds, verify seconds) summed over the passes; call after a sync."""
        m = self.marks
        span = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)
        draft = sum(span(m[i], m[i + 1]) for i in range(0, len(m) - 2, 3))
        verify = sum(span(m[i + 1], m[i + 2]) for i in range(0, len(m) - 2, 3))
        return draft, verify


def replayed_accept(forced_accepts: list[int] | None, pass_index: int) -> int | None:
    """Acceptance replay: the accept count of target pass `pass_index`, cycling through the
    recorded list (None: no replay; an empty list accepts nothing)."""
    if forced_accepts is None:
        return None
    return forced_accepts[pass_index % len(forced_accepts)] if forced_accepts else 0


class Generator:
    """Holds a target (and optional draft) model and decodes one request at a time."""

    def __init__(self, target_model, draft_model=None, tokenizer=None, use_graphs: bool | None = None):
        self.target_model, self.draft_model, self.tokenizer = target_model, draft_model, tokenizer
        self.use_graphs = use_graphs
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

    def _drafter(self, method: str, spec: SpecConfig, sampling: SamplingConfig, g: torch.Generator, capacity: int):
        """The drafter for `method` over this Generator's draft: a small draft model (chain, tree)
        or a parallel block drafter (its lattice: best path for chain, best-first tree for tree)."""
        from tandem.models.block_drafter import BlockDrafter
        from tandem.models.eagle3 import Eagle3Head

        if isinstance(self.draft_model, Eagle3Head):
            from tandem.drafting.eagle_drafter import EagleDrafter

            runner = self._runner("draft", self.draft_model, capacity + EagleDrafter.rows_needed(spec))
            return EagleDrafter(runner, spec, chain=method == "chain")
        if isinstance(self.draft_model, BlockDrafter):
            from tandem.drafting.lattice_drafter import LatticeDrafter

            block = self.draft_model.bconfig.block_size
            runner = self._runner("draft", self.draft_model.lattice_model(), capacity + 2 * block + spec.nodes + spec.k)
            return LatticeDrafter(runner, spec, chain=method == "chain")
        draft_runner = self._runner("draft", self.draft_model, capacity + spec.nodes + spec.k + tree_rows(spec))
        if method == "tree":
            return TreeDrafter(draft_runner, spec)
        if sampling.greedy:
            # a greedy chain is the best-first tree of width 1: k nodes, k - 1 of them fed, so
            # it runs on the device rounds too (one host sync per chain instead of k - 1)
            return TreeDrafter(draft_runner, SpecConfig(method="tree", nodes=spec.k, width=1, depth=spec.k - 1))
        # a sampled chain keeps each token's draft distribution q for rejection sampling
        return ChainDrafter(draft_runner, sampling, spec.k, g)

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
        if getattr(self.target_model, "is_hybrid", False):  # Qwen3.5: recurrent layers (runtime/hybrid.py)
            if not sampling.greedy:
                raise ConfigError("hybrid targets (Qwen3.5) decode greedily for now; use --temperature 0")
            if method not in ("auto", "ar", "chain", "tree"):
                raise ConfigError(f"hybrid targets (Qwen3.5) run ar, chain and tree, not {method!r}")
            from tandem.runtime.hybrid import generate_hybrid

            return generate_hybrid(self.target_model, prompt_ids, ("tree" if self.draft_model is not None else "ar") if method == "auto" else method,
                                   self.draft_model, spec, gen, self.tokenizer, on_tokens, use_graphs=self.use_graphs)
        if method == "auto":  # the measured fastest method (tandem.runtime.auto); --method overrides
            if (tensor_parallel_size, draft_tensor_parallel_size) != (1, 1) or split_search is not None:
                raise ConfigError("--tensor-parallel-size / --split-search need --method async, not auto")
            if len(prompt_ids) >= self.context_window:
                raise ConfigError(f"prompt is {len(prompt_ids)} tokens but the context window is "
                                  f"{self.context_window}; shorten the prompt")
            chosen = self.auto.choose(self, prompt_ids, spec, sampling)
            res = self.generate(prompt_ids, chosen, spec, sampling, gen, on_tokens=on_tokens,
                                forced_accepts=forced_accepts)
            self.auto.update(chosen, res.decode_tokens_per_s)
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
        if method == "async" and getattr(self.draft_model, "econfig", None) is not None:
            raise ConfigError("--method async runs a draft model; an EAGLE-3 head drafts from the target's features: "
                              "use --method tree or chain with it")
        if method == "async" and getattr(self.draft_model, "bconfig", None) is not None:
            raise ConfigError("--method async runs a draft model; a block drafter already drafts in one pass "
                              "per verify: use --method tree or chain with it")
        if method == "async":  # SwiftSpec: draft and target as separate workers (runtime/async_decode.py)
            from tandem.runtime.async_decode import generate_async

            return generate_async(self.target_model, self.draft_model, prompt_ids, spec, sampling,
                                  dataclasses.replace(gen, max_new_tokens=max_new), eos, transport=transport,
                                  on_tokens=on_tokens, tokenizer=self.tokenizer, use_graphs=self.use_graphs,
                                  runners=self._runners, forced_accepts=forced_accepts,
                                  tensor_parallel_size=tensor_parallel_size,
                                  draft_tensor_parallel_size=draft_tensor_parallel_size)
        slack = {"ar": 1, "chain": spec.k + 1, "tree": spec.nodes + 1 + spec.width * (spec.resolved_depth() + 1)}[method]
        capacity = len(prompt_ids) + max_new + slack + 1
        g = torch.Generator().manual_seed(sampling.seed)
        drafter = None if method == "ar" else self._drafter(method, spec, sampling, g, capacity)
        features = getattr(drafter, "needs_features", False)
        if features:  # before the target's runner captures its graphs: they must write the features
            self.target_model.enable_features(drafter.feature_layers)
        target = Target(self._runner("target", self.target_model, capacity), sampling, g)
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
