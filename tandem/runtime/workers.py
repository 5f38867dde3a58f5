"""Method `async` over processes (transports "gloo" and "nccl").

Ranks (world = X + Y for an X-way target and a Y-way draft, SwiftSpec's x : k-x split):

    0            the calling process: the target's leader. It keeps the target model (CUDA
                 graphs and `on_tokens` streaming stay where the caller is), runs the target
                 loop and talks to the draft.
    1 .. X-1     the target's other shards (`target_shard_main`), spawned.
    X            the draft's leader (`draft_process_main`), spawned: the same `draft_loop` as
                 the in-process transports, with a `ProcessLink` whose `ready()` is a
                 non-blocking `irecv(...).is_completed()`.
    X+1 .. X+Y-1 the draft's other shards, spawned.

Shards of one model are SPMD: they compute the same logits after the all-reduces
(tandem.parallel.tensor_parallel), so they make the same decisions; what only a leader learns
goes to its shards by broadcast in the model's group (`TreeBroadcast`: each tree to the
target's shards; `DraftSync`: each pass's d and the target's answer to the draft's shards).

Messages between the two leaders are small fixed-size int64 tensors (CPU for gloo, the rank's
GPU for nccl):

    hello  target -> draft   [t_target_ns]
    tree   draft  -> target  [n, tokens[0:n], parents[0:n], 0...]        n = -1: the draft failed
    reply  target -> draft   [status, m, tokens[0:m], 0...]              status 0 go on, 1 done, -1 abort

Shutdown: spawned ranks ignore SIGINT (the caller owns the interrupt); the draft leader polls
its parent's liveness while it waits; on any error in the target loop (an exception,
KeyboardInterrupt, the draft's abort message or a process's death) rank 0 terminates every
spawned process, joins them and destroys the process group before re-raising, so no process
outlives the call. (A shard that dies inside a collective is noticed when the collective times
out, after `timeout_s`.)

NOTE: rank 0 calls `init_process_group` on the default group, so the caller must not have
one already.
"""
from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.config import ConfigError, SpecConfig
from tandem.runtime.async_decode import (
    AsyncGenerationResult,
    DepthController,
    DraftWorker,
    TargetWorker,
    _warm_buckets,
    draft_loop,
)
from tandem.runtime.generate import Emitter
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree

TARGET = 0  # the target leader; a tensor-parallel target adds ranks 1 .. tp-1, and the draft is rank tp
GO, DONE, ABORT = 0, 1, -1


class DraftWorkerError(RuntimeError):
    """The draft process failed; the message carries its traceback."""


# ---- messages: fixed-size int64 tensors (see the module docstring) ---------------------------
def encode_tree(tree: DraftTree | None, n: int) -> torch.Tensor:
    """[1 + 2n]: node count (-1: no tree), tokens, parents, zero padded; n = nodes per tree."""
    msg = torch.zeros(1 + 2 * n, dtype=torch.long)
    msg[0] = -1 if tree is None else len(tree)
    if tree is not None:
        msg[1:1 + len(tree)] = torch.tensor(tree.tokens)
        msg[1 + n:1 + n + len(tree)] = torch.tensor(tree.parents)
    return msg


def decode_tree(msg: list[int], n: int) -> DraftTree | None:
    k = msg[0]
    if k < 0:
        return None
    return DraftTree(tokens=msg[1:1 + k], parents=msg[1 + n:1 + n + k], logp=[0.0] * k)


def encode_reply(status: int, tokens: list[int], n: int) -> torch.Tensor:
    """[2 + n]: status, token count, the tokens (the target's answer), zero padded."""
    msg = torch.zeros(2 + n, dtype=torch.long)
    msg[0], msg[1] = status, len(tokens)
    if tokens:
        msg[2:2 + len(tokens)] = torch.tensor(tokens)
    return msg


def decode_reply(msg: list[int]) -> tuple[int, list[int]]:
    return msg[0], msg[2:2 + msg[1]]


class _Aborted(Exception):
    """The other side asked us to stop."""


