"""The target's side of verification (Target: one pass over a tree, accept, commit the path),
shared by the serial loop and the async workers, and acceptance replay's accept count."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from tandem.config import SamplingConfig
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree, ancestor_mask
from tandem.verify.sampling import probs_from_logits
from tandem.verify.verifier import VerifyResult, greedy_accept, rejection_accept, replay_accept


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


def replayed_accept(forced_accepts: list[int] | None, pass_index: int) -> int | None:
    """Acceptance replay: the accept count of target pass `pass_index`, cycling through the
    recorded list (None: no replay; an empty list accepts nothing)."""
    if forced_accepts is None:
        return None
    return forced_accepts[pass_index % len(forced_accepts)] if forced_accepts else 0
