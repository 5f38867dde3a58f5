"""The process transports (tandem.runtime.workers) over gloo on the CPU: faults, the persistent
worker pool, acceptance replay and the environment of the workers.

Faults are injected with TANDEM_INJECT_FAULT="<rank>:<stall|crash|exit>:<pass>" (read by the
spawned workers; see the workers module docstring). Each ends in one WorkerError whose message
is one line, well within the worker timeout plus a few seconds of spawn, and leaves no child
process behind. Budgets: every test here takes under ~20 s on a loaded 2-core machine.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from models_for_tests import unit_scaled_model
from tandem.config import GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.async_decode import generate_async
from tandem.runtime.generate import Generator
from tandem.runtime.workers import ENV_FAULT, NO_MULTICAST, WorkerError, WorkerPool

TARGET = unit_scaled_model(96, 0, 4.0, max_positions=256)
DRAFT = unit_scaled_model(96, 0, 4.0, max_positions=256)
with torch.no_grad():  # the draft: the target plus small noise, so trees are accepted deeply
    g = torch.Generator().manual_seed(1)
    for p in DRAFT.parameters():
        p.add_(0.02 * torch.randn(p.shape, generator=g))
GREEDY = SamplingConfig()
SPEC = SpecConfig(nodes=8, width=2, depth=2)
PROMPT = [7, 1, 42, 42, 5, 60]
TIMEOUT_S = 3.0  # per exchange: what a stall costs


@pytest.fixture
def alarm():
    """Fail (instead of hanging) when a test runs past its budget."""
    def on_alarm(*_):
        raise TimeoutError("test ran past its time budget")

    old = signal.signal(signal.SIGALRM, on_alarm)
    yield lambda s: signal.alarm(s)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def ar_tokens(prompt: list[int], n: int) -> list[int]:
    return Generator(TARGET).generate(prompt, "ar", gen=GenerationConfig(max_new_tokens=n, ignore_eos=True)).token_ids


def run_gloo(tp: int = 1, dp: int = 1, n: int = 40, **kw):
    return generate_async(TARGET, DRAFT, PROMPT, SPEC, GREEDY, GenerationConfig(max_new_tokens=n, ignore_eos=True),
                          set(), transport="gloo", verbose=False, timeout_s=TIMEOUT_S, tensor_parallel_size=tp,
                          draft_tensor_parallel_size=dp, **kw)


def no_children_left() -> bool:
    """No child process of this one is left (multiprocessing's view and the kernel's)."""
    if multiprocessing.active_children():
        return False
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z" and not _is_resource_tracker(pid):  # [state, ppid, ...]
                return False
    return True


def _is_resource_tracker(pid: str) -> bool:
    """multiprocessing's resource tracker: one helper per parent process, alive as long as the
    parent (it is what unlinks semaphores a pool leaked, so it is no worker left behind)."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return "multiprocessing.resource_tracker" in f.read()
    except OSError:
        return True  # already gone


# ---- faults --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,rank,kind,match", [
    (1, 1, "stall", r"^a worker stalled \(silent: draft worker \(rank 1\)\): no draft tree from rank 1 within 3 s"),
    (1, 1, "crash", r"^draft worker \(rank 1\) failed: RuntimeError: injected crash at pass 2$"),
    (1, 1, "exit", r"^draft worker \(rank 1\) exited with status 3$"),
    (2, 1, "crash", r"^target shard \(rank 1\) failed: RuntimeError: injected crash at pass 2$"),
    (2, 1, "stall", r"^a worker stalled \(silent: target shard \(rank 1\)\): "),
], ids=["draft-stall", "draft-crash", "draft-exit", "shard-crash", "shard-stall"])
def test_an_injected_fault_is_one_line_error_and_no_process_is_left(alarm, monkeypatch, tp, rank, kind, match):
    alarm(40)
    monkeypatch.setenv(ENV_FAULT, f"{rank}:{kind}:2")
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=match) as info:
        run_gloo(tp=tp)
    took = time.monotonic() - t0
    assert "\n" not in str(info.value)
    if kind == "crash":
        assert "Traceback" in info.value.detail and "injected crash" in info.value.detail
    # spawn and start-up (~2-6 s here) plus at most the timeout and the shutdown's grace
    assert took < 15 + (TIMEOUT_S if kind == "stall" else 0), took
    assert no_children_left()


def test_a_malformed_fault_spec_is_reported_by_the_worker(alarm, monkeypatch):
    alarm(30)
    monkeypatch.setenv(ENV_FAULT, "1:explode:0")
    with pytest.raises(WorkerError, match=r"^draft worker \(rank 1\) failed: ValueError: .*unknown fault kind"):
        run_gloo()
    assert no_children_left()