class Channel:
    """Fixed-size message buffers and polled, non-blocking send/recv to the peer rank."""

    def __init__(self, peer: int, max_nodes: int, device: torch.device, peer_alive, timeout_s: float):
        self.peer = peer  # the other side's rank: the draft's for the target leader, 0 for the draft
        self.n = max_nodes  # nodes per tree, root included
        self.device = device
        self.peer_alive = peer_alive
        self.timeout_s = timeout_s

    def _buf(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.long, device=self.device)

    # ---- primitives ---------------------------------------------------------------------
    def wait(self, work: _Pending, what: str) -> None:
        """Wait for `work`, checking the peer is alive (never blocks forever)."""
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while not work.is_completed(0.02 if spins > 1000 else 0.0):
            spins += 1
            if spins > 1000 and spins % 8 == 0:
                if not self.peer_alive():
                    raise _PeerGone(f"peer process ended while waiting for {what}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {what} from the peer within {self.timeout_s:.0f} s")
        work.finish()

    def send(self, t: torch.Tensor, what: str) -> None:
        self.wait(_Pending(dist.isend(t, dst=self.peer), self.device.type != "cuda"), what)

    def post(self, size: int):
        buf = self._buf(size)
        return buf, _Pending(dist.irecv(buf, src=self.peer), self.device.type != "cuda")

    # ---- messages -------------------------------------------------------------------------
    def send_tree(self, tree: DraftTree | None) -> None:
        self.send(encode_tree(tree, self.n).to(self.device), "tree")

    def recv_tree(self) -> DraftTree:
        buf, work = self.post(1 + 2 * self.n)
        self.wait(work, "a draft tree")
        tree = decode_tree(buf.tolist(), self.n)
        if tree is None:
            raise _Aborted("the draft worker failed")
        return tree

    def send_reply(self, status: int, tokens: list[int]) -> None:
        self.send(encode_reply(status, tokens, self.n).to(self.device), "reply")

    def post_reply(self):
        return self.post(2 + self.n)


class _PeerGone(RuntimeError):
    pass


class _Pending:
    """A posted isend/irecv whose completion can be polled without blocking.

    NOTE: gloo's send/recv work only completes inside `wait()` (`is_completed()` stays False
    until then), so for gloo a daemon thread blocks in `wait()` (it releases the GIL) and sets
    an event. NCCL work is polled with `is_completed()` (a CUDA event query).
    """

    def __init__(self, work, threaded: bool):
        self.work = work
        self.error: BaseException | None = None
        self.done = threading.Event() if threaded else None
        if threaded:
            threading.Thread(target=self._run, daemon=True, name="tandem-p2p-wait").start()

    def _run(self) -> None:
        try:
            self.work.wait()
        except BaseException as e:  # noqa: BLE001 - reported by finish() in the calling thread
            self.error = e
        self.done.set()

    def is_completed(self, timeout: float = 0.0) -> bool:
        if self.done is None:
            return self.work.is_completed()
        return self.done.wait(timeout) if timeout > 0 else self.done.is_set()

    def finish(self) -> None:
        if self.done is None:
            self.work.wait()
        elif self.error is not None:
            raise self.error


class ProcessLink:
    """The draft's view of the target across processes (same interface as LocalLink)."""

    def __init__(self, chan: Channel):
        self.chan = chan
        self._buf = self._work = None

    def submit(self, tree: DraftTree) -> None:
        self._buf, self._work = self.chan.post_reply()  # posted first: the answer can land any time
        self.chan.send_tree(tree)

    def ready(self) -> bool:
        return self._work.is_completed()

    def result(self) -> list[int] | None:
        self.chan.wait(self._work, "the target's answer")
        status, tokens = decode_reply(self._buf.tolist())
        if status == ABORT:
            raise _Aborted("the target stopped")
        return None if status == DONE else tokens


