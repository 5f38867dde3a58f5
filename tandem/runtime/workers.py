"""Method `async` over processes (transports "gloo" and "nccl"): a pool of persistent workers.

Ranks (world = X + Y for an X-way target and a Y-way draft, SwiftSpec's x : k-x split):

    0            the calling process: the target's leader. It keeps the target model (CUDA
                 graphs and `on_tokens` streaming stay where the caller is), runs the target
                 loop and talks to the draft.
    1 .. X-1     the target's other shards, spawned.
    X            the draft's leader, spawned: the same `draft_loop` as the in-process
                 transports, with a `ProcessLink` whose `ready()` is a non-blocking
                 `irecv(...).is_completed()`.
    X+1 .. X+Y-1 the draft's other shards, spawned.

The workers start once per pool (`WorkerPool`: spawn, join the world, build the runners,
capture graphs, profile, the hello) and then serve one request after another: each request is
one `Job` (prompt, sampling, seed, replay flag) put on every worker's inbox queue; the worker
answers on the shared outbox with its stats. `Generator` keeps its pool between requests (so
the start-up is paid once per engine, and reported apart from the per-request overhead) and
closes it in `Generator.close()`, on garbage collection and at exit.

Shards of one model are SPMD: they compute the same logits after the all-reduces
(tandem.parallel.tensor_parallel), so they make the same decisions; what only a leader learns
goes to its shards by broadcast in the model's group (`TreeBroadcast`: each tree and its
replayed accept count to the target's shards; `DraftSync`: each pass's d and the target's
answer to the draft's shards).

Messages between the two leaders are small fixed-size int64 tensors (CPU for gloo, the rank's
GPU for nccl):

    hello  target -> draft   [t_target_ns]                               once per pool
    tree   draft  -> target  [n, tokens[0:n], parents[0:n], logp bits[0:n], 0...]   n = -1: the draft failed
    reply  target -> draft   [status, m, tokens[0:m], 0...]              status 0 go on, 1 done, -1 abort

NOTE (the nccl hang, issue 18): NCCL runs the point-to-point operations of one communicator in
order, on one stream. The draft used to post its irecv for the reply *before* its isend of the
tree (fine on gloo, whose operations progress independently): on nccl the send then queued
behind a receive that could only complete after the target had the tree, while the target
waited for that tree: both sides waited forever, right after the start-up profile. Each side
now finishes a send before it posts the next receive, in the same order on both sides (tree,
then reply), so no operation ever queues behind one that waits for it. (A CUDA graph capture
also waits for pending NCCL work, and the draft captures device-round graphs while the reply
is pending: with the tree already sent that wait ends when the reply lands.)

Nothing waits forever: every exchange between the leaders is polled against a deadline
(`timeout_s`, default 30 s, env TANDEM_WORKER_TIMEOUT) and against the peer's liveness (a dead
worker is noticed within a poll, ~20 ms); collectives run in groups created with `timeout_s`;
the start-up (spawn, rendezvous, graph capture, profiling) has its own, longer deadline
(TANDEM_WORKER_STARTUP_TIMEOUT, default 300 s). Any failure becomes one `WorkerError` whose
message is one line (the worker's traceback is kept in `.detail`); the pool is then closed:
every spawned process is terminated and joined, the queues closed, the process group destroyed
(aborted on nccl). Spawned ranks ignore SIGINT (the caller owns the interrupt) and exit when
their parent dies.

Test hook: TANDEM_INJECT_FAULT="<rank>:<kind>:<pass>" makes spawned rank <rank> fail at its
<pass>-th tree of a request (0-based; the draft leader when it sends it, a target shard when it
receives it, a draft shard when it follows it): kind "stall" sleeps forever, "crash" raises,
"exit" ends the process with status 3. Read by the workers at spawn.

NCCL multicast (NVLS) stays off in every process: the pool sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (unless already set) before it
spawns a worker or initializes a process group; on a shared host multicast objects can take
the GPUs out of service.

NOTE: rank 0 calls `init_process_group` on the default group, so the caller must not have
one already, and one pool at a time lives in a process (a new pool closes the old one).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.config import ConfigError, SamplingConfig, SpecConfig
from tandem.runtime.async_workers import (
    AsyncGenerationResult,
    DepthController,
    DraftWorker,
    TargetWorker,
    _warm_buckets,
    draft_loop,
)
from tandem.runtime.emit import Emitter
from tandem.runtime.plan import RequestPlan
from tandem.runtime.target import replayed_accept
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree

TARGET = 0  # the target leader; a tensor-parallel target adds ranks 1 .. tp-1, and the draft is rank tp
GO, DONE, ABORT = 0, 1, -1
ENV_TIMEOUT = "TANDEM_WORKER_TIMEOUT"
ENV_STARTUP_TIMEOUT = "TANDEM_WORKER_STARTUP_TIMEOUT"
ENV_FAULT = "TANDEM_INJECT_FAULT"
DEFAULT_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S = 30.0, 300.0
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class WorkerError(RuntimeError):
    """A worker process failed, stalled or ended. The message is one line; `detail` holds the
    worker's traceback when it sent one."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


