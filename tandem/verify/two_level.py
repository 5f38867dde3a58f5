"""Two-level verification (TLV, SpecPilot s4.3): a cheap Q pass chooses what the exact pass verifies.

One cycle, from a committed context whose last token is the root:

1. The drafter proposes a tree (node budget N).
2. The Q pass, a cheap approximation of the target (W12's 8-bit view of every weight matrix, the
   dropped mantissa bits at their midpoint; or the INT8 head's uncertified logits), gives its argmax
   after every node. It reads no target state and commits nothing.
3. The chain C: the Q pass's greedy walk of the tree, i.e. its accepted path and its bonus token
   (`greedy_accept(tree, q_argmax).tokens`).
4. The drafter proposes a fresh subtree at C's end (the context extended by C); it is grafted under
   C's last node and the whole is trimmed to N draft nodes: C first, then the subtree's nodes in
   index order (a prefix of a topological order, so still a tree).
5. One exact pass verifies that tree; `greedy_accept` over the exact argmax decides what is
   committed. Only this pass commits.

Why it is lossless, by construction: the committed tokens are `greedy_accept(T, a)` for some tree T
rooted at the last committed token and the exact argmax `a` of every node of T. greedy_accept only
descends into a child whose token equals the exact argmax after its parent's path, and ends with
the exact argmax after the last accepted node; by induction on the path, the committed tokens are
the first tokens of the exact greedy continuation of the context, whatever T is. Steps 1-4 only
choose T: a wrong Q argmax (or a bad draft) makes T worse (fewer tokens accepted), never wrong,
and every cycle commits at least the bonus. So TLV's output equals exact greedy decoding (`ar`)
token for token, provided the exact pass's argmax is the argmax `ar` computes (the same model,
the same numerics, as for every other method here).

tau for TLV is tokens committed per exact pass; a cycle costs two drafts, one Q pass and one exact
pass. The Q pass only pays where it reads far fewer bytes than the exact pass (single requests;
SpecPilot s6: it lost 13% when batched).

This module is the algorithm and a reference loop (`speculative_generate`) over plain callables,
so tests run it on oracles and on real models without a KV cache (`model_argmax`, recomputing the
context every pass). Wiring it into the runtime (tandem/runtime/generate.py, owned elsewhere):
a `tlv` method whose step is `tree = drafter.propose()`; `q = q_runner.step(tree)` on a second
runner over the 8-bit-view weights, with its own KV cache that mirrors the target's committed
prefix (or none: a full Q prefill is what the paper avoids by giving the Q pass its own cache);
`chain = q_chain(tree, q)`; `sub = drafter.propose_at(chain)`; `verified = graft(tree.tokens[0],
chain, sub, spec.nodes)`; `result = target.verify(verified)`; `drafter.observe(result, verified)`;
the Q runner commits `result.path` too. Report `TLVRun`'s figures.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.tree.draft_tree import DraftTree, ancestor_mask
from tandem.verify.verifier import VerifyResult, greedy_accept

# (context, tree) -> the argmax next token after each node of the tree [len(tree)]; context's last
# token is the tree's root
NodeArgmax = Callable[[list[int], DraftTree], list[int]]
# (context, nodes) -> a tree rooted at context[-1] with at most `nodes` draft nodes
Proposer = Callable[[list[int], int], DraftTree]


def q_chain(tree: DraftTree, q_argmax: list[int]) -> list[int]:
    """C: the Q pass's accepted tokens along the tree and its bonus token (at least one token)."""
    return greedy_accept(tree, q_argmax).tokens