# ---- rank 1: the draft process -------------------------------------------------------------
def draft_process_main(init_file: str, backend: str, model, device: str, prompt: list[int], spec: SpecConfig,
                       rows: tuple[int, int], use_graphs, verbose: bool, timeout_s: float, threads: int,
                       out: mp.Queue, tp: int = 1, dp: int = 1, rank: int | None = None) -> None:
    """A draft process: rank tp is the draft's leader (it talks to the target); with a
    tensor-parallel draft (dp > 1) ranks tp+1 .. tp+dp-1 are its other shards, which run the
    same draft loop on their slice (SPMD) and learn what the leader learns through `DraftSync`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller (rank 0) owns Ctrl-C and stops us
    torch.set_num_threads(threads)
    rank = tp if rank is None else rank
    leader = rank == tp
    parent = mp.parent_process()
    alive = (lambda: parent.is_alive()) if parent is not None else (lambda: True)
    chan = None
    try:
        dev, _, group = join_world(init_file, backend, rank, tp, dp, device, timeout_s)
        msg_dev = dev if backend == "nccl" else torch.device("cpu")
        if leader:
            chan = Channel(TARGET, spec.nodes + 1, msg_dev, alive, timeout_s)
        with torch.inference_mode():
            draft = DraftWorker(shard_runner(model, rank - tp, dp, group, dev, rows[0], use_graphs, backend), spec,
                                rows[1])
            _warm_buckets(None, draft.tree.runner, spec, len(prompt))
            t_draft = draft.profile() if spec.depth is None else 0.0
            t_target = 0.0
            if leader:
                buf, work = chan.post(1)
                chan.wait(work, "the target's hello")
                t_target = buf.item() * 1e-9
            draft.ctl = DepthController.tuned(t_target, t_draft, spec.depth, verbose=verbose and leader)
            draft.start(prompt)
            sync = DraftSync(group, tp, spec.nodes + 1, msg_dev) if dp > 1 else None
            if leader:
                draft_loop(draft, ProcessLink(chan) if sync is None else sync.leading(ProcessLink(chan), draft))
            else:
                sync.follow(draft)
        out.put(("ok", {**draft.stats(), "t_draft_s": t_draft} if leader else rank))
    except _Aborted:
        out.put(("aborted", None))
    except BaseException:  # noqa: BLE001 - any failure is reported to rank 0, then we exit
        out.put(("error", traceback.format_exc()))
        if chan is not None:
            try:  # tell the target, which is (or will be) waiting for a tree
                chan.timeout_s = min(timeout_s, 10.0)
                chan.send_tree(None)
            except BaseException:  # noqa: BLE001, S110 - best effort; rank 0 also watches our liveness
                pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DraftSync:
    """A tensor-parallel draft: its shards compute the same logits, so they grow the same trees,
    but two things reach only the leader: d for each pass (the trial is timed, so shards could
    disagree) and the target's answer. The leader broadcasts both in the draft group; every
    shard then makes the same collective calls in the same order."""

    def __init__(self, group, leader_rank: int, max_nodes: int, device: torch.device):
        self.group, self.src, self.n, self.device = group, leader_rank, max_nodes, device

    def _bcast(self, msg: torch.Tensor | None = None) -> list[int]:
        """Broadcast a [2 + n] message from the leader (None on the other shards)."""
        buf = (msg if msg is not None else torch.zeros(2 + self.n, dtype=torch.long)).to(self.device)
        dist.broadcast(buf, src=self.src, group=self.group)
        return buf.tolist()

    def leading(self, link, draft: DraftWorker) -> "SyncedLink":
        return SyncedLink(link, self, draft)

    def follow(self, draft: DraftWorker) -> None:
        draft.prepare()
        while True:
            draft.ctl.depth = self._bcast()[0]  # the leader's d for this pass
            draft.overlap(lambda: False)  # device rounds: exactly d, as on the leader
            status, verified = decode_reply(self._bcast())
            if status == DONE:
                return
            draft.receive(verified)
            draft.prepare()


class SyncedLink:
    """The draft leader's link when the draft is tensor-parallel: the leader's ProcessLink, and
    after each submit / answer a broadcast of d / the answer to the draft's other shards."""

    def __init__(self, link, sync: DraftSync, draft: DraftWorker):
        self.link, self.sync, self.draft = link, sync, draft

    def submit(self, tree: DraftTree) -> None:
        self.link.submit(tree)
        self.sync._bcast(encode_reply(self.draft.ctl.depth, [], self.sync.n))  # d in the status slot

    def ready(self) -> bool:
        return self.link.ready()

    def result(self) -> list[int] | None:
        verified = self.link.result()
        self.sync._bcast(encode_reply(DONE, [], self.sync.n) if verified is None
                         else encode_reply(GO, verified, self.sync.n))
        return verified


# ---- ranks 1 .. tp-1: the other shards of a tensor-parallel target -------------------------------
def join_world(init_file: str, backend: str, rank: int, tp: int, dp: int, device, timeout_s: float):
    """Join the world of tp target and dp draft ranks; returns (device, target group, draft
    group). Every rank creates both groups, in the same order (new_group is collective)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=tp + dp,
                            timeout=timedelta(seconds=timeout_s))
    return dev, target_group(tp), draft_group(tp, dp)


def target_group(tp: int):
    """The target's tensor-parallel group (ranks 0 .. tp-1); None without tensor parallelism.
    NOTE: new_group is collective over the whole world, so the draft calls it too."""
    return dist.new_group(list(range(tp))) if tp > 1 else None


def draft_group(tp: int, dp: int):
    """The draft's tensor-parallel group (ranks tp .. tp+dp-1); None for a one-process draft."""
    return dist.new_group(list(range(tp, tp + dp))) if dp > 1 else None