DraftWorkerError = WorkerError  # the name before workers other than the draft could fail


def no_multicast_env() -> None:
    """NVLink multicast off in this process and in every process it spawns from now on."""
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)


def resolve_timeouts(timeout_s: float | None) -> tuple[float, float]:
    """(seconds per exchange, seconds for the start-up): the argument, else the environment,
    else 30 s and 300 s (the start-up never gets less than the exchange timeout)."""
    try:
        t = float(timeout_s if timeout_s is not None else os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
        start = float(os.environ.get(ENV_STARTUP_TIMEOUT, DEFAULT_STARTUP_TIMEOUT_S))
    except ValueError as e:
        raise ConfigError(f"{ENV_TIMEOUT} / {ENV_STARTUP_TIMEOUT} must be seconds: {e}") from None
    if t <= 0 or start <= 0:
        raise ConfigError(f"worker timeouts must be > 0 seconds (got {t}, {start})")
    return t, max(t, start)


# ---- messages: fixed-size int64 tensors (see the module docstring) ---------------------------
def tree_size(n: int) -> int:
    """Length of a tree message for trees of up to n nodes."""
    return 1 + 3 * n


def encode_tree(tree: DraftTree | None, n: int) -> torch.Tensor:
    """[1 + 3n]: node count (-1: no tree), tokens, parents, the float64 bits of each node's draft
    log-probability (acceptance replay walks the most probable path), zero padded; n = nodes
    per tree."""
    msg = torch.zeros(tree_size(n), dtype=torch.long)
    msg[0] = -1 if tree is None else len(tree)
    if tree is not None:
        k = len(tree)
        msg[1:1 + k] = torch.tensor(tree.tokens)
        msg[1 + n:1 + n + k] = torch.tensor(tree.parents)
        msg[1 + 2 * n:1 + 2 * n + k] = torch.tensor(tree.logp, dtype=torch.float64).view(torch.long)
    return msg


def decode_tree(msg: list[int], n: int) -> DraftTree | None:
    k = msg[0]
    if k < 0:
        return None
    logp = torch.tensor(msg[1 + 2 * n:1 + 2 * n + k], dtype=torch.long).view(torch.float64).tolist()
    return DraftTree(tokens=msg[1:1 + k], parents=msg[1 + n:1 + n + k], logp=logp)


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


class _PeerGone(RuntimeError):
    pass


class Channel:
    """Fixed-size message buffers and polled, non-blocking send/recv to the peer rank.

    NOTE: a send is waited for before the next receive is posted (see the module docstring:
    NCCL orders the operations of one communicator)."""

    def __init__(self, peer: int, max_nodes: int, device: torch.device, peer_alive, timeout_s: float):
        self.peer = peer  # the other side's rank: the draft's for the target leader, 0 for the draft
        self.n = max_nodes  # nodes per tree, root included
        self.device = device
        self.peer_alive = peer_alive
        self.timeout_s = timeout_s

    def _buf(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.long, device=self.device)

    # ---- primitives ---------------------------------------------------------------------
    def wait(self, work: _Pending, what: str, timeout_s: float | None = None) -> None:
        """Wait for `work`, checking the peer is alive (never blocks forever)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        spins = 0
        while not work.is_completed(0.02 if spins > 1000 else 0.0):
            spins += 1
            if spins > 1000 and spins % 8 == 0:
                if not self.peer_alive():
                    raise _PeerGone(f"the peer process ended while this one waited for {what}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {what} from rank {self.peer} within {limit:g} s ({ENV_TIMEOUT})")
        work.finish()

    def send(self, t: torch.Tensor, what: str, timeout_s: float | None = None) -> None:
        self.wait(_Pending(dist.isend(t, dst=self.peer), self.device.type != "cuda"), f"{what} delivered",
                  timeout_s)

    def post(self, size: int):
        buf = self._buf(size)
        return buf, _Pending(dist.irecv(buf, src=self.peer), self.device.type != "cuda")

    # ---- messages -------------------------------------------------------------------------
    def send_tree(self, tree: DraftTree | None) -> None:
        self.send(encode_tree(tree, self.n).to(self.device), "tree")

    def recv_tree(self) -> DraftTree:
        buf, work = self.post(tree_size(self.n))
        self.wait(work, "draft tree")
        tree = decode_tree(buf.tolist(), self.n)
        if tree is None:
            raise _Aborted("the draft worker failed")
        return tree

    def send_reply(self, status: int, tokens: list[int]) -> None:
        self.send(encode_reply(status, tokens, self.n).to(self.device), "reply")

    def post_reply(self):
        return self.post(2 + self.n)


class _Pending:
    """A posted isend/irecv whose completion can be polled without blocking.

    NOTE: gloo's send/recv work only completes inside `wait()` (`is_completed()` stays False
    until then), so for gloo a daemon thread blocks in `wait()` (it releases the GIL, and the
    group's timeout ends it) and sets an event. NCCL work is polled with `is_completed()` (a
    CUDA event query).
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


