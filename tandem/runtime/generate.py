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

METHODS = ("ar", "chain", "tree", "async")


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
            out = logits.argmax(-1) if greedy else probs_from_logits(logits, self.sampling)  # [n] | [n, V]
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
        if method != "ar" and self.draft_model is None:
            raise ConfigError(f"method {method!r} needs a draft model; pass --draft DIR or use --method ar")
        if ((tensor_parallel_size, draft_tensor_parallel_size) != (1, 1) or split_search) and method != "async":
            raise ConfigError(f"--tensor-parallel-size / --draft-tensor-parallel-size / --split-search work with "
                              f"--method async (its process transports), not {method!r}")
        if split_search:
            if (tensor_parallel_size, draft_tensor_parallel_size) != (1, 1):
                raise ConfigError("give either --split-search K or the two tensor-parallel sizes, not both")
            tensor_parallel_size, draft_tensor_parallel_size = self._split(split_search, prompt_ids, spec, transport)
        ctx = self.context_window
        if len(prompt_ids) >= ctx:
            raise ConfigError(
                f"prompt is {len(prompt_ids)} tokens but the context window is {ctx}; shorten the prompt")
        max_new = min(gen.max_new_tokens, ctx - len(prompt_ids))
        eos = set() if gen.ignore_eos else set(self.target_model.config.eos_token_ids)
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
        target = Target(self._runner("target", self.target_model, capacity), sampling, g)
        drafter = None
        if method != "ar":
            draft_runner = self._runner("draft", self.draft_model, capacity + spec.nodes + spec.k + tree_rows(spec))
            if method == "tree":
                drafter = TreeDrafter(draft_runner, spec)
            elif sampling.greedy:
                # a greedy chain is the best-first tree of width 1: k nodes, k - 1 of them fed, so
                # it runs on the device rounds too (one host sync per chain instead of k - 1)
                drafter = TreeDrafter(draft_runner, SpecConfig(method="tree", nodes=spec.k, width=1, depth=spec.k - 1))
            else:  # a sampled chain keeps each token's draft distribution q for rejection sampling
                drafter = ChainDrafter(draft_runner, sampling, spec.k, g)
            drafter.start(prompt_ids)

        t0 = time.perf_counter()
        target.runner.prefill(prompt_ids[:-1])
        emitter = Emitter(max_new, eos, gen, self.tokenizer, on_tokens, t0)
        root = prompt_ids[-1]
        while True:
            tree = drafter.propose() if drafter is not None else DraftTree.chain([root])  # ar: the root alone
            result = target.verify(tree, replayed_accept(forced_accepts, len(emitter.accept_lengths)))
            if drafter is not None:
                drafter.observe(result, tree)
            if emitter.emit(tree, result):
                break
            root = result.bonus
        if self.target_model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return emitter.result(GenerationResult, method, len(prompt_ids), seconds, drafter.steps if drafter else 0)