def shard_runner(model, rank: int, size: int, group, device: torch.device, rows: int, use_graphs,
                 backend: str) -> ModelRunner:
    """A runner over this rank's slice of `model` in a `size`-way group (the whole model when
    size is 1). Gloo collectives run on the host and cannot be captured, so a sharded model over
    gloo runs without CUDA graphs (NCCL collectives can be captured)."""
    if size == 1:
        return ModelRunner(model.to(device), rows, use_graphs=use_graphs)
    from tandem.parallel.tensor_parallel import shard_model

    return ModelRunner(shard_model(model, rank, size, group).to(device), rows,
                       use_graphs=False if backend == "gloo" else use_graphs)


class TreeBroadcast:
    """The target leader hands every tree to the other shards (one broadcast in the target
    group); a tree of n = -1 nodes ends their loop."""

    def __init__(self, group, max_nodes: int, device: torch.device):
        self.group, self.n, self.device = group, max_nodes, device

    def send(self, tree: DraftTree | None) -> None:
        dist.broadcast(encode_tree(tree, self.n).to(self.device), src=TARGET, group=self.group)

    def recv(self) -> DraftTree | None:
        buf = torch.zeros(1 + 2 * self.n, dtype=torch.long, device=self.device)
        dist.broadcast(buf, src=TARGET, group=self.group)
        return decode_tree(buf.tolist(), self.n)


