"""Method `tlv`: two-level verification (tandem.verify.two_level) in the serial loop, greedy only.

    while not done:
        tree     = drafter.propose([])                  # a draft tree at the root
        q        = qpass.argmax(tree)                   # the Q pass: W12 8-bit-view weights, own KV cache
        chain    = q_chain(tree, q)                     # C: the Q pass's accepted path + its bonus
        sub      = drafter.propose(chain)               # a fresh subtree at C's end
        verified = graft(root, chain, sub, N)           # C first, then the subtree, N draft nodes
        result   = target.verify(verified)              # the exact pass; the only one that commits
        drafter, qpass commit [root] + result.tokens[:-1]  (fed lazily, ahead of their next pass)

Output equals `ar` token for token: what is committed is greedy_accept over the exact argmax of
whatever tree was verified (the proof is in two_level.py's docstring).

NOTE: the draft and the Q model do not keep the tree rows of a pass; the committed tokens are fed
again in front of their next pass (`pending` rows, causal, committed right after that pass). The
target keeps its path's rows as every method does. Draft and Q caches therefore never hold a row the
exact pass rejected, at the cost of re-feeding the accepted tokens once per cycle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.emit import Emitter
from tandem.runtime.pair import drafter_kind, needs_draft_model
from tandem.runtime.result import GenerationResult
from tandem.runtime.runner import ModelRunner, runner_for
from tandem.runtime.target import Target
from tandem.runtime.timing import PassClock
from tandem.tree.draft_tree import DraftTree, ancestor_mask
from tandem.verify.two_level import graft, q_chain, view8_copy


@dataclass
class TLVResult(GenerationResult):
    """A `tlv` run: tau is tokens per exact pass; plus the Q pass's top-1 agreement over C."""

    q_passes: int = 0
    q_agree: int = 0  # positions of C where the Q argmax equals the exact argmax
    q_checked: int = 0  # positions of C the exact pass saw

    @property
    def q_agreement(self) -> float:
        return self.q_agree / max(self.q_checked, 1)


