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

import time
from collections.abc import Callable

import torch

from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
# NOTE: the workers live in async_workers.py so that the process transports (workers.py) import
# them without importing this entry point, which dispatches to those transports; the names stay
# importable from here for existing callers.
from tandem.runtime.async_workers import (  # noqa: F401
    AsyncGenerationResult,
    DepthController,
    DraftWorker,
    LocalLink,
    TargetWorker,
    _sync,
    _warm_buckets,
    draft_loop,
    replay_bonus,
    time_step,
)
from tandem.runtime.emit import Emitter
from tandem.runtime.plan import plan_request
from tandem.runtime.runner import runner_for

TRANSPORTS = ("auto", "inline", "streams", "gloo", "nccl")
POOL_TOKENS = 2048  # prompt + new tokens a worker pool's caches hold at least (a longer request restarts it)


# ---- entry point -------------------------------------------------------------------------------
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
    hybrid = getattr(target_model, "is_hybrid", False)
    hybrid_draft = getattr(draft_model, "is_hybrid", False)
    if hybrid_draft and not hybrid:
        raise ConfigError("a Qwen3.5 (hybrid) draft drafts for Qwen3.5 targets only; pair this target with an "
                          "attention-only draft")
    if transport == "auto":
        transport = "streams" if on_cuda and not hybrid else "inline"
    if hybrid and transport != "inline":
        raise ConfigError(f"async with a hybrid target (Qwen3.5) runs the inline transport, not {transport!r}")
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
    plan = plan_request("async", len(prompt_ids), max_new, spec)
    generator = torch.Generator().manual_seed(sampling.seed)

    with torch.no_grad():  # NOTE: not inference_mode: runners (and their caches) outlive this call
        if transport in ("gloo", "nccl"):
            from tandem.runtime.workers import run_process_pair

            # a pool outlives the request: size its caches for a longer one too (up to POOL_TOKENS)
            pool_plan = plan_request("async", 0, max(len(prompt_ids) + max_new, min(ctx_len, POOL_TOKENS)), spec)
            return run_process_pair(target_model, draft_model, prompt_ids, spec, sampling, gen, eos, max_new,
                                    transport, on_tokens, tokenizer, generator, pool_plan,
                                    verbose=verbose, use_graphs=use_graphs,
                                    timeout_s=timeout_s, tp=tensor_parallel_size, dp=draft_tensor_parallel_size,
                                    runners=runners, forced_accepts=forced_accepts)
        streams = transport == "streams"
        t_stream = torch.cuda.Stream(device=target_model.device) if streams else None
        d_stream = torch.cuda.Stream(device=draft_model.device) if streams else None
        if hybrid:  # its tree pass walks the GDN paths; the commit replays the path (runtime.hybrid)
            from tandem.runtime.hybrid import HybridTarget, HybridTargetWorker

            target = HybridTargetWorker(HybridTarget(target_model, plan.target_rows), sampling, generator)
        else:
            target = TargetWorker(runner_for(runners, "target", target_model, plan.target_rows, use_graphs), sampling,
                                  generator, stream=t_stream, deferred=not streams)
        if hybrid_draft:  # its tree rows keep GDN inputs, not states (runtime.hybrid_runner)
            from tandem.runtime.hybrid_runner import HybridDraftRunner

            draft_runner = HybridDraftRunner(draft_model, plan.draft_rows)
        else:
            draft_runner = runner_for(runners, "draft", draft_model, plan.draft_rows, use_graphs)
        draft = DraftWorker(draft_runner, spec, plan.tree_rows, inline=not streams, stream=d_stream)
        if hybrid_draft:
            draft.tree.device_rounds = False  # (the device rounds drive ModelRunner's graphs)
        # NOTE: profiling and graph capture happen before the clock starts, as the serial loop
        # builds its runners before its clock; a server would do both once, not per request.
        if not hybrid:
            _warm_buckets(target.runner, draft.tree.runner, spec, len(prompt_ids))
        # Self-tuning once per engine: the controller (and its trial) lives in `runners` beside the
        # runners it measured; spec.depth given: nothing to tune, so nothing to profile.
        key = ("depth-controller", transport, hybrid, spec.nodes, spec.width, spec.depth)
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
        if len(prompt_ids) > 1 and hybrid:
            target.target.prefill(prompt_ids[:-1])
        elif len(prompt_ids) > 1:
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