def target_shard_main(init_file: str, backend: str, rank: int, tp: int, model, device: str, prompt: list[int],
                      spec: SpecConfig, sampling, seed_state: torch.Tensor, t_rows: int, use_graphs,
                      timeout_s: float, threads: int, out: mp.Queue, dp: int = 1) -> None:
    """Rank `rank` of the target: the same verify loop as the leader on its shard (SPMD: every
    shard computes the same logits after the all-reduces, so each one accepts the same path
    and commits it; only the leader talks to the draft)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        dev, group, _ = join_world(init_file, backend, rank, tp, dp, device, timeout_s)
        with torch.inference_mode():
            generator = torch.Generator()
            generator.set_state(seed_state)
            target = TargetWorker(shard_runner(model, rank, tp, group, dev, t_rows, use_graphs, backend), sampling,
                                  generator)
            _warm_buckets(target.runner, None, spec, len(prompt))
            if spec.depth is None:
                target.profile(spec.nodes)
            if len(prompt) > 1:
                target.runner.prefill(prompt[:-1])
            trees = TreeBroadcast(group, spec.nodes + 1, dev if backend == "nccl" else torch.device("cpu"))
            while (tree := trees.recv()) is not None:
                target.verify(tree)
        out.put(("ok", rank))
    except BaseException:  # noqa: BLE001 - reported to rank 0, which stops everything
        out.put(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- rank 0: the target loop in the calling process ---------------------------------------------
def run_process_pair(target_model, draft_model, prompt_ids, spec, sampling, gen, eos, max_new, transport,
                     on_tokens, tokenizer, generator, rows, *, verbose, use_graphs,
                     timeout_s, tp: int = 1, dp: int = 1) -> AsyncGenerationResult:
    """Rank 0 of `tp` target shards; `dp` draft shards follow (see the module docstring)."""
    t_rows, d_rows, tree_rows = rows
    if dist.is_available() is False:
        raise ConfigError("torch.distributed is not available in this PyTorch build; use --transport inline")
    if dist.is_initialized():
        raise ConfigError(f"transport {transport!r} needs its own process group, but one is already initialized")
    if tp < 1 or dp < 1:
        raise ConfigError(f"--tensor-parallel-size and --draft-tensor-parallel-size must be >= 1 (got {tp}, {dp})")
    t_dev = target_model.device
    shard_devices = [str(t_dev)] * tp
    draft_devices = [str(draft_model.device)] * dp
    if transport == "nccl":
        first = t_dev.index or 0
        if t_dev.type != "cuda" or torch.cuda.device_count() < first + tp + dp:
            raise ConfigError(f"transport 'nccl' with a {tp}-way target and a {dp}-way draft needs {tp + dp} GPUs "
                              f"from the target's on ({torch.cuda.device_count()} visible); use 'streams' on one GPU")
        shard_devices = [f"cuda:{first + r}" for r in range(tp)]
        draft_devices = [f"cuda:{first + tp + r}" for r in range(dp)]
    tmp = tempfile.mkdtemp(prefix="tandem-async-")
    init_file = os.path.join(tmp, "rendezvous")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(
        target=draft_process_main, daemon=True, name=f"tandem-draft-{j}",
        args=(init_file, transport, draft_model, draft_devices[j], list(prompt_ids), spec, (d_rows, tree_rows),
              use_graphs, verbose, timeout_s, torch.get_num_threads(), out, tp, dp, tp + j))
        for j in range(dp)]
    procs += [ctx.Process(
        target=target_shard_main, daemon=True, name=f"tandem-target-{r}",
        args=(init_file, transport, r, tp, target_model, shard_devices[r], list(prompt_ids), spec, sampling,
              generator.get_state(), t_rows, use_graphs, timeout_s, torch.get_num_threads(), out, dp))
        for r in range(1, tp)]
    draft_proc = procs[0]
    t_start = time.perf_counter()
    ok = False
    try:
        with _sigint_blocked():
            for proc in procs:
                proc.start()  # inside the try: an interrupt during the spawn still stops the children
        _, group, _ = join_world(init_file, transport, TARGET, tp, dp, t_dev, timeout_s)
        msg_dev = t_dev if transport == "nccl" else torch.device("cpu")
        chan = Channel(tp, spec.nodes + 1, msg_dev, lambda: all(p.is_alive() for p in procs), timeout_s)
        target = TargetWorker(shard_runner(target_model, TARGET, tp, group, t_dev, t_rows, use_graphs, transport),
                              sampling, generator)
        trees = TreeBroadcast(group, spec.nodes + 1, msg_dev) if tp > 1 else None
        _warm_buckets(target.runner, None, spec, len(prompt_ids))
        t_target = target.profile(spec.nodes) if spec.depth is None else 0.0
        hello = torch.tensor([int(t_target * 1e9)], dtype=torch.long, device=chan.device)
        chan.send(hello, "hello")
        startup = time.perf_counter() - t_start
        t0 = time.perf_counter()
        if len(prompt_ids) > 1:
            target.runner.prefill(prompt_ids[:-1])
        emitter = Emitter(max_new, eos, gen, tokenizer, on_tokens, t0)
        wait_s = 0.0
        while True:
            tw = time.perf_counter()
            try:
                tree = chan.recv_tree()
            except (_Aborted, _PeerGone) as e:
                raise DraftWorkerError(_draft_error(out, draft_proc, str(e))) from None
            wait_s += time.perf_counter() - tw
            if trees is not None:
                trees.send(tree)
            result = target.verify(tree)
            done = emitter.emit(tree, result)
            chan.send_reply(DONE if done else GO, result.tokens)
            if done:
                break
        if trees is not None:
            trees.send(None)
        seconds = time.perf_counter() - t0
        payload = None
        for _ in procs:  # one report per child: the draft's stats, the shards' "ok"
            status, got = _get(out, draft_proc, timeout_s)
            if status != "ok":
                raise DraftWorkerError(got or f"a worker process ended with {status!r}")
            if isinstance(got, dict):
                payload = got
        ok = True
        stats = {"transport": transport, "tensor_parallel_size": tp, "draft_tensor_parallel_size": dp,
                 "t_target_s": t_target, "startup_s": startup,
                 "target_wait_s": wait_s, "seconds": seconds, "target_busy_s": target.busy_s, **(payload or {})}
        return emitter.result(AsyncGenerationResult, "async", len(prompt_ids), seconds,
                              int(stats.get("draft_steps", 0)), stats=stats)
    finally:
        try:
            for proc in procs:
                if proc.pid is not None:
                    _stop(proc, graceful=ok)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT blocked in this thread while the children are spawned; they inherit the mask.

    NOTE: a child ignores SIGINT only once its main runs, after seconds of importing torch; a
    Ctrl-C (sent to the whole process group) before that killed it with a KeyboardInterrupt
    traceback and left rank 0 waiting for it in the rendezvous. Blocked, the signal stays
    pending in the child for good, and here it is delivered when the mask is restored.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _get(out, proc, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=0.2)
        except queue.Empty:
            if not proc.is_alive():
                try:
                    return out.get(timeout=0.5)
                except queue.Empty:
                    return "error", f"draft worker exited with code {proc.exitcode} and no report"
            if time.monotonic() > deadline:
                return "error", "draft worker did not report"


def _draft_error(out, proc, why: str) -> str:
    _, payload = _get(out, proc, 10.0)
    return f"draft worker failed ({why}):\n{payload}" if payload else f"draft worker failed ({why})"


def _stop(proc, graceful: bool) -> None:
    """Join the draft process; terminate (then kill) it if it does not end by itself.

    An interrupt while waiting does not leave the process behind: stopping goes on and the
    interrupt is re-raised at the end.
    """
    pending: BaseException | None = None
    for step in ("join", "terminate", "kill"):
        if step != "join":
            if not proc.is_alive():
                break
            getattr(proc, step)()
        try:
            proc.join(timeout=(10.0 if graceful else 0.2) if step == "join" else 5.0)
        except KeyboardInterrupt as e:
            pending = e
    if pending is not None:
        raise pending
