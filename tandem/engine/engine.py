"""The batched engine: continuous batching with batched speculative decoding.

    plan   = scheduler.plan_step()          # who runs: prefill chunks and verify passes, under a budget
    trees  = draft(plan.decodes)             # each decoding request's tree (ar: the root alone)
    logits = model.forward(rows(plan, trees))  # ONE target pass over every request's rows
    for each request: accept, commit its path in the pool, let its drafter observe, emit

Drafting is per request: each decoding request owns a drafter of the single-request runtime
(`TreeDrafter` for tree and greedy chain, `ChainDrafter` for a sampled chain) on its own small
`ModelRunner`, created when its prefill is done and dropped on preemption. A batched draft
(one draft pass for every request's expansion round) is later work; verification is batched.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from tandem.config import ConfigError, SamplingConfig, SpecConfig
from tandem.drafting.chain_drafter import ChainDrafter
from tandem.drafting.tree_drafter import TreeDrafter, tree_rows
from tandem.engine.batched_model import BatchedModel, BatchRows, Segment
from tandem.engine.config import EngineConfig
from tandem.engine.request import Request, RequestOutput, RequestState, SamplingParams
from tandem.engine.scheduler import Scheduler, ScheduledRows, StepPlan
from tandem.kv.paged import PagedKVPool
from tandem.models.transformer import Transformer
from tandem.runtime.generate import Emitter
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree, ancestor_mask
from tandem.verify.sampling import probs_from_logits
from tandem.verify.verifier import VerifyResult, greedy_accept, rejection_accept


class Engine:
    def __init__(self, target, draft=None, tokenizer=None, config: EngineConfig = EngineConfig()):
        config.validate()
        if config.method != "ar" and draft is None:
            raise ConfigError(f"method {config.method!r} needs a draft model; pass one or use method 'ar'")
        if draft is not None and config.method != "ar" and not isinstance(draft, Transformer):
            raise ConfigError("the batched engine drafts with a small draft model; block drafters and EAGLE-3 "
                              "heads run on the single-request loop for now")
        self.target, self.draft, self.tokenizer, self.config = target, draft, tokenizer, config
        self.context_window = target.config.max_position_embeddings
        if draft is not None:
            self.context_window = min(self.context_window, draft.config.max_position_embeddings)
        self.spec, _ = config.spec.capped(self.context_window)
        num_blocks = config.num_blocks or config.max_num_seqs * -(-(self.context_window + config.draft_rows())
                                                                   // config.block_size)
        self.pool = PagedKVPool.for_model(target, num_blocks, config.block_size, config.enable_prefix_caching)
        self.model = BatchedModel(target, self.pool)
        self.scheduler = Scheduler(config, self.pool)
        self.requests: dict[str, Request] = {}
        self.eos = set(target.config.eos_token_ids)
        self.steps = 0

    # ---- public API ----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None, prompt: str | None = None) -> Request:
        params.validate()
        if not prompt_ids:
            raise ConfigError("the prompt is empty; give at least one token of text")
        if len(prompt_ids) >= self.context_window:
            raise ConfigError(f"prompt is {len(prompt_ids)} tokens but the context window is "
                              f"{self.context_window}; shorten the prompt")
        req = Request(list(prompt_ids), params, prompt=prompt)
        if request_id is not None:
            req.request_id = request_id
        if req.request_id in self.requests:
            raise ConfigError(f"request id {req.request_id!r} is in use")
        req.max_new = min(params.max_tokens, self.context_window - len(prompt_ids))
        need = self.pool.blocks_for(len(prompt_ids) + req.max_new + self.config.draft_rows())
        if need > self.pool.num_blocks:
            raise ConfigError(f"request needs {need} KV blocks but the pool has {self.pool.num_blocks}; "
                              f"raise num_blocks or lower max_tokens")
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state; its blocks and drafter are released. False if unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None or req.done:
            return False
        self.scheduler.finish(req, RequestState.ABORTED)
        req.finish_reason = "abort"
        req.runtime.clear()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run one target pass; returns the requests that finished in it."""
        plan = self.scheduler.plan_step()
        for req in plan.preempted:
            req.runtime.pop("drafter", None)  # its draft K/V is rebuilt when it returns
        finished: list[RequestOutput] = []
        if plan:
            trees = {s.request.request_id: self._draft(s) for s in plan.decodes}
            logits = self.model.forward(self._rows(plan, trees))  # [decode rows, vocab]
            finished = self._apply(plan, trees, logits)
        self.steps += 1
        if self.config.debug_check:
            problems = self.pool.check()
            assert not problems, problems
        return finished

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
    def _draft(self, s: ScheduledRows) -> DraftTree:
        """The request's tree for this pass, at most `s.rows` nodes (root included)."""
        req = s.request
        root = req.token_ids()[-1]
        if self.config.method == "ar" or s.rows == 1 and "drafter" not in req.runtime:
            return DraftTree.chain([root])
        drafter = req.runtime.get("drafter")
        if drafter is None:
            drafter = req.runtime["drafter"] = self._new_drafter(req)
            drafter.start(req.token_ids())
        tree = drafter.propose()
        if len(tree) > s.rows:  # the first rows of a topological order are prefix-closed
            tree = tree.subset(list(range(s.rows)))
        return tree

    def _new_drafter(self, req: Request):
        spec, sampling = self.spec, req.params.sampling()
        capacity = len(req.token_ids()) + req.max_new + spec.nodes + spec.k + tree_rows(spec) + 2
        runner = ModelRunner(self.draft, capacity, use_graphs=False)
        if self.config.method == "tree":
            return TreeDrafter(runner, spec)
        if sampling.greedy:  # a greedy chain is the width-1 best-first tree (as in the single-request loop)
            return TreeDrafter(runner, SpecConfig(method="tree", nodes=spec.k, width=1, depth=spec.k - 1))
        return ChainDrafter(runner, sampling, spec.k, self._generator(req))

    def _generator(self, req: Request) -> torch.Generator:
        g = req.runtime.get("generator")
        if g is None:  # one stream per request, seeded as the single-request loop seeds it
            g = req.runtime["generator"] = torch.Generator().manual_seed(req.params.sampling().seed)
        return g

    def _rows(self, plan: StepPlan, trees: dict[str, DraftTree]) -> BatchRows:
        segments = []
        for s in plan.scheduled:
            req = s.request
            if s.kind == "prefill":
                tokens = req.token_ids()[s.start:s.start + s.rows]
                positions = list(range(s.start, s.start + s.rows))
                mask = torch.ones(s.rows, s.rows, dtype=torch.bool).tril()
            else:
                tree = trees[req.request_id]
                tokens, positions, mask = tree.tokens, [s.start + d for d in tree.depth], ancestor_mask(tree.parents)
            slots = self.pool.slots(req.request_id, 0, s.start + len(tokens))
            segments.append(Segment(tokens, positions, slots, mask, logits=s.kind == "decode"))
        return BatchRows.build(segments, self.target.device, self.target.dtype)

    def _apply(self, plan: StepPlan, trees: dict[str, DraftTree], logits: torch.Tensor) -> list[RequestOutput]:
        finished, row = [], 0
        for s in plan.scheduled:
            req = s.request
            if s.kind == "prefill":
                chunk = req.token_ids()[s.start:s.start + s.rows]
                self.pool.commit(req.request_id, list(range(s.rows)), chunk)
                req.num_computed += s.rows
                continue
            tree = trees[req.request_id]
            result = self._accept(req, tree, logits[row:row + len(tree)])  # logits: [n, vocab]
            row += len(tree)
            self.pool.commit(req.request_id, result.path, [tree.tokens[i] for i in result.path])
            req.num_computed += len(result.path)
            if "drafter" in req.runtime:
                req.runtime["drafter"].observe(result, tree)
            if self._emit(req, tree, result):
                self.scheduler.finish(req)
                req.runtime.clear()
                self.requests.pop(req.request_id, None)
                finished.append(self.output(req))
        return finished

    def _accept(self, req: Request, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        sampling: SamplingConfig = req.params.sampling()
        if sampling.greedy:
            return greedy_accept(tree, logits.argmax(-1).tolist())
        return rejection_accept(tree, probs_from_logits(logits, sampling), self._generator(req))

    def _emit(self, req: Request, tree: DraftTree, result: VerifyResult) -> bool:
        """Cut at EOS / stop / max_tokens (the single-request loop's Emitter); True when done."""
        em = req.runtime.get("emitter")
        if em is None:
            eos = set() if req.params.ignore_eos else self.eos
            em = req.runtime["emitter"] = Emitter(req.max_new, eos, req.params.generation(), self.tokenizer,
                                                  None, req.arrival)
            em.out = req.output_ids  # survives preemption: the request owns the list
        done = em.emit(tree, result)
        f = req.figures
        f.target_passes += 1
        f.draft_tokens += result.num_draft
        f.accepted_tokens += result.accepted
        if f.ttft is None:
            f.ttft = time.perf_counter() - req.arrival
        if done:
            req.finish_reason, req.stop_text = em.finish, em.stop_text
        return done

    def output(self, req: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = req.stop_text if req.stop_text is not None else self.tokenizer.decode(req.output_ids)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_ids), list(req.output_ids), text,
                             req.finish_reason, req.figures)
