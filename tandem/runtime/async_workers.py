"""Method `async`'s workers (see tandem.runtime.async_decode for the method): the draft worker
over the evolving tree cache, the target worker, the depth controller (self-tuning and the
collapse guard), the one-process link and the draft loop every transport shares. The process
transports (tandem.runtime.workers) and the one-process run (async_decode) both import them."""
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

from tandem.config import SpecConfig
from tandem.drafting.evolving import EvolvingTree
from tandem.runtime.emit import Emitter
from tandem.runtime.result import GenerationResult
from tandem.runtime.runner import ModelRunner
from tandem.runtime.target import Launch, Target, replayed_accept
from tandem.runtime.timing import median_seconds
from tandem.tree.draft_tree import DraftTree


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
    """Verifies one tree per pass (target.Target: launch / ready / finish), plus profiling.

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


def _warm_buckets(target_runner: ModelRunner | None, draft_runner: ModelRunner | None, spec: SpecConfig,
                  prompt_len: int) -> None:
    """Capture the CUDA graphs the loop will need before the clock starts and before the two
    streams run concurrently: prefill, the verify of N + 1 rows and draft steps of 1..w rows,
    at every attention width the cache can reach. No effect on CPU."""
    for runner, sizes in ((target_runner, [max(1, prompt_len - 1), spec.nodes + 1]),
                          (draft_runner, [prompt_len] + list(range(1, spec.width + 1)))):
        if runner is not None and runner.use_graphs:
            runner.warmup(sizes, tuple(runner.widths()))