def graft(root: int, chain: list[int], sub: DraftTree | None, nodes: int) -> DraftTree:
    """The tree the exact pass verifies: root, then `chain` as a path, then `sub` (rooted at chain's
    last token) under chain's last node; trimmed to `nodes` draft nodes, chain first."""
    chain = chain[:nodes]
    tokens, parents = [root, *chain], list(range(-1, len(chain)))
    logp = [0.0] * len(tokens)
    if sub is not None and chain and len(chain) < nodes:
        if sub.tokens[0] != chain[-1]:
            raise ValueError(f"the subtree's root {sub.tokens[0]} is not the chain's last token {chain[-1]}")
        end = len(chain)  # the chain's last node
        for i in range(1, min(len(sub), nodes - len(chain) + 1)):  # an index prefix: prefix-closed
            tokens.append(sub.tokens[i])
            parents.append(end if sub.parents[i] == 0 else end + sub.parents[i])
            logp.append(sub.logp[i])
    return DraftTree(tokens=tokens, parents=parents, logp=logp)


@dataclass(frozen=True)
class TLVStep:
    """One TLV cycle. `result` is the exact pass's verdict over `verified` (what gets committed)."""

    result: VerifyResult
    verified: DraftTree
    chain: list[int]  # C
    q_agree: int  # positions of C where the Q argmax equals the exact argmax
    q_checked: int  # positions of C the exact pass saw


def two_level_verify(context: list[int], tree: DraftTree, q_pass: NodeArgmax, exact_pass: NodeArgmax,
                     propose: Proposer | None, nodes: int) -> TLVStep:
    """Steps 2-5 of a cycle for a drafted `tree` rooted at context[-1]. `propose=None`: no subtree."""
    if tree.tokens[0] != context[-1]:
        raise ValueError("the tree's root must be the context's last token")
    chain = q_chain(tree, q_pass(context, tree))[:nodes]
    sub = propose(context + chain, nodes - len(chain)) if propose is not None and len(chain) < nodes else None
    verified = graft(context[-1], chain, sub, nodes)
    exact = exact_pass(context, verified)  # [len(verified)]
    agree = sum(exact[j] == chain[j] for j in range(len(chain)))  # verified node j is C[:j]'s end
    return TLVStep(greedy_accept(verified, exact), verified, chain, agree, len(chain))


@dataclass
class TLVRun:
    """A reference run: the committed tokens and the figures TLV is judged by."""

    tokens: list[int] = field(default_factory=list)
    exact_passes: int = 0
    q_passes: int = 0
    q_agree: int = 0
    q_checked: int = 0

    @property
    def tau(self) -> float:
        """Tokens committed per exact pass (bonus included)."""
        return len(self.tokens) / max(self.exact_passes, 1)

    @property
    def q_agreement(self) -> float:
        """The Q pass's top-1 agreement with the exact pass over the chains the exact pass checked."""
        return self.q_agree / max(self.q_checked, 1)


def speculative_generate(prompt: list[int], max_new: int, propose: Proposer, exact_pass: NodeArgmax, nodes: int,
                         q_pass: NodeArgmax | None = None, eos: set[int] | None = None) -> TLVRun:
    """Greedy speculative decoding by the cycle above (q_pass given: TLV) or plain tree verification
    (q_pass None: the drafted tree goes straight to the exact pass). Reference loop, no KV cache."""
    run, context = TLVRun(), list(prompt)
    while len(run.tokens) < max_new:
        tree = propose(context, nodes)
        if q_pass is None:
            result = greedy_accept(tree, exact_pass(context, tree))
        else:
            step = two_level_verify(context, tree, q_pass, exact_pass, propose, nodes)
            result = step.result
            run.q_passes += 1
            run.q_agree += step.q_agree
            run.q_checked += step.q_checked
        run.exact_passes += 1
        new = result.tokens[:max_new - len(run.tokens)]
        if eos:
            stop = next((i for i, t in enumerate(new) if t in eos), None)
            new = new if stop is None else new[:stop + 1]
        run.tokens += new
        context += new
        if eos and new and new[-1] in eos:
            break
    return run


# ----------------------------------------------------------------------------------------------
# Reference passes over a Transformer (no KV cache: the context is recomputed every pass)

