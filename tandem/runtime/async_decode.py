"""Method `async`: disaggregated asynchronous tree decoding (SwiftSpec s3.1, Algorithm 1).

A draft worker and a target worker run at the same time. The draft loop, shared by every
transport, reads like Algorithm 1:

    tree = draft.prepare()                 # grow until the tree is as deep as serial's, select the best N
    while True:
        link.submit(tree)                  # the target starts verifying [root + N nodes]
        draft.overlap(link.ready)          # d rounds of expanding the w best candidates meanwhile
        verified = link.result()           # accepted tokens + bonus (None: generation is over)
        draft.receive(verified)            # re-root the evolving tree cache (no K/V recomputed)
        tree = draft.prepare()

The target side verifies one tree per pass with the tree mask, accepts (greedy walk, or
recursive rejection sampling with point-mass proposals: the best-first tree is a function of
the draft's state only, never of the target's random numbers, so sampling stays lossless),
commits the root and accepted path to its KV cache and answers with `VerifyResult.tokens`.

Transports (one code path; only the `link` differs):
- "inline": one process, deterministic: exactly d expansion rounds, then the verify. Tests.
- "streams": one process, two CUDA streams. The verify is launched on the target stream and an
  event recorded; the draft's d rounds go to its own stream as d replays of one captured round
  (tandem.drafting.device_rounds), so both run on the GPU at once and the host waits once.
  (With host-driven rounds, `device_rounds=False`, the draft instead expands round by round
  while `event.query()` is False.)
- "gloo" / "nccl": processes over torch.distributed (this process is rank 0, the target's
  leader; with --tensor-parallel-size X, ranks 1..X-1 hold the other target shards; rank X is
  the draft's leader and, with --draft-tensor-parallel-size Y, ranks X+1..X+Y-1 its other
  shards). The workers start once per engine and serve its later requests (a worker pool kept
  beside the runners); see tandem.runtime.workers.
- "auto": streams on CUDA, inline on CPU.

Self-tuning (SwiftSpec s3.1.3): t_target(N + 1 rows) and t_draft(w rows) are profiled with the
runners; d = max(1, floor(t_target / t_draft)); the trial runs 16 passes with d, 16 with d + 1
and 16 with d = 0 (the serial tree loop), and keeps the smallest d within 5% of the fastest
(tokens per second), so overlapping is kept only where it pays. The trial is paid once per engine
(the controller lives beside the runners). spec.depth overrides all this.

Collapse guard (summary s8): when few verified tokens are found in the draft tree (a sliding
window over passes of tokens-in-tree / tokens-verified), the tree grown while the target
verifies is wasted and, on one GPU, competes with the target: d drops to 0 and the tree shrinks
to the root's w children (one draft step per pass instead of depth + 1), and both come back
when hits recover.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.generate import Emitter, GenerationResult, Launch, Target, replayed_accept
from tandem.runtime.runner import ModelRunner, runner_for
from tandem.runtime.timing import median_seconds
from tandem.tree.draft_tree import DraftTree
from tandem.drafting.evolving import EvolvingTree

TRANSPORTS = ("auto", "inline", "streams", "gloo", "nccl")
POOL_TOKENS = 2048  # prompt + new tokens a worker pool's caches hold at least (a longer request restarts it)


@dataclass
class AsyncGenerationResult(GenerationResult):
    """GenerationResult plus the async timeline (`stats`: depth choice, hits, reuse, waits)."""

    stats: dict = field(default_factory=dict)


# ---- depth control: self-tuning and the collapse guard ------------------------------------
@dataclass
class DepthController:
    """d, the expansion rounds the draft may run while one target pass is in flight."""

    depth: int
    fixed: bool = False  # spec.depth given: no trial
    candidates: tuple[int, ...] = ()
    trial_passes: int = 16  # per candidate; accept lengths vary a lot from pass to pass
    margin: float = 0.05  # a larger d must be this much faster to be chosen
    window: int = 8  # passes in the collapse detector's window
    low: float = 0.25  # collapse when the in-tree rate over the window falls below this
    high: float = 0.5  # ... and recover when it comes back to this
    verbose: bool = False
    collapsed: bool = False
    events: list[str] = field(default_factory=list)
    _trial: dict[int, list] = field(default_factory=dict)  # d -> [tokens, seconds, passes]
    _chosen: bool = False
    _hits: deque = field(default_factory=deque)
    _saved: int = 0
    _skip: bool = True

    @classmethod
    def tuned(cls, t_target: float, t_draft: float, depth: int | None = None, verbose: bool = False,
              serial_guard: bool = True, **kw) -> DepthController:
        """d = max(1, floor(t_target / t_draft)); the trial tries d, d + 1 and, with
        `serial_guard`, also d = 0: no expansion while the target verifies, i.e. the serial tree
        loop, kept if overlapping does not pay (one GPU shared by both streams can make it so;
        inline, the rounds are never hidden)."""
        if depth is not None:
            return cls(depth=depth, fixed=True, verbose=verbose, **kw)
        d = max(1, math.floor(t_target / max(t_draft, 1e-9)))
        cands = (d, d + 1, 0) if serial_guard else (d, d + 1)
        ctl = cls(depth=d, candidates=cands, verbose=verbose, **kw)
        ctl._say(f"t_target={t_target * 1e3:.3f} ms, t_draft={t_draft * 1e3:.3f} ms -> trying "
                 + ", ".join(f"d={c}" for c in cands))
        return ctl

    def new_request(self) -> None:
        """The controller outlives requests (the trial is a start-up cost, paid once per engine);
        a request's first pass also grows the first tree from nothing, so it is no trial sample."""
        self._skip = True

    def observe(self, tokens: int, seconds: float, in_tree: int) -> None:
        """One target pass answered: `tokens` verified, `in_tree` of them found along the draft
        tree (accepted tokens, and the bonus when the draft had grown it), `seconds` since the
        previous answer."""
        skip, self._skip = self._skip, False
        if self.candidates and not self.fixed and not self.collapsed and not self._chosen and not skip:
            rec = self._trial.setdefault(self.depth, [0.0, 0.0, 0])  # tokens, seconds, passes
            rec[0] += tokens
            rec[1] += seconds
            rec[2] += 1
            if rec[2] >= self.trial_passes:
                nxt = [d for d in self.candidates if d not in self._trial]
                if nxt:
                    self.depth = nxt[0]
                else:
                    rate = {d: r[0] / max(r[1], 1e-9) for d, r in self._trial.items()}
                    # NOTE: per-pass token counts vary a lot, so the trial's rates are noisy; the
                    # smallest d within `margin` of the best wins (fewer rounds, less contention)
                    best = max(rate.values())
                    self.depth = min(d for d in self.candidates if rate[d] * (1 + self.margin) >= best)
                    self._chosen = True
                    self._say("trial " + ", ".join(f"d={d}: {rate[d]:.1f} tok/s" for d in self.candidates)
                              + f" -> d={self.depth}")
        self._hits.append((in_tree, tokens))
        if len(self._hits) > self.window:
            self._hits.popleft()
        if len(self._hits) == self.window:
            rate = sum(h for h, _ in self._hits) / max(1, sum(t for _, t in self._hits))
            if not self.collapsed and rate < self.low:
                self.collapsed, self._saved, self.depth = True, self.depth, 0
                self._say(f"collapse: only {rate:.0%} of the tokens verified in the last {self.window} passes "
                          f"were in the draft tree; falling back to the serial loop (d=0) with the root's "
                          f"children only")
                self._hits.clear()
            elif self.collapsed and rate >= self.high:
                self.collapsed, self.depth = False, self._saved
                self._say(f"recovered: in-tree rate {rate:.0%}; d={self.depth}")
                self._hits.clear()

    def _say(self, msg: str) -> None:
        self.events.append(msg)
        if self.verbose:
            print(f"tandem async: {msg}", file=sys.stderr)

    def summary(self) -> dict:
        return {"depth": self.depth, "fixed": self.fixed, "candidates": list(self.candidates),
                "collapsed": self.collapsed, "events": list(self.events)}