# ---- the persistent pool ---------------------------------------------------------------------------
def test_workers_start_once_per_generator_and_serve_later_requests(alarm):
    alarm(60)
    prompts = [PROMPT, [3, 9, 27]]
    want = [ar_tokens(p, 30) for p in prompts]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    with Generator(TARGET, DRAFT) as engine:
        r1, r2 = (engine.generate(p, "async", SPEC, gen=gen, transport="gloo") for p in prompts)
        pool = engine._runners[("worker-pool", "gloo")]
        assert isinstance(pool, WorkerPool) and not pool.closed
        alive = [p.pid for p in multiprocessing.active_children()]
    assert [r1.token_ids, r2.token_ids] == want
    assert r1.stats["worker_pids"] == r2.stats["worker_pids"] == alive and len(alive) == 1
    assert not r1.stats["workers_reused"] and r2.stats["workers_reused"]
    # start-up (spawn, rendezvous, profile) is reported once, apart from each request's overhead
    assert r1.stats["startup_s"] > 0 and r2.stats["startup_s"] == 0.0
    assert r2.stats["pool_startup_s"] == r1.stats["startup_s"]
    assert 0 <= r2.stats["request_overhead_s"] < r1.stats["startup_s"]
    assert pool.closed and no_children_left()


def test_a_failed_request_closes_the_pool_and_the_next_one_starts_a_new_pool(alarm, monkeypatch):
    alarm(60)
    engine = Generator(TARGET, DRAFT)
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    monkeypatch.setenv(ENV_FAULT, "1:crash:1")
    with pytest.raises(WorkerError, match="injected crash"):
        engine.generate(PROMPT, "async", SPEC, gen=gen, transport="gloo")
    assert no_children_left()
    monkeypatch.delenv(ENV_FAULT)
    r = engine.generate(PROMPT, "async", SPEC, gen=gen, transport="gloo")
    assert r.token_ids == ar_tokens(PROMPT, 20) and not r.stats["workers_reused"]
    engine.close()
    assert no_children_left()


def test_workers_run_with_nvlink_multicast_off(alarm):
    alarm(40)
    pool_env = {}
    engine = Generator(TARGET, DRAFT)
    engine.generate(PROMPT, "async", SPEC, gen=GenerationConfig(max_new_tokens=4, ignore_eos=True),
                    transport="gloo", tensor_parallel_size=2)
    pool = engine._runners[("worker-pool", "gloo")]
    pool_env = {rank: info["env"] for rank, info in pool.info.items()}
    engine.close()
    assert sorted(pool_env) == [1, 2]  # the target's second shard and the draft
    assert all(env == NO_MULTICAST for env in pool_env.values())
    assert all(os.environ.get(k) == v for k, v in NO_MULTICAST.items())  # and in this process


# ---- acceptance replay ------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_acceptance_replay_over_gloo_equals_inline(alarm, tp):
    """With a fixed d, the gloo draft runs exactly d rounds per pass, as inline does, so the
    trees, the replayed accepts and the tokens are the same (a sharded target must commit the
    replayed path on every shard, or its logits would drift from inline's)."""
    alarm(40)
    forced = [3, 0, 4, 1, 2]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    want = generate_async(TARGET, DRAFT, PROMPT, SPEC, GREEDY, gen, set(), transport="inline", verbose=False,
                          forced_accepts=forced)
    got = generate_async(TARGET, DRAFT, PROMPT, SPEC, GREEDY, gen, set(), transport="gloo", verbose=False,
                         timeout_s=10, forced_accepts=forced, tensor_parallel_size=tp)
    assert want.accept_lengths[:5] == forced  # the replay was followed (the trees are deep enough)
    assert got.accept_lengths == want.accept_lengths and got.token_ids == want.token_ids
    assert no_children_left()


def test_tree_message_round_trip_keeps_tokens_parents_and_draft_logp():
    from tandem.runtime.workers import decode_tree, encode_tree, tree_size
    from tandem.tree.draft_tree import DraftTree

    tree = DraftTree(tokens=[5, 9, 2, 7], parents=[-1, 0, 0, 1], logp=[0.0, -0.25, -1.5, float("-inf")])
    msg = encode_tree(tree, 6)  # [1 + 3 * 6]
    assert msg.shape == (tree_size(6),) and msg.dtype == torch.long
    back = decode_tree(msg.tolist(), 6)
    assert (back.tokens, back.parents, back.logp) == (tree.tokens, tree.parents, tree.logp)
    assert decode_tree(encode_tree(None, 6).tolist(), 6) is None