@dataclass(frozen=True)
class Fault:
    """An injected failure (tests; env TANDEM_INJECT_FAULT="<rank>:<kind>:<pass>")."""

    kind: str = ""  # "" (none), "stall", "crash" or "exit"
    at_pass: int = -1

    @classmethod
    def from_env(cls, rank: int) -> Fault:
        spec = os.environ.get(ENV_FAULT, "")
        if not spec:
            return cls()
        r, kind, p = spec.split(":")
        if kind not in ("stall", "crash", "exit"):
            raise ValueError(f"{ENV_FAULT}: unknown fault kind {kind!r} (stall, crash or exit)")
        return cls(kind, int(p)) if int(r) == rank else cls()

    def check(self, pass_index: int) -> None:
        if not self.kind or pass_index != self.at_pass:
            return
        if self.kind == "stall":
            while True:
                time.sleep(3600)
        if self.kind == "exit":
            os._exit(3)
        raise RuntimeError(f"injected crash at pass {pass_index}")


class ProcessLink:
    """The draft's view of the target across processes (same interface as LocalLink)."""

    def __init__(self, chan: Channel, fault: Fault = Fault()):
        self.chan, self.fault = chan, fault
        self._buf = self._work = None
        self.passes = 0

    def submit(self, tree: DraftTree) -> None:
        self.fault.check(self.passes)
        self.passes += 1
        self.chan.send_tree(tree)
        self._buf, self._work = self.chan.post_reply()  # posted after the send: see the module docstring

    def ready(self) -> bool:
        return self._work.is_completed()

    def result(self) -> list[int] | None:
        self.chan.wait(self._work, "answer from the target")
        status, tokens = decode_reply(self._buf.tolist())
        if status == ABORT:
            raise _Aborted("the target stopped")
        return None if status == DONE else tokens


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

    def follow(self, draft: DraftWorker, fault: Fault = Fault()) -> None:
        draft.prepare()
        passes = 0
        while True:
            fault.check(passes)
            passes += 1
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


class TreeBroadcast:
    """The target leader hands every tree, with its replayed accept count (-1: none), to the
    other shards (one broadcast in the target group); a tree of n = -1 nodes ends their loop."""

    def __init__(self, group, max_nodes: int, device: torch.device):
        self.group, self.n, self.device = group, max_nodes, device

    def send(self, tree: DraftTree | None, forced: int | None = None) -> None:
        msg = torch.cat([torch.tensor([-1 if forced is None else forced]), encode_tree(tree, self.n)])
        dist.broadcast(msg.to(self.device), src=TARGET, group=self.group)

    def recv(self) -> tuple[DraftTree, int | None] | None:
        buf = torch.zeros(1 + tree_size(self.n), dtype=torch.long, device=self.device)  # [forced, tree message]
        dist.broadcast(buf, src=TARGET, group=self.group)
        msg = buf.tolist()
        tree = decode_tree(msg[1:], self.n)
        return None if tree is None else (tree, None if msg[0] < 0 else msg[0])


# ---- the world and the runners ------------------------------------------------------------------
def join_world(init_file: str, backend: str, rank: int, tp: int, dp: int, device, timeout_s: float,
               startup_timeout_s: float | None = None):
    """Join the world of tp target and dp draft ranks; returns (device, target group, draft
    group). Every rank creates both groups, in the same order (new_group is collective). The
    rendezvous waits up to the start-up timeout; the groups' collectives time out after
    `timeout_s`."""
    no_multicast_env()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL binds each rank's communicators to its current device
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=tp + dp,
                            timeout=timedelta(seconds=startup_timeout_s or timeout_s),
                            device_id=dev if backend == "nccl" else None)
    return dev, target_group(tp, timeout_s), draft_group(tp, dp, timeout_s)


