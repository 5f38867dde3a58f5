"""The batched engine: continuous batching with batched speculative decoding.

    plan   = scheduler.plan_step()          # who runs: prefill chunks and verify passes, under a budget
    trees  = draft(plan.decodes)             # each decoding request's tree (ar: the root alone)
    logits = model.forward(rows(plan, trees))  # ONE target pass over every request's rows
    for each request: accept, commit its path in the pool, let its drafter observe, emit

Drafting is batched (tandem.engine.batched_draft): a draft model's chains and level trees, an
EAGLE-3 head's level trees and a block drafter's lattices are drafted for every decoding request
in shared passes over the drafter's own paged pool. Otherwise (`batched_drafting=False`, or a
level tree wider than one mask word) each decoding request owns a drafter of the single-request
runtime (`TreeDrafter`, `ChainDrafter` for a sampled chain, `LatticeDrafter`, `EagleDrafter`) on
its own small `ModelRunner`, created when its prefill is done and dropped on preemption. Feature
drafters read the target's features: the batched pass keeps every row's, the prefill chunks'
are kept until the drafter starts, and each verify hands the drafter its accepted path's.

A greedy step where every request drafts its full tree with a batched tree drafter verifies on
the device (tandem.engine.device_verify: the trees never come back to the host; the target's
rows are built and the paths accepted there; one read-back a step); the other steps read the
trees back and accept on the host (`device_verify=False` makes every step do so).

Two modes change which rows a step holds, never an output:

- `batch_parallel` (tandem.engine.batch_manager): the decoding requests form two batches; the
  step verifies one (KV rows reserved for it alone) while the other is drafted, and the roles
  swap. A drafted tree waits in `req.runtime["pending"]` for the next step. On CUDA the drafting
  runs on its own stream, launched after the target pass so its kernels can overlap the
  target's; on the CPU the two run one after the other (no overlap, same outputs).
- `row_selection` (tandem.engine.row_selection): decodes are planned with their roots, then the
  step's draft nodes are chosen over all requests' trees by path score under a cost model (on a
  GPU measured on this engine when it starts: `measure_row_cost`) and reserved (`Scheduler.grow`).

The draft gate (tandem.engine.draft_gate; with row selection, or `draft_gate=True`) decides before
planning which requests draft this step (all, none, or a sample of them while it learns the
acceptance): by plain and drafting step costs measured on throwaway requests when the engine
starts (`measure_step_costs`), kept current by the steps it sees. TANDEM_GATE_ARMS=1 adds the
measured throughput of both regimes in each concurrency bucket (tandem.engine.gate_arms), which
then decides where it has measured.
"""
from __future__ import annotations

import logging
import os
import secrets
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from tandem.config import ConfigError, SamplingConfig, SpecConfig
from tandem.drafting.chain_drafter import ChainDrafter
from tandem.drafting.feature_drafters import feature_drafter
from tandem.drafting.tree_drafter import TreeDrafter
from tandem.engine.batch_manager import BatchManager
from tandem.engine.batched_draft import BatchedChainDrafter, BatchedDrafter, BatchedTreeDrafter
from tandem.engine.batched_features import BatchedBlockDrafter, BatchedEagleDrafter
from tandem.engine.batched_model import BatchedModel, BatchRows, PackColumns
from tandem.engine.config import EngineConfig
from tandem.engine import batched_draft, device_verify, draft_length
from tandem.engine.draft_gate import DraftGate, StepCosts
from tandem.engine.gate_arms import GateArms
from tandem.engine.request import Request, RequestOutput, RequestState, SamplingParams, new_request_id
from tandem.engine.row_selection import RowCost, select_step
from tandem.engine.scheduler import Scheduler, ScheduledRows, StepPlan
from tandem.engine.hybrid_model import HybridBatchedModel
from tandem.kv.hybrid_pool import HybridKVPool
from tandem.kv.paged import PagedKVPool
from tandem.models.block_drafter import BlockDrafter
from tandem.models.eagle3 import Eagle3Head
from tandem.models.transformer import Transformer
from tandem.runtime.emit import Emitter
from tandem.runtime.plan import plan_request
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree, deepest_depths, tree_masks
from tandem.verify.sampling import probs_from_logits
from tandem.verify.verifier import VerifyResult, greedy_accept, rejection_accept
from tandem.kernels.upload import download, upload

log = logging.getLogger("tandem.engine")

# feature-drafter rows of async plain steps held before they are handed over anyway (their memory bounded)
UNFED_MAX = 256


@dataclass(frozen=True)
class StepRecord:
    """One step, as the metrics keep it."""

    step: int
    rows: int  # rows of the target pass (prefill chunks + verify passes)
    verified: int  # requests verified
    verify_batch: int | None  # batch parallelism: the batch verified (None: plain mode)
    drafted: int  # batch parallelism: requests drafted for the next step
    overlapped: bool  # both batches had decoding requests
    fallback: bool  # decoding with one batch empty (tail effect)
    loads: tuple[int, int] | None  # batch parallelism: load of batch 0 and 1 at the step boundary
    draft_s: float  # seconds drafting the other batch
    overlap: float  # fraction of that drafting hidden under the target pass (CPU: 0.0, sequential)
    nodes: int  # draft nodes verified
    offered: int  # row selection: draft nodes the trees offered (0 when off)
    drafting_s: float = 0.0  # wall seconds drafting this step's trees (their read-back included)
    seconds: float = 0.0  # wall seconds of the whole step