class CachedPass:
    """A model over its own KV cache holding the committed context but its last token (the root),
    like the target's. Committed tokens not fed yet wait in `pending` and go in front of the next
    pass's rows; only they are committed after it (the pass's own rows are dropped)."""

    def __init__(self, runner: ModelRunner, prompt: list[int]):
        self.runner, self.pending = runner, list(prompt[:-1])
        self.steps = 0

    def advance(self, fed: list[int]) -> None:
        """Tokens committed this cycle: the root and the accepted draft tokens (not the bonus)."""
        self.pending += fed

    @torch.no_grad()
    def step(self, tree: DraftTree, keep: bool = False) -> torch.Tensor:
        """Logits [len(tree), V] after every node of `tree` (rooted at the root). keep: the tree's rows
        stay in the tree region (for a subtree grown under it) instead of being dropped."""
        cache, p, n = self.runner.cache, len(self.pending), len(tree)
        base = cache.prefix_len
        mask = torch.zeros(p + n, p + n, dtype=torch.bool)  # [p + n, p + n]
        mask[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        mask[p:, :p] = True
        mask[p:, p:] = ancestor_mask(tree.parents)
        positions = list(range(base, base + p)) + [base + p + d for d in tree.depth]
        logits = self.runner.step(self.pending + tree.tokens, positions, mask)[p:]  # [n, V]
        self.steps += 1
        cache.commit(list(range(p)), keep=list(range(p, p + n)) if keep else None)
        self.pending = []
        return logits

    @torch.no_grad()
    def grow(self, tree: DraftTree, rows: list[int]) -> torch.Tensor:
        """Feed the newest nodes `rows` of `tree` (its last indices; every earlier node is fed already,
        so row i of the tree region is node i). Returns their logits [len(rows), V]."""
        cache = self.runner.cache
        n = len(tree)
        anc = ancestor_mask(tree.parents)  # [n, n]
        mask = anc[rows][:, :n]  # [T, n]: tree-region rows are the nodes in index order
        positions = [cache.prefix_len + tree.depth[i] for i in rows]
        self.steps += 1
        return self.runner.step([tree.tokens[i] for i in rows], positions, mask)


class ChainedProposer:
    """Best-first draft trees from a draft model's CachedPass, at the root or at the end of a chain C
    (TLV's fresh subtree): each level offers the `width` most likely children of every leaf and keeps
    the best by path log-probability, as many as spread the node budget over `depth` levels (at least
    `width`). A level that kept every candidate (the budget spent in a few levels) made the trees
    wide and shallow: at N = 32, w = 2, five levels where `tree`'s best-first tree has twelve, and
    TLV's chain C, the Q pass's path through the first tree, could be no deeper than that (the
    bundled pair in fp32, the first 4 MBPP prompts, N = 32, before this change: 9.5 tokens per exact
    pass against `tree`'s 9.8, 2026-12-07, `python bench/gpu_tlv.py --device cpu --dtype float32
    --num-prompts 4 --nodes 32`)."""

    def __init__(self, draft: CachedPass, width: int, depth: int = 12):
        self.draft, self.width, self.depth = draft, width, depth

    def propose(self, root: int, chain: list[int], nodes: int, depth: int | None = None) -> DraftTree:
        """A tree rooted at chain[-1] (root when chain is empty) with at most `nodes` draft nodes over
        about `depth` levels (default: the proposer's)."""
        path = DraftTree.chain([root, *chain])  # fed as the first rows; the subtree hangs from its end
        logits = self.draft.step(path, keep=True)[-1:]  # [1, V]
        # the whole tree as fed: path nodes, then the subtree's nodes (index L + i for subtree node i)
        full = DraftTree(tokens=list(path.tokens), parents=list(path.parents), logp=[0.0] * len(path))
        L = len(path) - 1
        sub = DraftTree(tokens=[path.tokens[-1]], parents=[-1], logp=[0.0])
        leaves = [0]
        level, depth = 0, depth or self.depth
        while True:
            logp = torch.log_softmax(logits.float(), dim=-1)  # [len(leaves), V]
            top = logp.topk(min(self.width, logp.shape[-1]), dim=-1)
            cand = sorted(((sub.logp[u] + float(v), u, int(t)) for u, vs, ts in zip(leaves, top.values, top.indices)
                           for v, t in zip(vs, ts)), key=lambda c: -c[0])
            left = nodes - (len(sub) - 1)  # (budget left, spread over the levels left)
            keep = min(left, max(self.width, -(-left // max(1, depth - level))))
            level += 1
            leaves = []
            for score, parent, token in cand[:keep]:
                sub.tokens.append(token)
                sub.parents.append(parent)
                sub.logp.append(score)
                full.tokens.append(token)
                full.parents.append(L + parent)
                full.logp.append(score)
                leaves.append(len(sub) - 1)
            if not leaves or len(sub) - 1 >= nodes:
                break
            logits = self.draft.grow(full, [L + i for i in leaves])  # [len(leaves), V]
        self.draft.runner.cache.drop_tree()
        return sub


# The first tree, which only the Q pass checks, is Q_SCALE times the exact pass's node budget N and
# depth: the Q pass reads no target state, and a deeper first tree gives a longer chain C (C is
# still cut to N). The bundled pair in fp32, 8 MBPP prompts, w = 2 (2026-12-07, this project's CPU,
# `python bench/gpu_tlv.py --device cpu --dtype float32 --data-dir ../shared/datasets --num-prompts 8
# --nodes N --q-scale S`): tokens per exact pass at N = 8 / 16 / 32: 7.16 / 11.13 / 16.00 with S = 1,
# 7.76 / 12.64 / 17.66 with S = 2, against `tree`'s 5.25 / 7.70 / 9.94. It costs twice the first
# draft's levels.
Q_SCALE = 2


def check_tlv(draft_model, sampling: SamplingConfig, forced_accepts) -> None:
    if not sampling.greedy:
        raise ConfigError("--method tlv is greedy only; use --temperature 0")
    why = needs_draft_model("tlv", drafter_kind(draft_model))
    if why:
        raise ConfigError(why)
    if forced_accepts is not None:
        raise ConfigError("--method tlv does not replay acceptance")


def generate_tlv(engine, prompt_ids: list[int], spec: SpecConfig, gen: GenerationConfig, max_new: int,
                 eos: set[int], on_tokens) -> TLVResult:
    """One request by TLV over `engine` (a Generator: its target, draft, tokenizer, runners)."""
    import time

    target_model = engine.target_model
    q_model = engine._runners.get("tlv-q-model")
    if q_model is None or q_model[0] is not target_model:  # the 8-bit view, built once per target
        engine._runners["tlv-q-model"] = q_model = (target_model, view8_copy(target_model))
    q_model = q_model[1]
    nodes = spec.nodes
    rows = len(prompt_ids) + max_new + (Q_SCALE + 1) * (nodes + 2)  # context, one cycle's pending rows, a tree
    target = Target(runner_for(engine._runners, "target", target_model, rows, engine.use_graphs),
                    SamplingConfig(temperature=0.0), torch.Generator())
    draft = CachedPass(runner_for(engine._runners, "tlv-draft", engine.draft_model, rows, engine.use_graphs), prompt_ids)
    qpass = CachedPass(runner_for(engine._runners, "tlv-q", q_model, rows, engine.use_graphs), prompt_ids)
    proposer = ChainedProposer(draft, spec.width, spec.resolved_depth())
    stats = {"q_passes": 0, "q_agree": 0, "q_checked": 0}

    t0 = time.perf_counter()
    target.runner.prefill(prompt_ids[:-1])
    emitter = Emitter(max_new, eos, gen, engine.tokenizer, on_tokens, t0)
    clock = PassClock(target_model.device)
    root = prompt_ids[-1]
    while True:
        clock.mark()
        tree = proposer.propose(root, [], Q_SCALE * nodes, Q_SCALE * proposer.depth)
        q = qpass.step(tree).argmax(-1).tolist()  # [len(tree)]
        chain = q_chain(tree, q)[:nodes]
        sub = proposer.propose(root, chain, nodes - len(chain)) if len(chain) < nodes else None
        verified = graft(root, chain, sub, nodes)
        clock.mark()
        launch = target.launch(verified, now=True)
        exact = launch.out.tolist()  # [len(verified)]: the exact argmax after every node
        result = target.finish(launch)
        clock.mark()
        stats["q_passes"] += 1
        stats["q_agree"] += sum(exact[j] == chain[j] for j in range(len(chain)))
        stats["q_checked"] += len(chain)
        fed = [root, *result.tokens[:-1]]
        draft.advance(fed)
        qpass.advance(fed)
        if emitter.emit(verified, result):
            break
        root = result.bonus
    if target_model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    draft_s, verify_s = clock.totals()
    return emitter.result(TLVResult, "tlv", len(prompt_ids), seconds, draft.steps, draft_seconds=draft_s,
                          verify_seconds=verify_s, **stats)