def target_group(tp: int, timeout_s: float | None = None):
    """The target's tensor-parallel group (ranks 0 .. tp-1); None without tensor parallelism.
    NOTE: new_group is collective over the whole world, so the draft calls it too."""
    t = None if timeout_s is None else timedelta(seconds=timeout_s)
    return dist.new_group(list(range(tp)), timeout=t) if tp > 1 else None


def draft_group(tp: int, dp: int, timeout_s: float | None = None):
    """The draft's tensor-parallel group (ranks tp .. tp+dp-1); None for a one-process draft."""
    t = None if timeout_s is None else timedelta(seconds=timeout_s)
    return dist.new_group(list(range(tp, tp + dp)), timeout=t) if dp > 1 else None


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


def _leave_world(failed: bool) -> None:
    """Destroy the process group; after a failure on nccl abort it instead (a pending NCCL
    operation would keep a plain destroy waiting)."""
    if not dist.is_initialized():
        return
    if failed and dist.get_backend() == "nccl":
        try:
            dist.distributed_c10d._abort_process_group()
            return
        except Exception:  # noqa: BLE001 - fall back to the plain destroy
            pass
    dist.destroy_process_group()


# ---- the pool's configuration and one request's job -----------------------------------------------
@dataclass(frozen=True)
class PoolConfig:
    """What a pool's workers are started with; a pool serves every request whose config equals
    this one, its plan aside (a request fits when it needs no more rows than the pool holds)."""

    transport: str
    tp: int
    dp: int
    spec: SpecConfig
    plan: RequestPlan  # the pool's cache rows (at least the request's: see serves)
    use_graphs: bool | str | None
    timeout_s: float
    startup_timeout_s: float
    verbose: bool
    threads: int

    def serves(self, other: PoolConfig) -> bool:
        same = {k: v for k, v in vars(self).items() if k != "plan"} == {k: v for k, v in vars(other).items()
                                                                         if k != "plan"}
        mine, theirs = self.plan, other.plan
        return same and mine.target_rows >= theirs.target_rows and mine.draft_rows >= theirs.draft_rows \
            and mine.tree_rows >= theirs.tree_rows


@dataclass(frozen=True)
class Job:
    """One request, as the workers see it."""

    prompt: list[int]
    sampling: SamplingConfig
    seed_state: torch.Tensor  # the target's generator state (shards draw the same numbers)
    replay: bool  # acceptance replay: the draft swaps the bonus (async_workers.replay_bonus)