@dataclass
class EngineCounters:
    """Totals over the engine's life; `records` keeps the latest steps."""

    steps: int = 0
    rows: int = 0  # rows over all target passes
    decode_steps: int = 0  # steps that verified at least one request
    batch_parallel_steps: int = 0  # steps with one batch verified while the other drafted
    tail_fallbacks: int = 0
    rebalances: int = 0
    selection_off_steps: int = 0  # row selection chose zero draft nodes (speculation off)
    gate_off_steps: int = 0  # row selection's draft gate skipped drafting (its cost not repaid)
    nodes_selected: int = 0
    nodes_offered: int = 0
    preemptions: int = 0  # requests moved back to waiting, to be recomputed (blocks ran out)
    failed: int = 0  # requests that raised in their own part of a step (ended with finish_reason "error")
    draft_s: float = 0.0  # drafting of the other batch (batch parallelism)
    draft_hidden_s: float = 0.0  # of it, under the target pass (CUDA events; 0 on the CPU)
    drafting_s: float = 0.0  # wall seconds drafting the verified trees (StepRecord.drafting_s, summed)
    step_s: float = 0.0  # wall seconds of every step (the host reads each step's tokens: no extra sync)
    drafted_ahead: int = 0  # device-verified steps whose trees were drafted during the previous step (draft_ahead)
    ahead_dropped: int = 0  # trees drafted ahead that the next step's plan did not verify (dropped)
    accepts_on_device: int = 0  # device-verified steps whose accepts the head ran before the read (device_context)
    async_steps: int = 0  # steps queued before the previous step's tokens were read (async_scheduling)
    spare_rows: int = 0  # of their rows, rows of requests that had ended by the read (EOS, stop, abort)
    trees_before_read: int = 0  # of them, steps that queued the next step's trees before the read too
    drafted_steps: int = 0  # steps that verified draft nodes
    drafted_step_s: float = 0.0  # their wall seconds
    undrafted_steps: int = 0  # steps that verified decodes without draft nodes
    empty_steps: int = 0  # steps whose target pass had no rows (nothing planned)
    records: deque = field(default_factory=lambda: deque(maxlen=4096), repr=False)  # (the latest 4,096 only)

    @property
    def rows_per_step(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        """Flat figures for /metrics and bench results (the latest step record included)."""
        out = {k: v for k, v in asdict(self).items() if k != "records"}
        out["rows_per_step"] = self.rows_per_step
        out["overlap"] = self.draft_hidden_s / self.draft_s if self.draft_s else 0.0
        out["last_step"] = asdict(self.records[-1]) if self.records else None
        return out


@dataclass
class _Inflight:
    """An async-scheduled step (EngineConfig.async_scheduling): its pass queued, its tokens on
    their way to the host."""

    plan: StepPlan
    host: torch.Tensor  # [decodes] each decode's new token (pinned on a GPU: filled once `done` is)
    done: "torch.cuda.Event | None"
    fed: list = field(default_factory=list)  # (request, its drafter's handle): fed this step's token
    fed_feats: torch.Tensor | None = None  # [len(fed), F] their decode rows' target features

    def live(self) -> bool:
        """Whether a request of it still runs (its tokens are still wanted)."""
        return any(not s.request.done for s in self.plan.scheduled)


def _decoding(running: list[Request]) -> int:
    """How many of `running` decode (not in prefill): Request.in_prefill inlined, as the gate
    asks every step for every request."""
    return sum([r.num_computed >= len(r.prompt_ids) + len(r.output_ids) - 1 for r in running])


class _BatchedFeatureHandle:
    """A request's drafter as the engine's step sees it when a batched feature drafter drafts for
    it; the step hands the verify pass's committed tokens and features over for all requests at once."""

    def __init__(self, batched: "BatchedEagleDrafter | BatchedBlockDrafter", request_id: str):
        self.batched, self.request_id = batched, request_id

    # (no observe: the step hands every request's committed rows over at once, Engine._feed)


def _check_hybrid(config: EngineConfig, draft) -> None:
    """One-line errors for what the batched engine does not run with a hybrid (Qwen3.5) target."""
    if getattr(draft, "is_hybrid", False):
        raise ConfigError("the batched engine drafts with attention-only draft models, EAGLE-3 heads or block "
                          "drafters; a Qwen3.5 (hybrid) draft runs in tandem generate / Generator")
    if config.async_scheduling:
        raise ConfigError("async_scheduling does not run hybrid (Qwen3.5) targets (each pass's recurrent state "
                          "is committed before the next is planned); leave it unset or False")
    if config.deterministic:
        raise ConfigError("deterministic (batch-invariant) mode does not cover hybrid (Qwen3.5) targets' GDN "
                          "layers; leave it off")


class Engine:
    def __init__(self, target, draft=None, tokenizer=None, config: EngineConfig = EngineConfig()):
        config.validate()
        # a hybrid (Qwen3.5) target: its GDN layers' recurrent state in the pool beside the K/V
        # blocks (tandem.kv.hybrid_pool), its pass tandem.engine.hybrid_model's
        self.hybrid = getattr(target, "is_hybrid", False)
        if self.hybrid:
            _check_hybrid(config, draft)
        if config.method != "ar" and draft is None:
            raise ConfigError(f"method {config.method!r} needs a draft model; pass one or use method 'ar'")
        # a feature drafter (block drafter, EAGLE-3 head) reads the target's features of every pass
        self.feature_layers = getattr(draft, "target_feature_layers", None) if config.method != "ar" else None
        if draft is not None and config.method != "ar" and not isinstance(draft, Transformer) and not self.feature_layers:
            raise ConfigError(f"the batched engine cannot draft with a {type(draft).__name__}; pass a draft model, "
                              "a block drafter or an EAGLE-3 head")
        if self.feature_layers:
            target.enable_features(self.feature_layers)
        self.target, self.draft, self.tokenizer, self.config = target, draft, tokenizer, config
        self.context_window = target.config.max_position_embeddings
        if draft is not None:
            self.context_window = min(self.context_window, draft.config.max_position_embeddings)
        self.spec, _ = config.spec.capped(self.context_window)
        num_blocks = config.num_blocks or config.max_num_seqs * -(-(self.context_window + config.draft_rows())
                                                                   // config.block_size)
        if self.hybrid:
            self.pool = HybridKVPool(target, num_blocks, config.block_size, config.max_num_seqs)
        else:
            self.pool = PagedKVPool.for_model(target, num_blocks, config.block_size, config.enable_prefix_caching)
        # a request's block table holds at most its context window plus one verify pass's rows
        seq_blocks = self.pool.blocks_for(self.context_window + config.draft_rows())
        graphs = None if not config.enforce_eager else False
        # whether the draft gate decides each step (row selection's draft-cost term, or asked for;
        # by default on a GPU: in one run there, H100 2026-12-07, 256 MBPP requests, EAGLE-3, the
        # gated `tree` ran 1.22 / 1.02 / 0.84 / 0.62x `ar` at 1 / 8 / 32 / 64 requests and the
        # ungated one 1.24 / 1.07 / 0.66 / 0.49x; on the CPU measuring its step costs takes seconds)
        gate_default = config.row_selection or (target.device.type == "cuda" and not self.hybrid)
        gated = (gate_default if config.draft_gate is None else config.draft_gate) \
            and config.method != "ar" and not config.batch_parallel
        # async scheduling (config.async_scheduling): `ar` steps, and the steps in which the draft
        # gate keeps every request from drafting, queued before the last one is read (an engine
        # that has neither keeps its passes free of the device-token feed)
        self._async = (config.async_scheduling if config.async_scheduling is not None
                       else target.device.type == "cuda") and (config.method == "ar" or gated) and not self.hybrid
        if self.hybrid:
            self.model = HybridBatchedModel(target, self.pool, features=bool(self.feature_layers))
        else:
            self.model = BatchedModel(target, self.pool, deterministic=config.deterministic,
                                      max_seqs=config.max_num_seqs, max_seq_blocks=seq_blocks, use_graphs=graphs,
                                      features=bool(self.feature_layers),
                                      device_tokens=config.max_num_batched_tokens if self._async else 0)
        self._inflight: _Inflight | None = None  # the async step queued last, not read yet
        # the feature drafters' rows of async plain steps, not handed over yet (_hand_over):
        # (request, its handle then, [tokens], its step's fed rows [fed, F], its row in them), in step order
        self._unfed: list[tuple[Request, object, list[int], torch.Tensor, int]] = []
        self._row_index: dict[tuple[int, ...], torch.Tensor] = {}  # device indexes of feature rows (_rows_of)
        self._sampled: set[str] = set()  # requests that sample (their steps run synchronously)
        # every request's draft from shared passes of the drafter (batched_draft), where it applies
        self.batched: BatchedDrafter | BatchedBlockDrafter | None = None
        if config.batched_drafting and config.method in ("chain", "tree"):
            self.batched = self._batched_drafter(draft, num_blocks, graphs)
        # the CUDA graphs of every pass size a step can take, captured now rather than mid-serving
        self.model.warmup(config.max_num_batched_tokens)
        if self.batched is not None:  # its passes (and level trees), by bucket
            self.batched.warmup(config.max_num_seqs)
        self._verify_rows = 1 if config.row_selection else config.draft_rows()  # a decode's rows in a plan
        self._drafting: set[str] | None = None  # this step's drafting requests (None: all; the draft gate's pick)
        self.scheduler = Scheduler(config, self.pool, row_budget=self._row_budget)
        self.requests: dict[str, Request] = {}
        self.eos = set(target.config.eos_token_ids)
        self.steps = 0
        self.counters = EngineCounters()
        self.batches: BatchManager | None = None
        self._draft_stream = None
        # the next step's trees, drafted at the end of a device-verified step (config.draft_ahead):
        # (the request ids in plan order, their trees [6, R, n] on the device, n)
        self._ahead: tuple[list[str], torch.Tensor, int] | None = None
        # called with each decoding request before its accept; whatever it raises fails that
        # request alone (the reliability harness injects faults through it: tandem serve --inject-faults)
        self.fault_hook: Callable[[Request], None] | None = None
        self._accepted = 0  # accepted draft tokens in the current step (the gate's figure)
        self._deepest: list[int] = []  # each decode's tree's deepest node's depth, in plan order (_rows: _apply)
        if config.batch_parallel:
            self.batches = BatchManager(self._load, config.rebalance_threshold)
            if target.device.type == "cuda":  # the drafter's kernels on their own stream
                self._draft_stream = torch.cuda.Stream(device=target.device)
        self.gate: DraftGate | None = None
        # the measurements' steps: every request drafts (True), none (False), or a sample of k (k)
        self._forced: bool | int | None = None
        self._drafted_before: set[str] = set()  # the requests that drafted in the gate's last observed step
        self._sample: list[str] = []  # the gate's sample (its learning and probe steps draft these)
        # the plain requests whose feature drafters are kept fed this step (None: all). Once the
        # gate has kept drafting off for a while (dormant) only its sample's are (parked: none but a
        # probe's): feeding every request cost a plain step 1.61 ms against `ar`'s 0.97 at 64
        # requests (H200, 2026-12-02); the others restart when drafting resumes
        self._keep_fed: set[str] | None = None
        self._dormant = False  # the gate has kept drafting off long enough: only its sample stays fed
        # TANDEM_GATE_PARK=1: a dormant gate feeds no drafter between its probes (_off_or_probe); by
        # default it keeps its sample's fed. On an H100 (2026-12-07, 256 MBPP requests, EAGLE-3)
        # parking took `tree+gate` / `ar` at 64 requests from 0.67x to 0.77x but at 8 from 1.10x to
        # 0.95x: a probe's drafters, started then, lacked the target's features of the tokens since
        # their prompt, accepted ~1.4 tokens a step instead of ~6, and kept drafting off
        self._park = os.environ.get("TANDEM_GATE_PARK", "0") == "1"
        # a dormant step has released every drafter outside _keep_fed: the next async plain steps
        # visit those requests only (a visit to each of 64 cost a plain step ~20 us)
        self._swept = False
        # row selection's c(rows): given, or measured on this engine's target pass
        self.row_cost = config.row_cost
        measure = config.measure_row_cost if config.measure_row_cost is not None else target.device.type == "cuda"
        if config.row_selection and measure and not config.row_cost.points:
            self.row_cost = self.measure_row_cost()
        # row selection's draft-cost term: whether a step drafts at all (None: always drafts),
        # from this engine's step costs, measured now on throwaway requests
        if gated:
            # the cost model alone decides; TANDEM_GATE_ARMS=1 adds the measured arms. On an H100
            # (2026-12-07, 256 MBPP requests, EAGLE-3) the model alone beat them at every level
            # (1.43 / 1.02 / 0.68 / 0.58x `ar` at 1 / 8 / 32 / 64 requests against 1.13 / 0.91 /
            # 0.66 / 0.47x): at one request their windows of plain decoding, explored against a
            # drafting rate that varies with each prompt, took 39% of the run
            arms = GateArms() if os.environ.get("TANDEM_GATE_ARMS", "0") == "1" else None
            self.gate = DraftGate(config.step_costs or self.measure_step_costs(), arms=arms,
                                  ceiling=self._accept_ceiling())
        warm = config.warmup_request if config.warmup_request is not None else target.device.type == "cuda"
        if warm:
            self.warmup_request()

    def _accept_ceiling(self) -> int:
        """The most draft tokens one request can have accepted in a step: a chain's k; a block
        drafter's tree at most its block's positions after the root; a level tree its depth (each
        level one deeper); never more than the node budget."""
        spec = self.spec
        if self.config.method == "chain":
            return spec.k
        if isinstance(self.draft, BlockDrafter):
            return min(spec.nodes, self.draft.bconfig.block_size - 1)
        return min(spec.nodes, spec.resolved_depth())

    def _batched_drafter(self, draft, num_blocks: int, graphs: bool | None):
        """The batched drafter of this draft and method, or None (each request then drafts on its
        own: a level tree or greedy chain wider than one mask word per row, or a draft it does not know)."""
        cfg, spec = self.config, self.spec
        chain = cfg.method == "chain"
        width, depth = (1, spec.k) if chain else (spec.width, spec.resolved_depth())  # a chain: a width-1 tree

        def seq_blocks(rows: int) -> int:  # a request's block table for `rows` rows (one block to spare)
            return -(-rows // cfg.block_size) + 1

        def pool_blocks(rows: int) -> int:  # blocks for max_num_seqs requests of `rows` rows each
            return cfg.max_num_seqs * seq_blocks(rows)

        if isinstance(draft, Transformer):
            if not BatchedTreeDrafter.fits(width, depth):  # (a greedy chain is the width-1 tree)
                return None
            ahead = spec.k if chain else (depth - 1) * width
            # (a request's draft rows exceed its target rows by at most the drafted rows plus one block)
            blocks = num_blocks + pool_blocks(ahead + 1)
            sizes = dict(max_seqs=cfg.max_num_seqs, max_seq_blocks=self.pool.blocks_for(
                self.context_window + ahead + 2 * cfg.block_size), use_graphs=graphs)
            if chain:
                return BatchedChainDrafter(draft, blocks, cfg.block_size, spec.k, **sizes)
            return BatchedTreeDrafter(draft, blocks, cfg.block_size, width, depth, nodes=spec.nodes, **sizes)
        if isinstance(draft, Eagle3Head):  # its level trees (a chain: its greedy path)
            if not BatchedEagleDrafter.fits(width, depth):
                return None
            rows = self.context_window + depth + (depth - 1) * width + 1  # (run_accepts reserves depth + 1 more)
            return BatchedEagleDrafter(draft, pool_blocks(rows), cfg.block_size, width, depth,
                                       max_seqs=cfg.max_num_seqs, max_seq_blocks=seq_blocks(rows),
                                       use_graphs=graphs, nodes=spec.k if chain else spec.nodes)
        if isinstance(draft, BlockDrafter):  # its lattices in one pass (each tree built per request)
            rows = self.context_window + draft.bconfig.block_size
            return BatchedBlockDrafter(draft, pool_blocks(rows), cfg.block_size, spec.k if chain else spec.nodes,
                                       chain, self.context_window, max_seqs=cfg.max_num_seqs,
                                       max_seq_blocks=seq_blocks(rows), use_graphs=graphs)
        return None

    # ---- public API ----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None, prompt: str | None = None) -> Request:
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a SamplingParams (got {type(params).__name__})")
        params.validate()
        if params.n != 1:
            raise ConfigError(f"n={params.n}: the engine runs one completion per request; add n requests "
                              "(LLM.generate does)")
        if isinstance(prompt_ids, (str, bytes)) or not all(type(t) is int for t in prompt_ids):
            raise ConfigError("prompt_ids must be a list of int token ids (encode text with the tokenizer first)")
        if not prompt_ids:
            raise ConfigError("the prompt is empty; give at least one token of text")
        vocab = self.target.config.vocab_size
        if not all(0 <= t < vocab for t in prompt_ids):
            raise ConfigError(f"prompt token ids must be in [0, {vocab}) (the target's vocabulary)")
        if len(prompt_ids) >= self.context_window:
            raise ConfigError(f"prompt is {len(prompt_ids)} tokens but the context window is "
                              f"{self.context_window}; shorten the prompt")
        if request_id is not None and not isinstance(request_id, str):
            raise ConfigError(f"request_id must be a string (got {type(request_id).__name__} {request_id!r})")
        if params.seed is None:  # (vLLM's default: a fresh random stream per request)
            params = replace(params, seed=secrets.randbits(63))
        req = Request(list(prompt_ids), params, prompt=prompt)
        if request_id is not None:
            req.request_id = request_id
            if request_id in self.requests:
                raise ConfigError(f"request id {request_id!r} is in use")
        while req.request_id in self.requests:  # (a generated id a caller took for one of its own)
            req.request_id = new_request_id()
        # (max_tokens None: up to the context window, as vLLM)
        room = self.context_window - len(prompt_ids)
        req.max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        need = self.pool.blocks_for(len(prompt_ids) + req.max_new + self.config.draft_rows())
        if need > self.pool.num_blocks:
            raise ConfigError(f"request needs {need} KV blocks but the pool has {self.pool.num_blocks}; "
                              f"raise num_blocks or lower max_tokens")
        self.requests[req.request_id] = req
        if not req.params.sampling().greedy:
            self._sampled.add(req.request_id)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state; its blocks and drafter are released. False if unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None or req.done:
            return False
        self._end(req, RequestState.ABORTED, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self._inflight is not None and self._inflight.live())

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run one target pass; returns the requests that finished in it (with async scheduling,
        those that finished in the pass before, whose tokens this step read)."""
        try:
            # the gate decides before planning (a step without drafting reserves one row a request)
            drafting = self._gate_drafts()
            if self._pipelines(drafting):
                return self._async_step(drafting)
            out = self._drain()
            self._hand_over()  # (the drafters' rows of the async steps before it, before it drafts or feeds)
            return out + self._step(drafting)
        except BaseException:
            self._inflight = None  # (its requests are failed by the caller; their rows are not wanted)
            raise

    def _step(self, drafting: set[str] | None) -> list[RequestOutput]:
        """One synchronous step: plan, draft, one target pass, accept, commit, emit. drafting:
        the requests that draft (None: all; the draft gate's pick)."""
        t_step = time.perf_counter()
        ahead, self._ahead = self._ahead, None  # (trees drafted during the last step: this step's, or dropped)
        verify, verify_batch, overlapped, fallback, loads = self._boundary()
        admit = self.row_cost.flat_rows() if self.config.row_selection and self.config.prompt_admission else None
        self._drafting = drafting
        plan = self.scheduler.plan_step(verify, admit, verify_batch or 0)
        for req in plan.preempted:
            self._drop_draft(req)
        finished: list[RequestOutput] = []
        trees: dict[str, DraftTree] = {}
        offered = drafted = 0
        draft_s = overlap = 0.0
        drafting_s = None  # seconds spent drafting this step's trees (the gate's figure), None: no drafting
        nodes = 0  # draft nodes verified
        if plan:
            # the requests the draft gate keeps from drafting this step decode plain (roots only)
            drafts, plain = [], []
            for s in plan.decodes:
                (drafts if self._drafts(s.request) else plain).append(s)
            steady = self.gate is not None and self._steady(drafts)  # (before the step extends the outputs it reads)
            trees = {s.request.request_id: self._skip_draft(s.request) for s in plain}
            n_dev = self._device_nodes(plan, drafts, plain)
            self._accepted = 0
            if n_dev:  # trees drafted, verified and accepted on the device: one read-back
                t0 = time.perf_counter()
                tree = self._device_drafts([s.request for s in drafts], n_dev, ahead)
                ahead = None
                drafting_s = time.perf_counter() - t0  # (queued: the device drafts while the host packs)
                finished = self._verify_on_device(plan, tree, n_dev)
                nodes = len(drafts) * n_dev
            else:
                if drafts:
                    t0 = time.perf_counter()
                    offered = self._host_drafts(plan, drafts, trees)
                    drafting_s = time.perf_counter() - t0
                logits, drafted, draft_s, overlap = self._forward(plan, trees)  # logits: [decode rows, vocab]
                finished = self._apply(plan, trees, logits)
                nodes = sum([len(t.tokens) for t in trees.values()]) - len(trees)
            if self.gate is not None and self._forced is None:  # (the accepts read the logits: the pass is done)
                drafted_now = {s.request.request_id for s in drafts}
                self.gate.observe(len(plan.decodes), len(drafts), time.perf_counter() - t_step, self._accepted,
                                  prefill_rows=plan.prefill_rows, steady=steady)
                self._drafted_before = drafted_now
        if ahead is not None:
            self.counters.ahead_dropped += 1
        if self.batches is not None:
            self.batches.swap()
        self._record(plan, nodes, verify_batch, overlapped, fallback, loads, drafted, draft_s, overlap,
                     offered, drafting_s or 0.0, time.perf_counter() - t_step)
        self.steps += 1
        if self.config.debug_check:
            problems = self.pool.check() + (self.batched.pool.check() if self.batched is not None else [])
            assert not problems, problems
        return finished

    @torch.no_grad()
    def warmup_request(self, decode_steps: int = 3) -> None:
        """One throwaway greedy request (a random prompt one catch-up chunk long and a bit more)
        through its prefill and `decode_steps` decode steps, drafting as this engine drafts, then
        aborted; the step count and counters start afresh. First-use costs (Triton compiles,
        lazily loaded CUDA modules, the drafter's first catch-up pass) are paid here."""
        g = torch.Generator().manual_seed(2)
        n = min(batched_draft.CATCH_UP_CHUNK + 8, self.context_window - self.config.draft_rows() - decode_steps - 2)
        if n < 2:
            return
        try:
            req = self.add_request(torch.randint(0, self.target.config.vocab_size, (n,), generator=g).tolist(),
                                   SamplingParams(max_tokens=decode_steps * self.config.draft_rows(), ignore_eos=True))
        except ConfigError as e:  # (a pool sized below one such request: nothing to warm with)
            log.info("no warm-up request: %s", e)
            return
        saved, self._forced = self._forced, (self.config.method != "ar") or None  # (the gate lets it draft)
        try:
            for _ in range(n + 4 * decode_steps):  # (prefill chunks, then the decode steps; bounded)
                if req.done or req.figures.target_passes >= decode_steps:
                    break
                self.step()
        finally:
            self._forced = saved
            self.abort(req.request_id)
            self._drain()  # (an async step of it may still be queued)
        self.steps, self.counters = 0, EngineCounters()

    @torch.no_grad()
    def measure_row_cost(self, reps: int = 3) -> RowCost:
        """c(rows) of this engine's target pass, measured: the median wall seconds of the first step
        of one throwaway request of n + 1 random tokens, its prefill of n rows (a fresh prompt each
        time: no prefix-cache hit), n = 1, 8, 16, .. up to max_num_batched_tokens, within the
        window and the pool. A step's host work for one request is in every point alike. Called
        when the engine starts."""
        cfg = self.config
        cap = min(cfg.max_num_batched_tokens, self.context_window - 3,
                  (self.pool.num_blocks - 1) * cfg.block_size - cfg.draft_rows() - 1)
        sizes = [n for n in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= cap]
        g = torch.Generator().manual_seed(1)
        vocab = self.target.config.vocab_size
        saved, self._forced = self._forced, False  # (prefill only; no drafter starts)
        points = []
        for n in sizes:
            times = []
            for _ in range(reps + 1):  # (the first of each size warms it)
                req = self.add_request(torch.randint(0, vocab, (n + 1,), generator=g).tolist(),
                                       SamplingParams(max_tokens=1, ignore_eos=True))
                t0 = time.perf_counter()
                self.step()  # (its prefill: n rows, the last prompt token being the first root)
                times.append(time.perf_counter() - t0)
                self.abort(req.request_id)
            # (never below a smaller pass's: timing noise must not make more rows look cheaper)
            points.append((n, max([statistics.median(times[1:])] + [c for _, c in points])))
        self._forced = saved
        self.steps, self.counters = 0, EngineCounters()
        return RowCost(points=tuple(points))

    @torch.no_grad()
    def measure_step_costs(self, steps: int = 3) -> StepCosts:
        """The draft gate's step costs, measured on this engine: for R throwaway requests (random
        prompts of 16 tokens; R = 1, 4, 16, .. up to max_num_seqs) the median wall seconds of
        steady decode steps where none drafts, where all do, and where the gate's probe sample does
        (`StepCosts.probe`): `steps` pairs of each, alternating, the second of each pair timed (the
        first drafting step after plain ones catches up on their tokens; the first plain one after
        drafting reads nothing).
        The requests are aborted and the counters reset afterwards; called when the engine starts,
        before any request."""
        cfg = self.config
        levels = sorted({min(4 ** i, cfg.max_num_seqs) for i in range(8) if 4 ** i < 4 * cfg.max_num_seqs})
        g = torch.Generator().manual_seed(0)
        vocab = self.target.config.vocab_size
        plain: list[float] = []
        drafting: list[float] = []
        probe: list[float] = []
        sample = DraftGate.sample  # (the gate's probes draft for this many of the requests)
        for r in levels:
            # enough new tokens for every step to decode, within the window and r requests' share
            # of the pool (a request that ends early leaves its steps to the others)
            share = self.pool.num_blocks // r * cfg.block_size - 16 - cfg.draft_rows() - cfg.block_size
            new = min((6 * steps + 3) * cfg.draft_rows(), self.context_window - 17, share)
            if new < 6 * steps + 3 and plain:
                break  # (the pool is sized for fewer or shorter requests: the gate extrapolates)
            params = SamplingParams(max_tokens=max(1, new), ignore_eos=True)
            try:
                reqs = [self.add_request(torch.randint(0, vocab, (16,), generator=g).tolist(), params)
                        for _ in range(r)]
            except ConfigError as e:  # (a pool too small for even these requests)
                for q in list(self.requests):
                    self.abort(q)
                if plain:
                    break
                raise ConfigError(f"the draft gate cannot measure this engine's steps: {e}") from None
            while any(q.in_prefill or q.state == RequestState.WAITING for q in reqs):
                self.step()
            times: dict[str, list[float]] = {"plain": [], "draft": [], "probe": []}
            before = None
            # (steps of each kind come in pairs and the second is timed: with async scheduling a
            # plain step reads the one before it, and the first of a pair, after a drafting step,
            # reads nothing, its read landing on the next step; the first drafting step after
            # plain ones catches its drafters up and cannot run their pass over its accepts
            # before its read, as the steady ones do: 6.1 ms against 2.4 at 64 requests on the
            # H200, 2026-12-03, and timed it kept drafting off where steady drafting was even)
            # (and a probe's pair, a sample of the requests drafting, as the gate's probes run:
            # a synchronous step whose other requests take the host path of a drafting step)
            probing = sample < r
            kinds = {"draft": True, "plain": False, "probe": sample}
            for kind in ["draft", "draft"] + (["plain", "plain", "probe", "probe", "draft", "draft"] if probing
                                             else ["plain", "plain", "draft", "draft"]) * steps:
                self._forced = kinds[kind]
                t0 = time.perf_counter()
                self.step()
                if kind == before:
                    times[kind].append(time.perf_counter() - t0)
                before = kind
            self._forced = None
            for q in reqs:
                self.abort(q.request_id)
            self._drain()
            plain.append(statistics.median(times["plain"]))
            drafting.append(statistics.median(times["draft"]))
            probe.append(statistics.median(times["probe"]) if probing else drafting[-1])
        self._forced = None
        self._sample = []
        self.steps, self.counters = 0, EngineCounters()
        return StepCosts(tuple(levels[:len(plain)]), tuple(plain), tuple(drafting), tuple(probe), sample)

    def metrics(self) -> dict:
        """The engine's counters as a flat dict (for /metrics and bench results)."""
        return self.counters.as_dict()

    def run(self, on_step: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Step until every request is done; the outputs in finishing order."""
        done: list[RequestOutput] = []
        while self.has_unfinished():
            out = self.step()
            done += out
            if on_step is not None:
                on_step(out)
        return done

    # ---- the pieces of a step ---------------------------------------------------------------
    def _boundary(self) -> tuple[Callable[[Request], bool] | None, int | None, bool, bool, tuple[int, int] | None]:
        """Batch parallelism at the step boundary: assign the requests that started decoding,
        rebalance, pick the roles. Returns the verify filter, the verify batch, whether the step
        overlaps, whether it is a tail fallback, and the loads (None / False in plain mode)."""
        bm = self.batches
        if bm is None:
            return None, None, False, False, None
        decoding = [r for r in self.scheduler.running if not r.in_prefill]
        for r in decoding:
            if r.request_id not in bm.batch_of:
                bm.assign(r)
        bm.rebalance()
        loads = bm.loads()
        verify_batch, overlapped, fallback = bm.roles(decoding)
        return ((lambda r: bm.batch_of.get(r.request_id, verify_batch) == verify_batch), verify_batch, overlapped,
                fallback, loads)

    def _load(self, req: Request) -> int:
        """A request's weight in batch balancing: its KV rows plus one verify pass's rows."""
        return req.num_computed + self.config.draft_rows()

    def _row_budget(self, req: Request) -> int:
        # row selection plans the roots first and grows them by the chosen nodes (`_select`)
        drafting = self._drafting  # (_drafts, inlined: the scheduler asks for every request every step)
        return self._verify_rows if drafting is None or req.request_id in drafting else 1

    def _steady(self, drafts: list) -> bool:
        """Whether a step drafting for `drafts` (scheduled decodes) is steady for the gate: every
        drafted request drafted in the step before too, or decodes for the first time while at
        most half of them do. A steady state admits a request every step or two, and its
        drafter's start over the prompt is part of what drafting costs there: counted as unsteady,
        hardly a step taught the cost (H200 2026-12-03). A step that is mostly newcomers (at one
        request, every request's first) is their start, not a steady step. Not one that decoded
        plain since: its drafter first catches up. Read before the step runs: after it, a new
        request's output already holds the step's accepted tokens, and every step that admitted one
        looked unsteady (at 64 requests in a steady state, 13 of ~100 drafting steps counted, and
        the gate kept drafting on at 0.47x `ar`, H100 2026-12-07)."""
        before, new = self._drafted_before, 0
        for s in drafts:
            if s.request.request_id not in before:
                if len(s.request.output_ids) > 1:
                    return False
                new += 1
        return 2 * new <= len(drafts)

    def _drafts(self, req: Request) -> bool:
        """Whether the request drafts this step (the draft gate's pick)."""
        return self._drafting is None or req.request_id in self._drafting

    def _gate_drafts(self) -> set[str] | None:
        """The requests that draft in the coming step, None for all (always so without a gate):
        all, none, or a sample (the gate's learning and probes), taken in turn."""
        self._keep_fed = None
        if self.gate is None and self._forced is None:
            return None
        running = self.scheduler.running
        if self._forced is not None:  # (measure_step_costs and warm-ups, before the gate exists)
            n = _decoding(running)
            k = n if self._forced is True else (0 if self._forced is False else min(self._forced, n))
            if k >= n and k:
                self._dormant = self._swept = False
                return None
            # (a plain step or a probe's shape, a sample of k drafting, as the gate's off regime runs
            # them: only the sample's drafters fed, the others dormant; a plain step that fed them
            # all cost 1.5-1.7x, H200 2026-12-03, and made drafting look cheaper by a x that)
            self._dormant = True
            return self._dormant_step(running, k)
        n = _decoding(running)
        k = self.gate.plan(n)
        if k >= n and k:
            self._dormant = self._swept = False
            return None
        self._dormant = self.gate.dormant
        if not self._dormant:  # (the first plain steps after drafting: every drafter still fed)
            self._swept = False
            return set(self._pick_sample(running, k)) if k else set()
        return self._dormant_step(running, k)

    def _dormant_step(self, running: list[Request], k: int) -> set[str]:
        """A dormant gate's step: plain (k = 0) or a probe of k; parked (TANDEM_GATE_PARK=1) or its
        sample kept fed (the default)."""
        return self._off_or_probe(running, k) if self._park else self._sample_fed(running, k)

    def _sample_fed(self, running: list[Request], k: int) -> set[str]:
        """A dormant gate's step (the default): plain (k = 0) or a probe of k, its sample's drafters
        kept fed through the plain steps (the next probe drafts those, on the target's features of
        every token), the others released."""
        sample = self._pick_sample(running, k or getattr(self.gate, "sample", DraftGate.sample))
        self._keep_fed = set(sample)
        return set(sample) if k else set()  # (a request admitted this step that decodes at once does not draft either)

    def _off_or_probe(self, running: list[Request], k: int) -> set[str]:
        """A dormant gate's step when it parks (TANDEM_GATE_PARK=1): plain (k = 0), every drafter
        released and none fed, so the step costs what `ar`'s does; or a probe of k requests, the
        newest decoding ones, whose drafters start over their context (zeros for the target
        features of the tokens since the prompt). Keeping a sample fed between probes (a gather of
        its features, a hand-over, a drafter start whenever a member ended) cost a plain step ~0.08
        ms of host work at 64 requests, 0.53 against `ar`'s 0.45 ms (H100, 2026-12-07), where probes
        come every few hundred steps; but the started drafters proposed badly (see Engine.__init__)."""
        if not k:
            self._sample = []
            self._keep_fed = set()
            return set()
        # (a probe's first step comes after a plain one, which emptied the sample: the newest
        # requests; its second step keeps them)
        sample = self._pick_sample(running, k)
        self._swept = False  # (the next plain step releases the probe's drafters)
        self._keep_fed = set(sample)
        return set(sample)  # (a request admitted this step that decodes at once does not draft either)

    def _pick_sample(self, running: list[Request], k: int) -> list[str]:
        """The gate's sample of k decoding requests (of `running`, those not in prefill). It stays
        while its requests decode (a parked gate's plain step empties it): a request new to it
        first catches up on every token since it last drafted, so a sample that moved on each step
        made every probe a catch-up of a long stretch (H200, 2026-12-02: 34 ms probes against 1 ms
        plain steps)."""
        kept = [rid for rid in self._sample if (r := self.requests.get(rid)) is not None
                and r.state is RequestState.RUNNING and not r.in_prefill][:k]
        if len(kept) < k:  # (only then a walk over the requests)
            # the newest first (`running` is in admission order): a request that has just left its
            # prompt stays in the sample longest and its drafter starts over the prompt alone, with
            # the prompt's own features. The oldest first turned the sample over as they ended, and
            # each newcomer's drafter started over its whole output, on zeros for the features it
            # had missed (on the CPU at 32 requests the starts cost a plain step 0.33 ms of head passes)
            for r in reversed(running):
                if len(kept) >= k:
                    break
                if not r.in_prefill and r.request_id not in kept:
                    kept.append(r.request_id)
        self._sample = kept
        return kept

    def _drop_draft(self, req: Request) -> None:
        """Preempted: its draft K/V and pending tree are rebuilt when it returns."""
        if self.batched is not None:
            self.batched.release(req.request_id)
        self._drop_ahead(req)
        req.runtime.pop("drafter", None)
        req.runtime.pop("pending", None)
        req.runtime.pop("features", None)  # recomputed with the prefill when it returns
        if self.batches is not None:
            self.batches.recycle(req)

    def _proposal(self, req: Request) -> DraftTree:
        """The request's full tree: the one drafted while the other batch was verified, or now."""
        tree = req.runtime.pop("pending", None)
        if tree is not None:
            return tree
        drafter = req.runtime.get("drafter")
        if drafter is None:
            drafter = req.runtime["drafter"] = self._new_drafter(req)
            if self.feature_layers:
                drafter.start(req.token_ids(), self._prompt_features(req))
            else:
                drafter.start(req.token_ids())
        return drafter.propose()

    def _prompt_features(self, req: Request) -> torch.Tensor | None:
        """The target features [len - 1, F] of the request's rows before its root, kept from its
        prefill chunks. Rows served from the prefix cache were not computed: their features are
        zeros (the drafter's first proposals are weaker, never wrong)."""
        parts = req.runtime.pop("features", [])
        need = len(req.token_ids()) - 1
        if need <= 0 or not parts:
            return None
        have = torch.cat(parts)[-need:]  # [<= need, F]
        if have.shape[0] == need:
            return have
        out = have.new_zeros(need, have.shape[1])
        out[need - have.shape[0]:] = have
        return out

    def _draft(self, s: ScheduledRows, drafted: DraftTree | None = None) -> DraftTree:
        """The request's tree for this pass, at most `s.rows` nodes (root included): `drafted`
        (its full tree from the batched drafter), or its own drafter's."""
        req = s.request
        root = req.last_token
        if drafted is None and (self.config.method == "ar" or s.rows == 1 and "drafter" not in req.runtime):
            return DraftTree.root(root)
        tree = drafted if drafted is not None else self._proposal(req)
        if self.config.adaptive_draft:  # the nodes this request's calibrated draft believes in
            tree = draft_length.confident(tree, self._calibration(req).rho, self.config.min_node_prob)
        if len(tree) > s.rows:  # the first rows of a topological order are prefix-closed
            tree = tree.subset(list(range(s.rows)))
        return tree

    def _batched_drafts(self, reqs: list[Request]) -> dict[str, DraftTree]:
        """The requests' full chains / trees (k or N draft nodes) from the batched drafter, keyed by
        request id; empty without one (each request then drafts on its own)."""
        if self.batched is None or not reqs:
            return {}
        chain = self.config.method == "chain"
        cap = self.spec.k if chain else self.spec.nodes
        todo = [(r.request_id, r.token_ids(), cap) for r in reqs]
        if self._feature_handles(reqs):  # point masses, greedy or sampled
            return self.batched.propose(todo)
        if not chain:  # a tree is a set of point masses, greedy or sampled: rejection stays lossless
            return self.batched.propose(todo)
        # a sampled chain draws from the draft's q with the request's generator and keeps q
        sampled = {rid: (self.requests[rid].params.sampling(), self._generator(self.requests[rid]))
                   for rid, _, _ in todo if not self.requests[rid].params.sampling().greedy}
        return self.batched.propose(todo, sampled)

    def _draft_pending(self, reqs: list[Request]) -> None:
        """Batch parallelism: the other batch's full trees, drafted now and verified next step
        (together where batched_draft applies, by each request's drafter otherwise)."""
        trees = self._batched_drafts(reqs)
        for r in reqs:
            r.runtime["pending"] = trees[r.request_id] if r.request_id in trees else self._proposal(r)

    def _feature_handles(self, reqs: list[Request]) -> bool:
        """Every request's handle on the batched feature drafter (started where missing); False
        without one."""
        if not isinstance(self.batched, (BatchedEagleDrafter, BatchedBlockDrafter)):
            return False
        for r in reqs:
            self._feature_handle(r)
        return True

    def _feature_handle(self, req: Request) -> "_BatchedFeatureHandle":
        """The request's handle on the batched feature drafter, started on its whole context
        (with its prefill's features) the first time."""
        h = req.runtime.get("drafter")
        if h is None:
            self.batched.start(req.request_id, req.token_ids(), self._prompt_features(req))
            h = req.runtime["drafter"] = _BatchedFeatureHandle(self.batched, req.request_id)
        return h

    def _skip_draft(self, req: Request) -> DraftTree:
        """An `ar` step for a request while the gate keeps drafting off. A batched feature drafter
        keeps being handed the committed rows and their target features (the pass computes them
        anyway), so drafting resumes where it stopped, on real features; once the gate has kept
        drafting off for `DraftGate.dormant_after` plain steps in a row, only its sample's are
        (none when parked; `_keep_fed`): the others' drafters go, and restart from the whole context when drafting
        resumes (zeros for the features they missed: weaker first proposals, never wrong ones).
        A per-request drafter is dropped: it did not propose this step, so it restarts from the
        whole context."""
        self._plain_drafter(req)
        return DraftTree.root(req.last_token)

    def _plain_drafter(self, req: Request) -> None:
        """What a plain step does to the request's drafter (_skip_draft)."""
        if isinstance(self.batched, (BatchedEagleDrafter, BatchedBlockDrafter)):
            if self._keep_fed is None or req.request_id in self._keep_fed:
                self._feature_handle(req)
            elif req.runtime.pop("drafter", None) is not None:  # dormant: it restarts when drafting resumes
                self.batched.release(req.request_id)
        else:
            req.runtime.pop("drafter", None)
            req.runtime.pop("features", None)  # (a restarted feature drafter reads zeros for them)

    def _host_drafts(self, plan: StepPlan, drafts: list[ScheduledRows], trees: dict[str, DraftTree]) -> int:
        """The drafting requests' trees, read back to the host (into `trees`); returns the nodes
        row selection offered (0 without it)."""
        if self.config.row_selection:
            picked, offered = self._select(plan, drafts)
            trees.update(picked)
            return offered
        # full drafts, cut to each request's rows as _draft cuts them (a sampled chain draws the
        # same tokens from its generator whatever its row budget)
        # (batch parallelism: the verified batch's trees were drafted last step: "pending")
        full = self._batched_drafts([s.request for s in drafts if "pending" not in s.request.runtime])
        if self.config.method == "ar":  # (every tree its root: _draft's answer, without the call)
            trees.update((s.request.request_id, DraftTree.root(s.request.last_token)) for s in drafts)
        else:
            trees.update((s.request.request_id, self._draft(s, full.get(s.request.request_id))) for s in drafts)
        return 0

    # ---- verifying on the device ------------------------------------------------------------
    def _device_nodes(self, plan: StepPlan, drafts: list[ScheduledRows], plain: list[ScheduledRows]) -> int | None:
        """The nodes of each tree when this step drafts, verifies and accepts on the device (every
        scheduled request a greedy decode that drafts the full tree with the batched tree drafter;
        none of the modes that read trees on the host), else None."""
        cfg = self.config
        if (not cfg.device_verify or self.hybrid or cfg.method != "tree" or plain or not drafts or len(drafts) != len(plan.scheduled)
                or cfg.row_selection or cfg.adaptive_draft or self.batches is not None or self.fault_hook is not None
                or self._reads_accepts([s.request for s in drafts]) or not isinstance(self.batched, BatchedTreeDrafter)):
            return None
        n = self.batched.device_nodes(len(drafts), self.spec.nodes)
        if n is None or n + 1 > 64:  # (a row's tree mask in one 64-bit word)
            return None
        for s in drafts:
            if s.rows < n + 1 or not self._sampling(s.request).greedy:
                return None
        return n

    def _reads_accepts(self, requests) -> bool:
        """Whether this step's accepts must each run `_accept` on the host, with its logits (no
        device verification, no greedy-root shortcut): a subclass that overrides `_accept` does,
        unless it says otherwise here (the server's LogprobEngine: when a request asked for logprobs)."""
        return type(self)._accept is not Engine._accept

    def _device_drafts(self, reqs: list[Request], n: int,
                       ahead: tuple[list[str], torch.Tensor, int] | None = None) -> torch.Tensor:
        """Every request's tree from the batched tree drafter, left on the device: [6, R, n]
        (BatchedTreeDrafter.propose_device); `ahead`'s when it drafted these requests, in this
        order, with n nodes each (drafted during the last step: _draft_ahead)."""
        if ahead is not None:
            ids, tree, n_ahead = ahead
            if n_ahead == n and len(ids) == len(reqs) and all(i == r.request_id for i, r in zip(ids, reqs)):
                self.counters.drafted_ahead += 1
                return tree
            self.counters.ahead_dropped += 1
        self._feature_handles(reqs)
        return self.batched.propose_device([(r.request_id, r.token_ids(), self.spec.nodes) for r in reqs])

    def _drop_ahead(self, req: Request) -> None:
        """The request left the running set (finished, aborted, preempted): trees drafted ahead
        for it go (its id may come back with another request)."""
        if self._ahead is not None and req.request_id in self._ahead[0]:
            self._ahead = None
            self.counters.ahead_dropped += 1

    def _draft_ahead(self, accepted: list[tuple[Request, DraftTree | None, VerifyResult, int, int]]) -> None:
        """After a device-verified step's accepts were read back and fed to the drafter, and
        before the host commits, emits and plans: draft the next step's trees now, for the
        requests this step verified that it will not finish (by max_tokens or EOS), so the device
        drafts while the host keeps books (config.draft_ahead). The drafter sees then exactly what
        it would see at the next step's start (its inputs are the accepted rows and their
        features, fed already), so the trees are the same; the next step uses them when its plan
        verifies the same requests in the same order (_device_drafts) and drops them otherwise.
        Only the trees' levels are speculative: the drafter's context pass over the accepted rows
        stays committed, as any step's would."""
        if not self.config.draft_ahead or self._forced is False:
            return
        live: list[tuple[str, list[int], int]] = []
        for req, _, result, _, _ in accepted:
            toks = result.tokens
            if len(req.output_ids) + len(toks) >= req.max_new:
                continue  # (it finishes this step)
            if not req.params.ignore_eos and not self.eos.isdisjoint(toks):
                continue
            live.append((req.request_id, req.token_ids() + toks, self.spec.nodes))
        if not live or (len(live) < len(accepted) and self.scheduler.waiting):
            return  # (a finished request's slot goes to a waiting prompt: the next step prefills, on the host path)
        n = self.batched.device_nodes(len(live), self.spec.nodes)
        if n is None or n + 1 > 64:
            return
        self._ahead = ([rid for rid, _, _ in live], self.batched.propose_device(live), n)

    def _verify_on_device(self, plan: StepPlan, tree: torch.Tensor, n: int) -> list[RequestOutput]:
        """The target pass over every decode's drafted tree (tree [6, R, n] on the device, in the
        plan's order) and the accepted paths, found on the device (engine.device_verify); then
        the commits, the drafters' feed and the emits as any step."""
        launched = device_verify.launch(self.model, self.pool, plan.scheduled, tree, n)
        ran = self._run_accepts(plan, launched)  # (queued behind the pass, before the read)
        given, self._deepest, logits = device_verify.read(launched)
        return self._apply(plan, None, logits, given, ran)

    def _run_accepts(self, plan: StepPlan, launched: device_verify.Launched) -> str | None:
        """config.device_context: queue the drafter's pass over this step's accepts (still on the
        device) and, when every request surely decodes next step, the next step's trees; returns
        None (not taken: the drafter is fed after the read), "context" or "trees"."""
        cfg, head = self.config, self.batched
        if not (cfg.device_context and isinstance(head, BatchedTreeDrafter) and head.runs_accepts):
            return None
        reqs = [s.request for s in plan.scheduled]
        rids = [r.request_id for r in reqs]
        if not head.can_run_accepts([(r.request_id, len(r.token_ids())) for r in reqs]):
            return None
        # the trees too when none can reach max_tokens this step (EOS may still end one: the
        # next step then drops them), no prompt waits for a slot, and drafting stays on
        k = head.depth + 1
        trees = (cfg.draft_ahead and self._forced is not False and not self.scheduler.waiting
                 and all(len(r.output_ids) + k < r.max_new for r in reqs))
        n = head.device_nodes(len(rids), self.spec.nodes) if trees else None
        trees = n is not None and n + 1 <= 64
        tree = head.run_accepts(rids, launched.acc, self.model.last_features if self.feature_layers else None, trees)
        self.counters.accepts_on_device += 1
        if tree is None:
            return "context"
        self._ahead = (rids, tree, n)
        self.counters.trees_before_read += 1
        return "trees"

    def _select(self, plan: StepPlan, drafts: list[ScheduledRows]) -> tuple[dict[str, DraftTree], int]:
        """Row selection: every drafting request's full tree, one shared node budget from the
        cost model, then each grows by its chosen nodes. Returns their trees and the nodes offered."""
        full = self._batched_drafts([s.request for s in drafts if "pending" not in s.request.runtime])
        full.update({s.request.request_id: self._proposal(s.request) for s in drafts
                     if s.request.request_id not in full})
        if not full:
            return {}, 0
        room = self.config.max_num_batched_tokens - plan.num_rows
        ranked = full
        if self.config.adaptive_draft:  # rank each request's nodes by their calibrated acceptance
            ranked = {rid: draft_length.calibrated(t, self._calibration(self.requests[rid]).rho)
                      for rid, t in full.items()}
        sel = select_step(ranked, plan.num_rows, self.row_cost, room)  # (the trees keep the draft's logp)
        trees = {}
        for i, s in enumerate(plan.scheduled):
            if s.kind != "decode" or s.request.request_id not in full:
                continue
            rid = s.request.request_id
            keep = sel.keep[rid]
            granted = self.scheduler.grow(plan, i, len(keep) - 1) if len(keep) > 1 else 0
            trees[rid] = full[rid].subset(keep[:1 + granted])  # a sorted prefix-closed set's head is one too
        return trees, sel.offered

    def _forward(self, plan: StepPlan, trees: dict[str, DraftTree]) -> tuple[torch.Tensor, int, float, float]:
        """The target pass over the plan's rows; with batch parallelism the other batch is drafted
        meanwhile. Returns logits [decode rows, vocab], requests drafted, drafting seconds and the
        fraction of it hidden under the target pass."""
        rows = self._rows(plan, trees)
        to_draft = []
        if self.batches is not None:
            to_draft = [r for r in self.batches.members(self.batches.skip_batch) if "pending" not in r.runtime]
        if not to_draft:
            return self.model.forward(rows), 0, 0.0, 0.0
        stream = self._draft_stream
        if stream is None:  # CPU: drafting follows the target pass (same trees, no overlap)
            logits = self.model.forward(rows)
            t0 = time.perf_counter()
            self._draft_pending(to_draft)
            return logits, len(to_draft), time.perf_counter() - t0, 0.0
        main = torch.cuda.current_stream(stream.device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        d0, d1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(main)
        logits = self.model.forward(rows)  # queued first, so the draft kernels queue beside it
        e1.record(main)
        stream.wait_event(e0)  # the drafter reads committed state only (the other batch's)
        with torch.cuda.stream(stream):
            d0.record(stream)
            self._draft_pending(to_draft)
            d1.record(stream)
        main.wait_stream(stream)
        d1.synchronize()
        e1.synchronize()
        t_end, d_start, d_end = e0.elapsed_time(e1), e0.elapsed_time(d0), e0.elapsed_time(d1)  # ms
        draft_ms = max(d_end - d_start, 1e-9)
        hidden = max(0.0, min(t_end, d_end) - max(0.0, d_start))
        return logits, len(to_draft), draft_ms / 1e3, min(1.0, hidden / draft_ms)

    # ---- async scheduling (`ar`) ------------------------------------------------------------
    def _pipelines(self, drafting: set[str] | None) -> bool:
        """Whether this step may be queued before the last one is read: with async scheduling,
        an `ar` step, or one in which the draft gate keeps every request from drafting
        (drafting: the gate's pick), when every request is greedy and none reads its logits
        (logprobs)."""
        return (self._async and (self.config.method == "ar" or drafting == set()) and not self._sampled
                and self.fault_hook is None and not self._reads_accepts(self.requests.values()))

    def _async_step(self, drafting: set[str] | None) -> list[RequestOutput]:
        """Plan and queue this step's pass, then read the last step's tokens (the device runs this
        pass meanwhile) and commit and emit them. A request whose token is still on its way is
        planned as if it were there: its decode row reads it on the device (BatchedModel's
        feed), one row after the rows already reserved for it. A request that would reach
        max_tokens with that token is not planned again; one that ends at EOS or a stop string
        is, and its spare row is dropped at the read."""
        t_step = time.perf_counter()
        prev, self._inflight = self._inflight, None
        self._drafting = drafting
        if self._ahead is not None:  # (trees drafted ahead: this step drafts none)
            self._ahead = None
            self.counters.ahead_dropped += 1
        waiting: dict[str, int] = {}  # request id -> its decode's logit row in prev (token on its way)
        if prev is not None:
            k = 0
            for s in prev.plan.scheduled:
                if s.kind == "decode":
                    waiting[s.request.request_id] = k
                    k += 1

        def plans(req: Request) -> bool:  # (a decoding request: not one whose token on its way is its last)
            return req.request_id not in waiting or len(req.output_ids) + 1 < req.max_new

        plan = self.scheduler.plan_step(plans if waiting else None)
        for req in plan.preempted:
            self._drop_draft(req)
        feeds: list[tuple[Request, object, int]] = []  # the feature drafters fed: (request, handle, its decode's row)
        if plan:
            visit = self.config.method != "ar"
            # (dormant and swept: only the sample's requests hold drafters, so only they are visited)
            keep = self._keep_fed if self._swept else None
            # every decode its root, packed from the request itself (a waiting token's row packs
            # a stale one: fed over it on the device); then one walk over the plan for the rest
            rows = self._rows(plan, None)
            fed, src, at, n_dec = [], [], 0, 0
            for s in plan.scheduled:
                if s.kind == "decode":
                    n_dec += 1
                    req = s.request
                    rid = req.request_id
                    if rid in waiting:
                        fed.append(at)
                        src.append(waiting[rid])
                    if visit and (keep is None or rid in keep):  # (what a plain step does to each decode's drafter)
                        self._async_plain(req, rid in waiting)
                        h = req.runtime.get("drafter")
                        if isinstance(h, _BatchedFeatureHandle):
                            feeds.append((req, h, at))
                at += s.rows
            if visit and self._keep_fed is not None:
                self._swept = True
            self.model.forward(rows, feed=(fed, src) if fed else None, logits=False)
            feats = self.model.padded_features if self.feature_layers else None  # [>= M, F] (rows as packed)
            at = 0
            for s in plan.scheduled:  # (computed now: the next plan starts after these rows)
                s.request.num_computed += s.rows
                if s.kind == "prefill" and feats is not None:  # (kept until the request's drafter starts)
                    s.request.runtime.setdefault("features", []).append(feats[at:at + s.rows].clone())
                at += s.rows
            host, done = download(self.model.next_tokens[:n_dec])  # [decodes] their new tokens
            fed_feats = self._rows_of(feats, [at for _, _, at in feeds]) if feeds else None  # [fed, F]
            self._inflight = _Inflight(plan, host, done, [(req, h) for req, h, _ in feeds], fed_feats)
            self.counters.async_steps += 1
        finished = self._read(prev) if prev is not None else []
        seconds = time.perf_counter() - t_step
        if self.gate is not None and self._forced is None and plan.decodes:
            # (a step that read nothing, the first after a synchronous one, timed its host work alone)
            self.gate.observe(len(plan.decodes), 0, seconds, 0, prefill_rows=plan.prefill_rows,
                              steady=prev is not None)
            self._drafted_before = set()
        self._record(plan, 0, None, False, False, None, 0, 0.0, 0.0, 0, 0.0, seconds)
        self.steps += 1
        if self.config.debug_check:
            problems = self.pool.check()
            assert not problems, problems
            if self._swept:  # (the visits skipped: no drafter may live outside the sample)
                held = {r.request_id for r in self.requests.values() if "drafter" in r.runtime}
                assert held <= self._keep_fed, (held, self._keep_fed)
        return finished

    def _rows_of(self, feats: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """feats[rows], a copy: a slice's when the rows run on (every decode fed), else a gather
        through a device index kept per row list (the gate's sample is the same list for many
        steps: no upload each step)."""
        if rows[-1] - rows[0] == len(rows) - 1:
            return feats[rows[0]:rows[-1] + 1].clone()
        key = tuple(rows)
        index = self._row_index.get(key)
        if index is None:
            if len(self._row_index) >= 64:
                self._row_index.clear()
            index = self._row_index[key] = upload(rows, feats.device)
        return feats[index]

    def _async_plain(self, req: Request, waiting: bool) -> None:
        """A decode of an async step in a drafting engine (its tree is its root): its drafter as a
        plain step leaves it (_skip_draft), but a feature drafter is not started for a request
        whose context the host does not hold yet (its token on the way): it starts at a later
        synchronous step, as one restarted after dormancy."""
        if waiting and "drafter" not in req.runtime and isinstance(self.batched, (BatchedEagleDrafter,
                                                                                    BatchedBlockDrafter)):
            return
        self._plain_drafter(req)

    def _hand_over(self) -> None:
        """Hand the batched feature drafter the rows that async plain steps kept for it (_read):
        one projection for every step since the last hand-over, not one a step (at 8 requests the
        per-step hand-over cost a plain step 0.12 of `ar`'s 0.47 ms on the H200, 2026-12-03).
        Rows of a request that ended or whose drafter was released since (preempted, dormant,
        restarted: a new handle) are dropped. Called before every synchronous step, so a drafter
        has all its rows before it drafts or is fed again."""
        unfed, self._unfed = self._unfed, []
        steps: dict[int, tuple[torch.Tensor, int]] = {}  # id of a step's fed rows -> (them, their first row in the cat)
        items, rows, at = [], [], 0
        for req, h, toks, f, i in unfed:
            if id(f) not in steps:
                steps[id(f)] = (f, at)
                at += f.shape[0]
            if not req.done and req.runtime.get("drafter") is h:
                items.append((req.request_id, toks))
                rows.append(steps[id(f)][1] + i)
        if items:  # (one cat over the steps, one gather of the rows kept)
            feats = torch.cat([f for f, _ in steps.values()])  # [sum of fed, F]
            self.batched.observe_many(items, feats[upload(rows, feats.device)])

    def _drain(self) -> list[RequestOutput]:
        """Read the async step still queued, if any (before a synchronous step plans)."""
        prev, self._inflight = self._inflight, None
        return self._read(prev) if prev is not None else []

    def _read(self, inf: _Inflight) -> list[RequestOutput]:
        """Wait for an async step's tokens; commit its rows in the pool (keeping the rows reserved
        after them since) and emit each decode's token. Requests that ended since it was queued
        are skipped; one preempted since (its blocks gone) still gets its token."""
        if inf.done is not None:
            inf.done.synchronize()
        toks = inf.host.tolist()
        seqs = self.pool.seqs
        commits: list[tuple[str, list[int], list[int]]] = []
        emits: list[tuple[Request, int]] = []
        k = -1
        running, ended = RequestState.RUNNING, (RequestState.FINISHED, RequestState.ABORTED)
        for s in inf.plan.scheduled:
            req = s.request
            k += s.kind == "decode"
            state = req.state  # (Request.done inlined: a loop over every request, every step)
            if state in ended:
                self.counters.spare_rows += s.rows
                continue
            held = state is running and req.request_id in seqs
            if s.kind == "prefill":
                if held:
                    commits.append((req.request_id, list(range(s.rows)), req.token_ids()[s.start:s.start + s.rows]))
                continue
            if held:  # (its row fed the request's last token: the one read just before this step's)
                commits.append((req.request_id, [0], [req.last_token]))
            emits.append((req, toks[k]))
        self.pool.commit_many(commits, keep_later=True)
        if inf.fed:  # the feature drafters kept fed: the new tokens with their rows' features, handed over later
            fed = {req.request_id for req, _ in inf.fed}  # (the gate's sample: a few of the emits)
            tok = {req.request_id: t for req, t in emits if req.request_id in fed}
            for i, (req, h) in enumerate(inf.fed):
                if req.request_id in tok:  # (no view per row: a tensor op costs the host ~10 us)
                    self._unfed.append((req, h, [tok[req.request_id]], inf.fed_feats, i))
            if len(self._unfed) >= UNFED_MAX:
                self._hand_over()
        finished, failed = [], []
        for req, tok in emits:
            try:
                # (_emit of a plain step's one token, no draft: the same books, fewer calls a request)
                em = req.runtime.get("emitter") or self._emitter(req)
                if self._books(req, em, em.emit_token(tok), 0, 0):
                    self._end(req, RequestState.FINISHED, req.finish_reason)
                    finished.append(self.output(req))
            except Exception:
                log.exception("request %s failed in its part of a step; the others go on", req.request_id)
                failed.append(req)
        return finished + self._end_failed(failed)

    def _record(self, plan: StepPlan, nodes: int, verify_batch: int | None, overlapped: bool,
                fallback: bool, loads: tuple[int, int] | None, drafted: int, draft_s: float, overlap: float,
                offered: int, drafting_s: float, seconds: float) -> None:
        """nodes: the draft nodes the step verified (roots not counted)."""
        c = self.counters
        decodes = len(plan.decodes)
        rec = StepRecord(self.steps, plan.num_rows, decodes, verify_batch, drafted, overlapped, fallback, loads,
                         draft_s, overlap, nodes, offered, drafting_s, seconds)
        c.drafting_s += drafting_s
        c.step_s += seconds
        c.records.append(rec)
        c.steps += 1
        c.preemptions += len(plan.preempted)
        c.rows += plan.num_rows
        c.decode_steps += decodes > 0
        if nodes:
            c.drafted_steps += 1
            c.drafted_step_s += seconds
        else:
            c.undrafted_steps += decodes > 0
            c.empty_steps += plan.num_rows == 0
        c.batch_parallel_steps += overlapped
        c.tail_fallbacks += fallback
        if self.batches is not None:
            c.rebalances = self.batches.counters.rebalances
        if self.config.row_selection and offered:
            c.nodes_offered += offered
            c.nodes_selected += nodes
            c.selection_off_steps += nodes == 0
        c.draft_s += draft_s
        c.draft_hidden_s += draft_s * overlap
        if self.gate is not None:
            c.gate_off_steps = self.gate.decisions_off

    def _new_drafter(self, req: Request):
        spec, sampling = self.spec, req.params.sampling()
        plan = plan_request("engine", len(req.token_ids()), req.max_new, spec)
        if self.feature_layers:  # as the single-request loop builds them (Generator._drafter)
            return feature_drafter(self.draft, spec, self.config.method == "chain", plan.target_rows,
                                   lambda model, rows: ModelRunner(model, rows, use_graphs=False))
        runner = ModelRunner(self.draft, plan.draft_rows, use_graphs=False)
        if self.config.method == "tree":
            return TreeDrafter(runner, spec)
        if sampling.greedy:  # a greedy chain is the width-1 best-first tree (as in the single-request loop)
            return TreeDrafter(runner, SpecConfig(method="tree", nodes=spec.k, width=1, depth=spec.k - 1))
        return ChainDrafter(runner, sampling, spec.k, self._generator(req))

    @staticmethod
    def _calibration(req: Request) -> draft_length.Calibration:
        """The request's draft calibration (adaptive draft length); kept across preemptions."""
        c = req.runtime.get("calibration")
        if c is None:
            c = req.runtime["calibration"] = draft_length.Calibration()
        return c

    def _generator(self, req: Request) -> torch.Generator:
        g = req.runtime.get("generator")
        if g is None:  # one stream per request, seeded as the single-request loop seeds it
            g = req.runtime["generator"] = torch.Generator().manual_seed(req.params.sampling().seed)
        return g

    def _rows(self, plan: StepPlan, trees: dict[str, DraftTree] | None) -> BatchRows:
        """The pass's rows, packed from columns built in one loop over the plan (no Segment per
        request); every tree's masks and depths at once (tree_masks). trees None: every decode
        is its root alone (an `ar` step)."""
        seqs = self.pool.seqs
        tokens: list[int] = []  # [M]
        T, S, prefix, logits, tables, versions = [], [], [], [], [], []  # [R] each
        parents: list[int] = []  # [tree rows] each tree's parents (tree-local)
        sizes: list[int] = []  # [trees]
        for s in plan.scheduled:
            req = s.request
            sb = seqs[req.request_id]
            tables.append(sb.blocks)
            versions.append(sb.version)
            if s.kind == "prefill":
                tokens += req.token_ids()[s.start:s.start + s.rows]
                T.append(s.rows)
                S.append(s.start + s.rows)
                prefix.append(-1)  # causal
                logits.append(False)
            elif trees is None:  # its root alone
                tokens.append(req.last_token)
                parents.append(-1)
                sizes.append(1)
                T.append(1)
                S.append(s.start + 1)
                prefix.append(s.start)
                logits.append(True)
            else:  # a tree after `start` committed columns: node i at start + depth(i)
                tree = trees[req.request_id]
                n = len(tree.tokens)
                tokens += tree.tokens
                parents += tree.parents
                sizes.append(n)
                T.append(n)
                S.append(s.start + n)
                prefix.append(s.start)
                logits.append(True)
        bits, depth, words = tree_masks(parents, sizes)
        self._deepest = deepest_depths(depth, sizes)  # (what each decode's emit reads of its tree: no walk of its own)
        cols = PackColumns(tokens, T, S, prefix, logits, tables, bits, None, np.asarray(depth), words, versions)
        if self.hybrid:  # (its GDN layers walk each request's tree from that request's state)
            cols.seq_ids, cols.parents = [s.request.request_id for s in plan.scheduled], parents
        return self.model.rows(cols)

    def _apply(self, plan: StepPlan, trees: dict[str, DraftTree] | None, logits: torch.Tensor,
               given: list[tuple[VerifyResult, list[int]]] | None = None, ran: str | None = None
               ) -> list[RequestOutput]:
        """Accept every decode, commit every request's rows in one pool call, then feed the
        drafters and emit. A request that raises in its part fails alone (its rows of the pass
        are already out). `given`: every decode's result and its accepted draft tokens, found on
        the device (_verify_on_device; trees None then); `ran`: what _run_accepts queued."""
        row, m = 0, 0  # the segment's first logits row / first row in the pass (features)
        deepest, k = self._deepest, 0  # (the decodes' trees' deepest depths, packed by _rows)
        feats = self.model.last_features if self.feature_layers else None  # [M, F]
        # every row's argmax read back at once: one device sync per step, not one per request
        argmax = logits.argmax(-1).tolist() if logits.numel() and given is None else []
        commits: list[tuple[str, list[int], list[int]]] = []
        accepted: list[tuple[Request, DraftTree, VerifyResult, torch.Tensor | None]] = []
        failed: list[Request] = []
        hook = self.fault_hook
        plain_accept = not self._reads_accepts([s.request for s in plan.scheduled])  # (the server's LogprobEngine reads some accepts)
        for s in plan.scheduled:
            req = s.request
            if s.kind == "prefill":
                chunk = req.token_ids()[s.start:s.start + s.rows]
                commits.append((req.request_id, list(range(s.rows)), chunk))
                req.num_computed += s.rows
                if feats is not None:  # kept until the request's drafter starts
                    req.runtime.setdefault("features", []).append(feats[m:m + s.rows].clone())
                m += s.rows
                continue
            if given is not None:  # (accepted on the device: the root's token, then the accepted nodes')
                result, toks = given[k]
                n = result.num_draft + 1
                commits.append((req.request_id, result.path, [req.last_token] + toks))
                accepted.append((req, None, result, m, deepest[k]))
                k += 1
                m += n
                continue
            tree = trees[req.request_id]
            n = len(tree.tokens)
            lo, mlo = row, m  # this request's logits rows and feature rows
            depth = deepest[k]
            k += 1
            row += n
            m += n
            try:
                if hook is not None:
                    hook(req)
                sampling = req.runtime.get("sampling")
                # a greedy root alone: its argmax is the bonus (unless a subclass hooks _accept)
                if n == 1 and plain_accept and sampling is not None and sampling.greedy:
                    result = VerifyResult([0], [argmax[lo]], 0)
                else:
                    result = self._accept(req, tree, logits, lo, argmax)
            except Exception:
                log.exception("request %s failed in its part of a step; the others go on", req.request_id)
                failed.append(req)
                continue
            # (a root alone commits its own token: the tree's list, not a copy)
            commits.append((req.request_id, result.path,
                            tree.tokens if n == 1 else [tree.tokens[i] for i in result.path]))
            accepted.append((req, tree, result, mlo, depth))
        if ran is not None:  # (the head ran the accepts already: it keeps the rows they fill)
            self.batched.commit_accepts([(req.request_id, result.tokens) for req, _, result, _, _ in accepted])
        else:
            self._feed(accepted, feats)
        if given is not None and ran != "trees":  # (the device drafts the next step's trees while the host commits and emits)
            self._draft_ahead(accepted)
        self.pool.commit_many(commits)  # (before any request ends: ending frees its blocks)
        finished = []
        for req, tree, result, mlo, depth in accepted:
            try:
                done = self._commit(req, tree, result, feats, mlo, depth)
            except Exception:
                log.exception("request %s failed in its part of a step; the others go on", req.request_id)
                failed.append(req)
                continue
            if done:
                self._end(req, RequestState.FINISHED, req.finish_reason)
                finished.append(self.output(req))
        return finished + self._end_failed(failed)

    def _feed(self, accepted: list[tuple[Request, DraftTree, VerifyResult, int, int]], feats: torch.Tensor | None
              ) -> None:
        """Hand the batched feature drafter every request's committed tokens with their rows'
        target features (feats [M, F]; a request's rows from its offset in `accepted`): one
        gather for all requests, not a few kernels each (drafting or not, every step does this)."""
        items, rows = [], []
        for req, _, result, mlo, _ in accepted:
            if isinstance(req.runtime.get("drafter"), _BatchedFeatureHandle):
                items.append((req.request_id, result.tokens))
                rows += [mlo + p for p in result.path]  # the root's and the accepted nodes' rows
        if items:
            self.batched.observe_many(items, feats[upload(rows, feats.device)])

    def _commit(self, req: Request, tree: DraftTree, result: VerifyResult, feats: torch.Tensor | None,
                first: int, deepest: int) -> bool:
        """After the pool kept the accepted path: count it, feed a per-request drafter (feats [M, F]:
        the pass's features, this request's rows from `first`; a batched one was fed by _feed), emit
        (deepest: the tree's deepest node's depth); True when the request is done."""
        self._accepted += result.accepted
        if self.config.adaptive_draft:
            self._calibration(req).observe(tree, result.accepted)
        req.num_computed += len(result.path)
        if "drafter" in req.runtime and not isinstance(req.runtime["drafter"], _BatchedFeatureHandle):
            if feats is not None:  # the root's and the accepted nodes' features
                req.runtime["drafter"].observe(result, tree, feats[first:first + len(tree)][result.path])
            else:
                req.runtime["drafter"].observe(result, tree)
        return self._emit(req, tree, result, deepest)

    def _end_failed(self, failed: list[Request]) -> list[RequestOutput]:
        """End the requests that raised in their part of a step (finish_reason "error") -> their outputs."""
        for req in failed:
            self._end(req, RequestState.ABORTED, "error")
            self.counters.failed += 1
        return [self.output(req) for req in failed]

    def _end(self, req: Request, state: RequestState, reason: str | None) -> None:
        """Release a request that finished (or failed) in a step: blocks, batch, drafter."""
        if self.batched is not None:
            self.batched.release(req.request_id)
        self._drop_ahead(req)
        self._sampled.discard(req.request_id)
        self.scheduler.finish(req, state)
        if self.batches is not None:
            self.batches.recycle(req)
        req.runtime.clear()
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    def _accept(self, req: Request, tree: DraftTree, logits: torch.Tensor, lo: int, argmax: list[int]) -> VerifyResult:
        """The request's tree is rows lo.. of the pass: of logits [decode rows, vocab] and of
        argmax [decode rows] (read back by _apply)."""
        sampling = self._sampling(req)
        n = len(tree.tokens)
        if sampling.greedy:
            return greedy_accept(tree, argmax[lo:lo + n])
        return rejection_accept(tree, probs_from_logits(logits[lo:lo + n], sampling), self._generator(req))

    @staticmethod
    def _sampling(req: Request) -> SamplingConfig:
        """The request's sampling settings, built once per request (every step of every request asks)."""
        sampling = req.runtime.get("sampling")
        if sampling is None:
            sampling = req.runtime["sampling"] = req.params.sampling()
        return sampling

    def _emit(self, req: Request, tree: DraftTree, result: VerifyResult, deepest: int) -> bool:
        """Cut at EOS / stop / max_tokens (the single-request loop's Emitter; deepest: the tree's
        deepest node's depth, from the packing); True when done."""
        em = self._emitter(req)
        done = em.emit(tree, result, deepest)
        return self._books(req, em, done, result.num_draft, em.accept_lengths[-1])  # (accepts kept, after any cut)

    @staticmethod
    def _books(req: Request, em: Emitter, done: bool, drafted: int, accepted: int) -> bool:
        """A pass's figures on the request (and its finish, when `done`); returns done."""
        f = req.figures
        f.target_passes += 1
        f.draft_tokens += drafted
        f.accepted_tokens += accepted
        if f.ttft is None:
            f.ttft = time.perf_counter() - req.arrival
        if done:
            req.finish_reason, req.stop_text, req.stop_reason = em.finish, em.stop_text, em.stop_string
        return done

    def _emitter(self, req: Request) -> Emitter:
        em = req.runtime.get("emitter")
        if em is None:
            eos = set() if req.params.ignore_eos else self.eos
            em = req.runtime["emitter"] = Emitter(req.max_new, eos, req.params.generation(req.max_new), self.tokenizer,
                                                  None, req.arrival)
            em.out = req.output_ids  # survives preemption: the request owns the list
        return em

    def output(self, req: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = req.stop_text if req.stop_text is not None else self.tokenizer.decode(req.output_ids)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_ids), list(req.output_ids), text,
                             req.finish_reason, req.figures, req.stop_reason)