def tree_hidden(model, context: list[int], tree: DraftTree) -> torch.Tensor:
    """Final hidden states [len(tree), H] after the root (the context's last row) and every draft node."""
    p, n = len(context), len(tree)
    t = p + n - 1
    ids = torch.tensor([context + tree.tokens[1:]], device=model.device)  # [1, T]
    depth = tree.depth
    pos = torch.tensor([list(range(p)) + [p - 1 + d for d in depth[1:]]], device=model.device)  # [1, T]
    mask = torch.zeros(t, t, dtype=torch.bool)
    mask[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    mask[p:, :p] = True  # every node sees the whole context (its root included)
    mask[p:, p:] = ancestor_mask(tree.parents)[1:, 1:]  # and its draft ancestors
    h = model.hidden_states(ids, pos, mask=mask[None, None].to(model.device))[0]  # [T, H]
    return h[[p - 1, *range(p, t)]]  # [n, H]


def model_argmax(model, head: str = "full") -> NodeArgmax:
    """A pass of `model` as a NodeArgmax. head: "full" (lm_head, argmax), "certified" (the certified
    INT8 head: the same argmax from fewer bytes) or "int8" (the INT8 head's uncertified argmax: a Q
    pass only, not exact)."""
    from tandem.quant.int8_head import Int8Head, certified_argmax

    if head not in ("full", "certified", "int8"):
        raise ValueError(f"unknown head {head!r}")
    int8 = Int8Head(model.lm_head.weight.detach()) if head == "int8" else None

    @torch.no_grad()
    def run(context: list[int], tree: DraftTree) -> list[int]:
        h = tree_hidden(model, context, tree)  # [n, H]
        if head == "certified":
            return certified_argmax(model, h).tolist()
        if int8 is not None:
            return int8.approx_logits(h).argmax(-1).tolist()
        return model.lm_head(h).argmax(-1).tolist()

    return run


@torch.no_grad()
def view8_copy(model):
    """A copy of `model` whose every 2-D weight (projections, embeddings, head) is W12's 8-bit view of
    it: sign, exponent offset and 3 high mantissa bits, the low 4 at their midpoint; escapes exact.
    What a Q pass reads (fp32 weights are viewed through their bf16 rounding)."""
    from tandem.quant.w12 import decode_w12_view8, encode_w12

    q = copy.deepcopy(model)
    for p in q.parameters():  # tied parameters appear once
        if p.dim() == 2 and p.is_floating_point():
            p.data = decode_w12_view8(*encode_w12(p.data.to(torch.bfloat16))).to(p.dtype)
    for layer in getattr(q.model, "layers", []):  # re-fuse what fuse_projections had concatenated
        for part in (layer.self_attn, layer.mlp):
            fused = getattr(part, "qkv_weight", None) is not None or getattr(part, "gate_up_weight", None) is not None
            if fused:
                part.fuse()
    return q


def model_proposer(draft, width: int = 2) -> Proposer:
    """A draft tree from a draft model, level by level (no KV cache): each level offers the `width` most
    likely children of every leaf and keeps the best by path log-probability until `nodes` are spent."""

    @torch.no_grad()
    def propose(context: list[int], nodes: int) -> DraftTree:
        tree = DraftTree(tokens=[context[-1]], parents=[-1], logp=[0.0])
        leaves = [0]
        while leaves and len(tree) - 1 < nodes:
            logp = torch.log_softmax(draft.lm_head(tree_hidden(draft, context, tree)).float(), dim=-1)  # [n, V]
            top = logp[leaves].topk(width, dim=-1)
            cand = [(tree.logp[u] + float(v), u, int(t)) for u, vs, ts in zip(leaves, top.values, top.indices)
                    for v, t in zip(vs, ts)]
            cand.sort(key=lambda c: -c[0])
            leaves = []
            for score, parent, token in cand[:nodes - (len(tree) - 1)]:
                tree.tokens.append(token)
                tree.parents.append(parent)
                tree.logp.append(score)
                leaves.append(len(tree) - 1)
        return tree

    return propose