# ---- profiling ------------------------------------------------------------------------------
def time_step(runner: ModelRunner, rows: int, repeats: int = 5) -> float:
    """Median seconds of one runner step of `rows` rows; the cache is left as it was."""
    cache = runner.cache
    saved = cache.tree_len

    def step() -> None:
        base = cache.tree_len
        mask = torch.zeros(rows, base + rows, dtype=torch.bool)
        mask[:, base:] = torch.ones(rows, rows, dtype=torch.bool).tril()
        runner.step([0] * rows, list(range(cache.length, cache.length + rows)), mask)
        cache.tree_len = saved  # NOTE: drop the profiling rows; they are overwritten later

    # the first two runs warm up (graph capture, allocator)
    return median_seconds(runner.device, step, repeats, warmup=2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the two workers --------------------------------------------------------------------------
class DraftWorker:
    """The draft side of Algorithm 1 around an EvolvingTree (the evolving tree cache)."""

    def __init__(self, runner: ModelRunner, spec: SpecConfig, tree_rows: int, inline: bool = False,
                 stream: torch.cuda.Stream | None = None):
        self.tree = EvolvingTree(runner, spec.width, max_rows=tree_rows)
        self.nodes = spec.nodes
        # fed nodes a tree must have before it is sent: serial `tree`'s work per tree (depth
        # rounds of width, depth's default; tandem.drafting.tree_drafter), so async offers trees
        # as deep as serial `tree` does. (spec.depth means d, the rounds run while the target
        # verifies, here.)
        rounds = dataclasses.replace(spec, depth=None).resolved_depth()
        self.fed = min(rounds * spec.width, tree_rows - spec.width)
        self.inline = inline  # exactly d rounds per pass (deterministic), no readiness polling
        self.stream = stream
        self.ctl: DepthController | None = None
        self.rounds: list[int] = []  # expansion rounds run while each pass was in flight
        self.hits = 0
        self.reused: list[int] = []  # fed nodes kept by each re-root
        self.expand_s: list[float] = []  # per pass: seconds spent expanding while the target verified
        self.pass_wait_s: list[float] = []  # per pass: seconds blocked on the answer afterwards
        self.busy_s = 0.0  # host seconds in draft work: growing, expanding, re-rooting
        self.sent: list[int] = []  # draft nodes in each tree sent to the target
        # acceptance replay (simulated acceptance): the target's bonus token is meaningless, so
        # `receive` swaps it for the draft's most probable unsent child of the last accepted node
        # when there is one (see `replay_bonus`): the best case for tree reuse, reported as such
        self.replay = False
        self._sent: DraftTree | None = None
        self._last = 0.0

    def ctx(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def profile(self) -> float:
        """t_draft(w): seconds of one expansion round (w rows)."""
        with self.ctx():
            return time_step(self.tree.runner, self.tree.width)

    def start(self, prompt: list[int]) -> None:
        """Feed the prompt; its last token is the root."""
        with self.ctx():
            self.tree.start(prompt)
            self.tree.feed_pending()

    def prepare(self) -> DraftTree:
        """Grow while the tree has too few nodes, then select the best N-node subtree."""
        t0 = time.perf_counter()
        nodes, fed = self.nodes, self.fed
        if self.ctl is not None and self.ctl.collapsed:
            # drafting fails: offer only the root's w children (no expansion round), which costs
            # one draft step per pass, and watch for the hits that end the collapse
            nodes, fed = self.tree.width, 0
        with self.ctx():
            self.tree.grow(nodes, fed)
            tree = self.tree.select(nodes)
        self.sent.append(len(tree) - 1)
        self._last = self._last or time.perf_counter()
        self._sent = tree
        self.busy_s += time.perf_counter() - t0
        return tree

    def overlap(self, ready: Callable[[], bool]) -> None:
        """Expand the w most probable candidates, round after round, while the target verifies."""
        d = self.ctl.depth if self.ctl else 0
        n = 0
        t0 = time.perf_counter()
        with self.ctx():
            if self.tree.device_rounds:
                # all d rounds at once on the draft's stream, one sync at the end: on a GPU they
                # run beside the target's pass instead of waiting on the host between rounds
                n = self.tree.expand_rounds(d)
            else:
                while n < d and (self.inline or not ready()):
                    if not self.tree.expand():
                        break
                    n += 1
        self.rounds.append(n)
        self.expand_s.append(time.perf_counter() - t0)
        self.busy_s += time.perf_counter() - t0

    def receive(self, verified: list[int]) -> None:
        now = time.perf_counter()
        if self.replay:
            verified = replay_bonus(self.tree, self._sent, verified)
        with self.ctx():
            r = self.tree.reroot(verified)
        self.busy_s += time.perf_counter() - now
        self.hits += r.hit
        self.reused.append(r.reused)
        if self.ctl is not None:
            self.ctl.observe(len(verified), now - self._last, r.matched)
        self._last = now

    def stats(self) -> dict:
        n = max(1, len(self.rounds))
        return {"draft_steps": self.tree.steps, "rounds": self.rounds, "mean_rounds": sum(self.rounds) / n,
                "hit_rate": self.hits / max(1, len(self.reused)), "reused": self.reused,
                "mean_reused": sum(self.reused) / max(1, len(self.reused)), "draft_wait_s": sum(self.pass_wait_s),
                "expand_s": self.expand_s, "pass_wait_s": self.pass_wait_s, "draft_busy_s": self.busy_s,
                "sent_nodes": self.sent,
                "controller": self.ctl.summary() if self.ctl else None}


def replay_bonus(tree: EvolvingTree, sent: DraftTree | None, verified: list[int]) -> list[int]:
    """Acceptance replay: `verified` with its bonus replaced by the draft's most probable child
    of the last accepted node that was not sent to the target (a real target's bonus can only
    hit the tree there: a sent child would have been accepted); unchanged if there is none."""
    if sent is None:
        return verified
    node, snode = 0, 0
    children, schildren = tree.children(), sent.children()
    for t in verified[:-1]:
        node = next((c for c in children[node] if tree.tokens[c] == t), -1)
        snode = next((c for c in schildren[snode] if sent.tokens[c] == t), -1)
        if node < 0 or snode < 0:
            return verified
    offered = {sent.tokens[c] for c in schildren[snode]}
    unsent = [c for c in children[node] if tree.tokens[c] not in offered]
    if not unsent:
        return verified
    best = max(unsent, key=lambda c: (tree.logp[c], -c))
    return verified[:-1] + [tree.tokens[best]]


class TargetWorker(Target):
    """Verifies one tree per pass (generate.Target: launch / ready / finish), plus profiling.

    With a tensor-parallel target every shard runs one of these on its slice of the model and
    verifies every tree (tandem.runtime.workers); only the leader answers the draft.
    """

    def profile(self, nodes: int) -> float:
        with self.ctx():
            return time_step(self.runner, nodes + 1)


# ---- in-process links ------------------------------------------------------------------------
class LocalLink:
    """The draft's view of a target in the same process (inline and streams)."""

    def __init__(self, target: TargetWorker, emitter: Emitter, forced_accepts: list[int] | None = None):
        self.target, self.emitter, self.forced_accepts = target, emitter, forced_accepts
        self._launch: Launch | None = None

    def submit(self, tree: DraftTree) -> None:
        forced = replayed_accept(self.forced_accepts, len(self.emitter.accept_lengths))
        self._launch = self.target.launch(tree, forced=forced)

    def ready(self) -> bool:
        return self._launch is not None and self.target.ready(self._launch)

    def result(self) -> list[int] | None:
        launch, self._launch = self._launch, None
        result = self.target.finish(launch)
        return None if self.emitter.emit(launch.tree, result) else result.tokens


def draft_loop(draft: DraftWorker, link) -> None:
    """Algorithm 1, the same for every transport (`link`: submit / ready / result)."""
    tree = draft.prepare()
    while True:
        link.submit(tree)
        draft.overlap(link.ready)
        t0 = time.perf_counter()
        verified = link.result()
        draft.pass_wait_s.append(time.perf_counter() - t0)
        if verified is None:
            return
        draft.receive(verified)
        tree = draft.prepare()


# ---- entry point -------------------------------------------------------------------------------
def plan_capacity(prompt_len: int, max_new: int, spec: SpecConfig) -> tuple[int, int, int]:
    """(target rows, draft rows, draft tree-region rows)."""
    tree_rows = max(2 * spec.nodes, spec.nodes + 16 * spec.width) + spec.width
    target = prompt_len + max_new + spec.nodes + 2
    return target, target + tree_rows + 1, tree_rows


def generate_async(target_model, draft_model, prompt_ids: list[int], spec: SpecConfig, sampling: SamplingConfig,
                   gen: GenerationConfig, eos_ids: set[int], transport: str = "auto",
                   on_tokens: Callable[[list[int]], None] | None = None, tokenizer=None, *,
                   verbose: bool = True, use_graphs: bool | None = None,
                   timeout_s: float | None = None, runners: dict | None = None,
                   forced_accepts: list[int] | None = None, tensor_parallel_size: int = 1,
                   draft_tensor_parallel_size: int = 1) -> AsyncGenerationResult:
    """Decode one request with method `async`; the output matches the serial loop's contract.

    Greedy output is token-identical to `ar`; with sampling every committed token is distributed
    as sampling from the target (per seed the tokens can differ between transports, since the
    tree sent depends on how far the draft got while the target was busy).

    Keyword-only extras: `verbose` prints the depth choice to stderr; `runners` is a dict the
    caller keeps between calls so the in-process transports reuse runners and CUDA graphs, and
    the process transports their worker pool (started once, reused by later requests; without
    `runners` the pool lives for this call only); `timeout_s` (seconds any one exchange with a
    worker may take; default env TANDEM_WORKER_TIMEOUT, else 30) is for the process transports;
    `forced_accepts` is acceptance replay (see Generator.generate and `replay_bonus`);
    `tensor_parallel_size` / `draft_tensor_parallel_size` shard the target / the draft over that
    many processes (gloo / nccl transports; tandem.parallel.tensor_parallel).
    """
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    spec.validate(), sampling.validate(), gen.validate()
    if not prompt_ids:
        raise ConfigError("the prompt is empty; give at least one token of text")
    if draft_model is None:
        raise ConfigError("method 'async' needs a draft model; pass --draft DIR or use --method ar")
    on_cuda = target_model.device.type == "cuda"
    if transport == "auto":
        transport = "streams" if on_cuda else "inline"
    if (tensor_parallel_size, draft_tensor_parallel_size) != (1, 1) and transport not in ("gloo", "nccl"):
        raise ConfigError(f"tensor parallelism (--tensor-parallel-size {tensor_parallel_size}, "
                          f"--draft-tensor-parallel-size {draft_tensor_parallel_size}) runs in processes; "
                          f"use --transport gloo (CPU) or nccl (GPUs), not {transport!r}")
    if transport == "streams" and not (on_cuda and draft_model.device.type == "cuda"):
        raise ConfigError("transport 'streams' needs both models on CUDA; use inline or gloo on CPU")
    ctx_len = min(target_model.config.max_position_embeddings, draft_model.config.max_position_embeddings)
    if len(prompt_ids) >= ctx_len:
        raise ConfigError(f"prompt is {len(prompt_ids)} tokens but the context window is {ctx_len}; shorten the prompt")
    # NOTE: N bounds the start-up profile's verify of N + 1 rows and the tree region (2N + 17w
    # rows): uncapped, --nodes 100000 allocated a ~10 GB mask before the first token
    spec, _ = spec.capped(ctx_len)
    max_new = min(gen.max_new_tokens, ctx_len - len(prompt_ids))
    eos = set() if gen.ignore_eos else set(eos_ids)
    t_rows, d_rows, tree_rows = plan_capacity(len(prompt_ids), max_new, spec)
    generator = torch.Generator().manual_seed(sampling.seed)

    with torch.no_grad():  # NOTE: not inference_mode: runners (and their caches) outlive this call
        if transport in ("gloo", "nccl"):
            from tandem.runtime.workers import run_process_pair

            # a pool outlives the request: size its caches for a longer one too (up to POOL_TOKENS)
            pool_rows = plan_capacity(0, max(len(prompt_ids) + max_new, min(ctx_len, POOL_TOKENS)), spec)
            return run_process_pair(target_model, draft_model, prompt_ids, spec, sampling, gen, eos, max_new,
                                    transport, on_tokens, tokenizer, generator, pool_rows,
                                    verbose=verbose, use_graphs=use_graphs,
                                    timeout_s=timeout_s, tp=tensor_parallel_size, dp=draft_tensor_parallel_size,
                                    runners=runners, forced_accepts=forced_accepts)
        streams = transport == "streams"
        t_stream = torch.cuda.Stream(device=target_model.device) if streams else None
        d_stream = torch.cuda.Stream(device=draft_model.device) if streams else None
        target = TargetWorker(runner_for(runners, "target", target_model, t_rows, use_graphs), sampling, generator,
                              stream=t_stream, deferred=not streams)
        draft = DraftWorker(runner_for(runners, "draft", draft_model, d_rows, use_graphs), spec, tree_rows,
                            inline=not streams, stream=d_stream)
        # NOTE: profiling and graph capture happen before the clock starts, as the serial loop
        # builds its runners before its clock; a server would do both once, not per request.
        _warm_buckets(target.runner, draft.tree.runner, spec, len(prompt_ids))
        # Self-tuning once per engine: the controller (and its trial) lives in `runners` beside the
        # runners it measured; spec.depth given: nothing to tune, so nothing to profile.
        key = ("depth-controller", transport, spec.nodes, spec.width, spec.depth)
        ctl = runners.get(key) if runners is not None else None
        t_target = t_draft = 0.0
        if ctl is None:
            if spec.depth is None:
                t_target, t_draft = target.profile(spec.nodes), draft.profile()
            ctl = DepthController.tuned(t_target, t_draft, spec.depth, verbose=verbose)
            if runners is not None:
                runners[key] = ctl
        ctl.new_request()
        draft.ctl = ctl
        t0 = time.perf_counter()
        if len(prompt_ids) > 1:
            with target.ctx():
                target.runner.prefill(prompt_ids[:-1])
        draft.start(prompt_ids)
        emitter = Emitter(max_new, eos, gen, tokenizer, on_tokens, t0)
        draft.replay = forced_accepts is not None
        link = LocalLink(target, emitter, forced_accepts)
        draft_loop(draft, link)
        _sync(target_model.device)
        seconds = time.perf_counter() - t0
        stats = {"transport": transport, "t_target_s": t_target, "t_draft_s": t_draft, "seconds": seconds,
                 "target_busy_s": target.busy_s, **draft.stats()}
        return emitter.result(AsyncGenerationResult, "async", len(prompt_ids), seconds,
                              int(stats.get("draft_steps", 0)), stats=stats)


def _warm_buckets(target_runner: ModelRunner | None, draft_runner: ModelRunner | None, spec: SpecConfig,
                  prompt_len: int) -> None:
    """Capture the CUDA graphs the loop will need before the clock starts and before the two
    streams run concurrently: prefill, the verify of N + 1 rows and draft steps of 1..w rows,
    at every attention width the cache can reach. No effect on CPU."""
    for runner, sizes in ((target_runner, [max(1, prompt_len - 1), spec.nodes + 1]),
                          (draft_runner, [prompt_len] + list(range(1, spec.width + 1)))):
        if runner is not None and runner.use_graphs:
            runner.warmup(sizes, tuple(runner.widths()))