# ---- spawned ranks ----------------------------------------------------------------------------------
def worker_main(cfg: PoolConfig, init_file: str, rank: int, device: str, model, inbox, outbox) -> None:
    """A spawned rank: join the world, start its side once, then serve jobs until told to stop
    (None on the inbox) or its parent dies. Reports go to `outbox` as (kind, rank, payload)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller (rank 0) owns Ctrl-C and stops us
    torch.set_num_threads(cfg.threads)
    parent = mp.parent_process()
    alive = (lambda: parent.is_alive()) if parent is not None else (lambda: True)
    side = None
    failed = False
    try:
        fault = Fault.from_env(rank)
        outbox.put(("joining", rank, None))  # see WorkerPool: rank 0 joins once every worker got this far
        dev, tgroup, dgroup = join_world(init_file, cfg.transport, rank, cfg.tp, cfg.dp, device,
                                         cfg.timeout_s, cfg.startup_timeout_s)
        with torch.inference_mode():
            if rank >= cfg.tp:
                side = _DraftSide(cfg, rank, dev, model, dgroup, alive, fault)
            else:
                side = _TargetShard(cfg, rank, dev, model, tgroup, fault)
            outbox.put(("ready", rank, {"pid": os.getpid(), "env": {k: os.environ.get(k) for k in NO_MULTICAST},
                                        **side.info}))
            while (job := _next_job(inbox, alive)) is not None:
                outbox.put(("ok", rank, side.run(job)))
    except _Aborted:
        outbox.put(("aborted", rank, ""))
    except BaseException:  # noqa: BLE001 - any failure is reported to rank 0, then we exit
        failed = True
        outbox.put(("error", rank, traceback.format_exc()))
        if isinstance(side, _DraftSide) and side.chan is not None:
            try:  # tell the target, which is (or will be) waiting for a tree
                side.chan.timeout_s = min(side.chan.timeout_s, 10.0)
                side.chan.send_tree(None)
            except BaseException:  # noqa: BLE001, S110 - best effort; rank 0 also watches our liveness
                pass
    finally:
        _leave_world(failed)


def _next_job(inbox, alive) -> Job | None:
    while True:
        try:
            return inbox.get(timeout=0.5)
        except queue.Empty:
            if not alive():
                return None


class _DraftSide:
    """A draft rank: rank tp leads (it talks to the target); with a tensor-parallel draft ranks
    tp+1 .. tp+dp-1 run the same draft loop on their slice (SPMD) and learn what the leader
    learns through `DraftSync`. The depth controller (self-tuning) lives as long as the pool."""

    def __init__(self, cfg: PoolConfig, rank: int, dev: torch.device, model, group, alive, fault: Fault):
        self.cfg, self.fault = cfg, fault
        self.leader = rank == cfg.tp
        self.msg_dev = dev if cfg.transport == "nccl" else torch.device("cpu")
        self.chan = Channel(TARGET, cfg.spec.nodes + 1, self.msg_dev, alive, cfg.timeout_s) if self.leader else None
        self.runner = shard_runner(model, rank - cfg.tp, cfg.dp, group, dev, cfg.plan.draft_rows, cfg.use_graphs,
                                   cfg.transport)
        spec = cfg.spec
        probe = DraftWorker(self.runner, spec, cfg.plan.tree_rows)
        _warm_buckets(None, self.runner, spec, 1)
        self.t_draft = probe.profile() if spec.depth is None else 0.0
        t_target = 0.0
        if self.leader:
            buf, work = self.chan.post(1)
            self.chan.wait(work, "hello from the target", cfg.startup_timeout_s)
            t_target = buf.item() * 1e-9
        self.ctl = DepthController.tuned(t_target, self.t_draft, spec.depth, verbose=cfg.verbose and self.leader)
        self.sync = DraftSync(group, cfg.tp, spec.nodes + 1, self.msg_dev) if cfg.dp > 1 else None
        self.info = {"t_draft_s": self.t_draft}

    def run(self, job: Job) -> dict:
        draft = DraftWorker(self.runner, self.cfg.spec, self.cfg.plan.tree_rows)
        draft.replay = job.replay
        _warm_buckets(None, self.runner, self.cfg.spec, len(job.prompt))
        self.ctl.new_request()
        draft.ctl = self.ctl
        draft.start(job.prompt)
        if not self.leader:
            self.sync.follow(draft, self.fault)
            return {}
        link = ProcessLink(self.chan, self.fault)
        draft_loop(draft, link if self.sync is None else self.sync.leading(link, draft))
        return {**draft.stats(), "t_draft_s": self.t_draft}


class _TargetShard:
    """Rank 1 .. tp-1 of the target: the same verify loop as the leader on its shard (SPMD: every
    shard computes the same logits after the all-reduces, so each one accepts the same path and
    commits it; only the leader talks to the draft)."""

    def __init__(self, cfg: PoolConfig, rank: int, dev: torch.device, model, group, fault: Fault):
        self.cfg, self.fault = cfg, fault
        self.runner = shard_runner(model, rank, cfg.tp, group, dev, cfg.plan.target_rows, cfg.use_graphs, cfg.transport)
        _warm_buckets(self.runner, None, cfg.spec, 1)
        if cfg.spec.depth is None:  # the leader profiles; its all-reduces need ours
            TargetWorker(self.runner, SamplingConfig(), torch.Generator()).profile(cfg.spec.nodes)
        self.trees = TreeBroadcast(group, cfg.spec.nodes + 1, dev if cfg.transport == "nccl" else torch.device("cpu"))
        self.info: dict = {}

    def run(self, job: Job) -> dict:
        generator = torch.Generator()
        generator.set_state(job.seed_state)
        target = TargetWorker(self.runner, job.sampling, generator)
        self.runner.cache.truncate(0)
        _warm_buckets(self.runner, None, self.cfg.spec, len(job.prompt))
        if len(job.prompt) > 1:
            self.runner.prefill(job.prompt[:-1])
        passes = 0
        while (got := self.trees.recv()) is not None:
            self.fault.check(passes)
            passes += 1
            target.verify(*got)
        return {}


# ---- rank 0: the pool --------------------------------------------------------------------------------
class _Processes:
    """What a pool must give back: its processes, queues, rendezvous directory and process group.
    Separate from WorkerPool so that a finalizer (garbage collection, exit) can release them."""

    def __init__(self):
        self.procs: list = []
        self.inboxes: list = []
        self.outbox = None
        self.tmp: str | None = None
        self.in_world = False
        self.closed = False

    def release(self, graceful: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if graceful:
                for q in self.inboxes:
                    _put(q, None)  # stop after the current job
            pending: BaseException | None = None
            for proc in self.procs:
                if proc.pid is not None:
                    try:
                        _stop(proc, graceful)
                    except KeyboardInterrupt as e:
                        pending = e
            if pending is not None:
                raise pending
        finally:
            for q in [*self.inboxes, self.outbox]:
                if q is not None:
                    q.close()
                    q.join_thread()
            if self.in_world:
                self.in_world = False
                _leave_world(not graceful)
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)


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


def _put(q, item) -> None:
    try:
        q.put(item)
    except (ValueError, OSError):  # a closed queue: nothing listens any more
        pass


_live_pools: weakref.WeakSet = weakref.WeakSet()  # NOTE: the default process group is per process


class WorkerPool:
    """Rank 0 of a started world: the target leader's runner and the spawned workers, serving
    one request after another (`generate`) until `close()`."""

    def __init__(self, target_model, draft_model, cfg: PoolConfig):
        if not dist.is_available():
            raise ConfigError("torch.distributed is not available in this PyTorch build; use --transport inline")
        for old in list(_live_pools):
            old.close()  # one default process group per process
        if dist.is_initialized():
            raise ConfigError(f"transport {cfg.transport!r} needs its own process group, but one is already "
                              f"initialized")
        if cfg.tp < 1 or cfg.dp < 1:
            raise ConfigError(f"--tensor-parallel-size and --draft-tensor-parallel-size must be >= 1 "
                              f"(got {cfg.tp}, {cfg.dp})")
        self.cfg, self.target_model, self.draft_model = cfg, target_model, draft_model
        tp, dp = cfg.tp, cfg.dp
        t_dev = target_model.device
        shard_devices = [str(t_dev)] * tp
        draft_devices = [str(draft_model.device)] * dp
        if cfg.transport == "nccl":
            first = t_dev.index or 0
            if t_dev.type != "cuda" or torch.cuda.device_count() < first + tp + dp:
                raise ConfigError(f"transport 'nccl' with a {tp}-way target and a {dp}-way draft needs {tp + dp} "
                                  f"GPUs from the target's on ({torch.cuda.device_count()} visible); use 'streams' "
                                  f"on one GPU")
            shard_devices = [f"cuda:{first + r}" for r in range(tp)]
            draft_devices = [f"cuda:{first + tp + r}" for r in range(dp)]
        no_multicast_env()  # before the spawn: the children inherit the environment
        self.res = res = _Processes()
        self._finalizer = weakref.finalize(self, res.release)  # also runs at exit
        self.requests = 0
        t_start = time.perf_counter()
        try:
            res.tmp = tempfile.mkdtemp(prefix="tandem-async-")
            init_file = os.path.join(res.tmp, "rendezvous")
            ctx = mp.get_context("spawn")
            res.outbox = ctx.Queue()
            ranks = [(tp + j, draft_model, draft_devices[j]) for j in range(dp)]
            ranks += [(r, target_model, shard_devices[r]) for r in range(1, tp)]
            for rank, model, device in ranks:
                inbox = ctx.Queue()
                res.inboxes.append(inbox)
                res.procs.append(ctx.Process(target=worker_main, daemon=True, name=f"tandem-rank-{rank}",
                                             args=(cfg, init_file, rank, device, model, inbox, res.outbox)))
            with _sigint_blocked():
                for proc in res.procs:
                    proc.start()  # inside the try: an interrupt during the spawn still stops the children
            # NOTE: the rendezvous cannot watch the workers' liveness, so rank 0 enters it only when
            # every worker has started (unpickled its model) and is about to enter it too
            self.ranks = [r for r, _, _ in ranks]
            self._collect("joining", cfg.startup_timeout_s)
            res.in_world = True
            _, group, _ = join_world(init_file, cfg.transport, TARGET, tp, dp, t_dev, cfg.timeout_s,
                                     cfg.startup_timeout_s)
            self.msg_dev = t_dev if cfg.transport == "nccl" else torch.device("cpu")
            self.chan = Channel(tp, cfg.spec.nodes + 1, self.msg_dev, self._all_alive, cfg.timeout_s)
            self.runner = shard_runner(target_model, TARGET, tp, group, t_dev, cfg.plan.target_rows, cfg.use_graphs,
                                       cfg.transport)
            self.trees = TreeBroadcast(group, cfg.spec.nodes + 1, self.msg_dev) if tp > 1 else None
            _warm_buckets(self.runner, None, cfg.spec, 1)
            self.t_target = (TargetWorker(self.runner, SamplingConfig(), torch.Generator()).profile(cfg.spec.nodes)
                             if cfg.spec.depth is None else 0.0)
            hello = torch.tensor([int(self.t_target * 1e9)], dtype=torch.long, device=self.msg_dev)
            self.chan.send(hello, "hello", cfg.startup_timeout_s)
            self.info = self._collect("ready", cfg.startup_timeout_s)
        except BaseException as e:
            err = self._diagnose(e)
            self.close(graceful=False)
            if err is e:
                raise
            raise err from None
        self.startup_s = time.perf_counter() - t_start
        self.pids = [p.pid for p in res.procs]
        _live_pools.add(self)

    @property
    def closed(self) -> bool:
        return self.res.closed

    def serves(self, cfg: PoolConfig, target_model, draft_model) -> bool:
        return (not self.closed and self.target_model is target_model and self.draft_model is draft_model
                and self.cfg.serves(cfg))

    def close(self, graceful: bool = True) -> None:
        """Stop every worker (after its current job when graceful) and release everything."""
        _live_pools.discard(self)
        self.res.release(graceful)

    def _all_alive(self) -> bool:
        return all(p.is_alive() for p in self.res.procs)

    # ---- one request ----------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingConfig, gen, eos: set[int], max_new: int,
                 on_tokens, tokenizer, generator: torch.Generator,
                 forced_accepts: list[int] | None = None) -> AsyncGenerationResult:
        """Decode one request on the pool's workers; any failure closes the pool and raises."""
        cfg, tp = self.cfg, self.cfg.tp
        t_call = time.perf_counter()
        first = self.requests == 0
        self.requests += 1
        try:
            job = Job(list(prompt_ids), sampling, generator.get_state(), forced_accepts is not None)
            for q in self.res.inboxes:
                q.put(job)
            self.runner.cache.truncate(0)
            target = TargetWorker(self.runner, sampling, generator)
            _warm_buckets(self.runner, None, cfg.spec, len(prompt_ids))
            t0 = time.perf_counter()
            if len(prompt_ids) > 1:
                self.runner.prefill(prompt_ids[:-1])
            emitter = Emitter(max_new, eos, gen, tokenizer, on_tokens, t0)
            wait_s = 0.0
            while True:
                tw = time.perf_counter()
                tree = self.chan.recv_tree()
                wait_s += time.perf_counter() - tw
                forced = replayed_accept(forced_accepts, len(emitter.accept_lengths))
                if self.trees is not None:
                    self.trees.send(tree, forced)
                result = target.verify(tree, forced)
                done = emitter.emit(tree, result)
                self.chan.send_reply(DONE if done else GO, result.tokens)
                if done:
                    break
            if self.trees is not None:
                self.trees.send(None)
            seconds = time.perf_counter() - t0
            reports = self._collect("ok", cfg.timeout_s)
        except BaseException as e:
            err = self._diagnose(e)
            self.close(graceful=False)
            if err is e:
                raise
            raise err from None
        payload = reports.get(tp, {})
        stats = {"transport": cfg.transport, "tensor_parallel_size": tp, "draft_tensor_parallel_size": cfg.dp,
                 "t_target_s": self.t_target, "startup_s": self.startup_s if first else 0.0,
                 "pool_startup_s": self.startup_s, "request_overhead_s": t0 - t_call, "workers_reused": not first,
                 "worker_pids": list(self.pids), "target_wait_s": wait_s, "seconds": seconds,
                 "target_busy_s": target.busy_s, **payload}
        return emitter.result(AsyncGenerationResult, "async", len(prompt_ids), seconds,
                              int(stats.get("draft_steps", 0)), stats=stats)

    # ---- reports and errors ------------------------------------------------------------------------
    def _collect(self, kind: str, timeout_s: float) -> dict[int, dict]:
        """One `kind` report from every spawned rank, by rank."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.res.procs):
            try:
                status, rank, payload = self.res.outbox.get(timeout=0.1)
            except queue.Empty:
                if not self._all_alive():
                    raise _PeerGone("a worker process ended") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(self.ranks) - set(got))
                    raise TimeoutError(f"no {kind!r} report from rank(s) {missing} within {timeout_s:g} s") from None
                continue
            if status != kind:
                raise WorkerError(_one_line(rank, self.cfg.tp, status, payload), payload)
            got[rank] = payload
        return got

    def _diagnose(self, e: BaseException) -> BaseException:
        """The error to raise for `e`: a worker's own report of a failure when one came, else a
        one-line WorkerError for a worker that ended or stalled (naming the ranks that went
        silent: a stalled rank never reports, while the ranks waiting on it time out too); else
        `e` itself (rank 0's own failure, e.g. an interrupt or a bad token id)."""
        if isinstance(e, (WorkerError, KeyboardInterrupt)):
            return e
        tp, ranks = self.cfg.tp, getattr(self, "ranks", [])
        reports = [r for r in _drain(self.res.outbox) if r[0] in ("error", "aborted")]
        waited = [r for r in reports if _is_timeout(_last_line(r[2]))]
        for status, rank, payload in reports:
            if status == "error" and (rank, payload) not in [(w[1], w[2]) for w in waited]:
                return WorkerError(_one_line(rank, tp, status, payload), payload)
        for rank, proc in zip(ranks, self.res.procs):
            if proc.exitcode not in (None, 0):
                return WorkerError(f"{_role(rank, tp)} exited with status {proc.exitcode}")
        own = _last_line(str(e)) or type(e).__name__
        if waited or isinstance(e, TimeoutError) or _is_timeout(own):
            heard = {r[1] for r in reports}
            silent = [_role(r, tp) for r in ranks if r not in heard]
            why = own if _is_timeout(own) or not waited else _last_line(waited[0][2])
            return WorkerError(f"a worker stalled{' (silent: ' + ', '.join(silent) + ')' if silent else ''}: {why}",
                               "".join(r[2] for r in waited))
        if isinstance(e, (_PeerGone, _Aborted)):
            return WorkerError(f"a worker stopped: {own}")
        return e


def _last_line(text) -> str:
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _is_timeout(line: str) -> bool:
    return line.startswith("TimeoutError") or "timed out" in line.lower() or "within" in line and ENV_TIMEOUT in line


def _drain(q) -> list:
    out = []
    if q is None:
        return out
    deadline = time.monotonic() + 1.0  # a dying worker's report may still be in flight
    while time.monotonic() < deadline:
        try:
            out.append(q.get(timeout=0.1))
        except (queue.Empty, ValueError, OSError):
            if out:
                break
    return out


def _role(rank: int, tp: int) -> str:
    if rank < tp:
        return f"target shard (rank {rank})"
    return f"draft worker (rank {rank})" if rank == tp else f"draft shard (rank {rank})"


def _one_line(rank: int, tp: int, status: str, payload) -> str:
    """`draft worker (rank 1) failed: IndexError: index out of range in self`: the last line of
    the worker's traceback (the whole of it stays in WorkerError.detail)."""
    return f"{_role(rank, tp)} {'stopped' if status == 'aborted' else 'failed'}: {_last_line(payload) or status}"


def _stop(proc, graceful: bool) -> None:
    """Join a worker process; terminate (then kill) it if it does not end by itself.

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


# ---- the entry point of generate_async --------------------------------------------------------------
def run_process_pair(target_model, draft_model, prompt_ids, spec, sampling, gen, eos, max_new, transport,
                     on_tokens, tokenizer, generator, plan: RequestPlan, *, verbose, use_graphs,
                     timeout_s: float | None = None, tp: int = 1, dp: int = 1, runners: dict | None = None,
                     forced_accepts: list[int] | None = None) -> AsyncGenerationResult:
    """One request over a worker pool: the one kept in `runners` when it serves this request,
    else a new one (kept in `runners`, or closed after the request when `runners` is None)."""
    timeout, startup = resolve_timeouts(timeout_s)
    cfg = PoolConfig(transport, tp, dp, spec, plan, use_graphs, timeout, startup, verbose,
                     torch.get_num_threads())
    key = ("worker-pool", transport)
    pool = runners.get(key) if runners is not None else None
    if pool is not None and not pool.serves(cfg, target_model, draft_model):
        pool.close()
        pool = None
    if pool is None:
        pool = WorkerPool(target_model, draft_model, cfg)
        if runners is not None:
            runners[key] = pool
    try:
        return pool.generate(prompt_ids, sampling, gen, eos, max_new, on_tokens, tokenizer, generator,
                             forced_accepts)
    finally:
        if runners is None:
            pool.close()


def close_pools(runners: dict) -> None:
    """Close the worker pools kept in a `runners` dict (Generator.close)."""
    for key in [k for k, v in runners.items() if isinstance(v, WorkerPool)]:
        runners.pop(key).close()


atexit.register(lambda: [p.close(graceful=False) for p in list(_live_pools)])
