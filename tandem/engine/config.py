"""EngineConfig: the batched engine's knobs, one frozen record (derive variants with dataclasses.replace)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config import ConfigError, SpecConfig
from tandem.engine.draft_gate import StepCosts
from tandem.engine.row_selection import RowCost

ENGINE_METHODS = ("ar", "chain", "tree")


@dataclass(frozen=True)
class EngineConfig:
    method: str = "tree"  # ar | chain | tree (every running request drafts this way)
    spec: SpecConfig = field(default_factory=SpecConfig)  # k for chain; nodes, width, depth for tree
    block_size: int = 16  # KV rows per block
    num_blocks: int | None = None  # None: max_num_seqs full context windows of the target
    max_num_seqs: int = 32  # running requests at most
    max_num_batched_tokens: int = 2048  # rows of one target pass (prefill chunks + every tree)
    # a prompt's prefill chunk per step at most this many tokens (vLLM's name; 0: the budget's
    # rest). A step that prefills a long prompt beside decoding requests delays all of their next
    # tokens: the inter-token tail of a busy server (p99 against p50) comes from such steps
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    debug_check: bool = False  # run the pool's check() after every step
    # batch-invariant arithmetic (tandem.engine.invariant): a request's greedy output does not
    # depend on the batch it shares, nor on speculation being on; slower (more, smaller products)
    deterministic: bool = False
    # batch parallelism (MineDraft; tandem.engine.batch_manager): one batch is verified while the other drafts
    batch_parallel: bool = False
    rebalance_threshold: float = 0.25  # |load 0 - load 1| / total above which requests change batch
    # batch-aware row selection (SpecPilot s4.4; tandem.engine.row_selection): one node budget per step
    row_selection: bool = False
    row_cost: RowCost = field(default_factory=RowCost)  # c(rows) of one target pass
    # with row_selection and a row_cost without points: measure c(rows) of this engine's target
    # pass when it starts (Engine.measure_row_cost); None: on a GPU, where the flat region is real
    measure_row_cost: bool | None = None
    prompt_admission: bool = False  # with row_selection: admit new prompts only into the flat region's rows
    # skip drafting in steps where its cost is not repaid (tandem.engine.draft_gate: goodput with
    # and without drafting, from running figures); outside batch-parallel mode. None: on with
    # row_selection, and on a GPU (not for hybrid targets), else off; True / False: on / off for
    # every speculative method
    draft_gate: bool | None = None
    # the gate's step costs, given (an earlier engine's `gate.costs` for the same config and
    # device: measuring takes seconds of steps) or None: measured when the engine starts
    step_costs: StepCosts | None = None
    # greedy chains of a small draft model: one batched draft pass per chain position for every
    # decoding request (tandem.engine.batched_draft) instead of one small pass per request
    batched_drafting: bool = True
    # a per-request draft length (tandem.engine.draft_length): each request's draft confidence
    # calibrated by its recent acceptance; without row selection it verifies the nodes whose
    # calibrated acceptance is at least min_node_prob, with it those probabilities are ranked
    adaptive_draft: bool = False
    min_node_prob: float = 0.05
    # greedy `tree` steps with a batched tree drafter verify on the device: the drafted trees stay
    # there, the target's rows are built from them and the accepted paths found by kernels, and
    # one read-back per step brings the paths (False: the host path, which reads the trees back
    # first and packs and accepts on the host; for comparison)
    device_verify: bool = True
    # with device verification: the next step's trees are drafted as soon as a step's accepted
    # paths are read back and fed to the drafter, before the host commits, emits and plans, so
    # the device drafts while the host does that bookkeeping (vLLM's async scheduling, SGLang's
    # overlap scheduler, for the drafter). The drafted trees are used when the next step's plan
    # verifies the same requests in the same order, else dropped (the drafter's state stays
    # right either way: only the tree levels are speculative). False: draft at the step's start
    draft_ahead: bool = True
    # with device verification (an EAGLE-3 head or a draft model): the drafter's pass over the
    # accepted tokens (and, with draft_ahead, the next step's trees) queue on the device right
    # behind the verify pass, from its accepts as the device holds them, before the host reads
    # them: the host then keeps books while the device drafts, instead of feeding the drafter the
    # accepts it read (its packing and copies were most of a step's host time on the H200). Each
    # request runs depth + 1 rows and keeps the accepted ones. False: fed after the read
    device_context: bool = True
    # method `ar` with greedy requests: a step's pass is queued before the previous step's
    # tokens are read, each decode row taking its token from the previous pass's argmax on the
    # device (vLLM's async scheduling, SGLang's overlap scheduler). The host then plans, packs,
    # commits and emits while the device runs the pass, instead of between passes. A request
    # that ends at EOS or a stop string has one spare row computed after it (dropped). Steps with
    # a sampled request or one asking for logprobs run synchronously. None: on a GPU
    async_scheduling: bool | None = None
    # CUDA graphs for the batched passes, one per row bucket, captured when the engine starts
    # (vLLM's name; True: every pass eager, e.g. to profile single kernels)
    enforce_eager: bool = False
    # one throwaway request through prefill and a few decode steps when the engine starts, so
    # that what compiles or loads on first use (Triton programs, lazily loaded CUDA modules) does
    # not land on the first real request (on the H200 a fresh process's first `tree` step took
    # 517 ms, its second 2.8; `ar`'s first 19.5 ms). None: on a GPU
    warmup_request: bool | None = None

    def validate(self) -> None:
        if self.method not in ENGINE_METHODS:
            raise ConfigError(f"unknown engine method {self.method!r}; choose one of {', '.join(ENGINE_METHODS)}")
        self.spec.validate()
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0 (0: off; got {self.long_prefill_token_threshold})")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1 (got {self.num_blocks})")
        if (self.batch_parallel or self.row_selection) and self.method == "ar":
            what = "batch_parallel" if self.batch_parallel else "row_selection"
            raise ConfigError(f"{what} needs a drafting method (chain or tree), not 'ar'")
        if not 0.0 < self.min_node_prob <= 1.0:
            raise ConfigError(f"min_node_prob must be in (0, 1] (got {self.min_node_prob})")
        if not 0.0 <= self.rebalance_threshold < 1.0:
            raise ConfigError(f"rebalance_threshold must be in [0, 1) (got {self.rebalance_threshold})")
        try:
            self.row_cost.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.max_num_batched_tokens < self.draft_rows():
            raise ConfigError(f"max_num_batched_tokens {self.max_num_batched_tokens} is below one tree's "
                              f"{self.draft_rows()} rows")

    def draft_rows(self) -> int:
        """Rows one request's verify pass holds at most: the root plus its draft tokens."""
        return 1 + {"ar": 0, "chain": self.spec.k, "tree": self.spec.nodes}[self.method]
