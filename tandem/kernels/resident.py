"""Triton kernels of the device-resident step (tandem.runtime.resident), each beside its reference.

At the bundled pair's size a step is bound by the number of kernels, not by their work: the
glue between the two models (the lattice, the tree, the accept) was ~60 small torch kernels
of 2-3 us each. These fold each piece into one or two programs:

- `lattice_cond`: each of the drafter's B positions' top-K candidates (tandem.kernels.head_level.head_topk)
  -> the parent-conditioned log-probs (the Markov head's bigram score given each parent candidate,
  renormalised over the candidates plus the mass outside them);
- `beam_levels`: the level beams of the best-first tree over the lattice (B sequential top-Ns
  of N x K candidates, as one program, stopping at the first level whose best cannot reach the N
  best; tandem.drafting.device_tree explains the tree);
- `select_tree_fused`: the level beams -> the N best nodes as a tree in topological order, and
  its ancestor mask;
- `accept`: the target's argmax per node -> the accepted path, the bonus token, the K/V rows
  to move, the next context (right-aligned) and the step's record.

The references are the semantics (and what runs on the CPU); the GPU lane checks the kernels
against them.
"""
from __future__ import annotations

import torch

from tandem.kernels.fused import pdl, pow2, triton_enabled

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

# warps of the one-program tree kernel (beams + selection), whose levels run in sequence: at the bundled block
# drafter's lattice 4 and 8 warps take the same time, 2 half as long again (one H100, bench/gpu_draft_kernels.py)
TREE_WARPS = 4
# the narrow first pass's beam: width // TREE_NARROW (launch_tree; 0: off). At the bundled block drafter's
# lattice (16 x 16, N = 32) a width-16 pass is kept on 94% of the trees and the tree takes 15.7 us against
# 23.6 (in a CUDA graph, one H100, bench/gpu_draft_kernels.py, bench/NOTES.md)
TREE_NARROW = 2

# ---- the best-first tree's pieces (tandem.drafting.device_tree composes them) -----------------
def score_keys(score: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] -> int64 [..., n] keys, ordered as the scores, ties to the lower index."""
    bits = score.float().contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # monotone in the float
    n = score.shape[-1]
    return (ordered << 32) | (n - 1 - torch.arange(n, device=score.device))


def key_index(key: torch.Tensor, n: int) -> torch.Tensor:
    return (n - 1) - (key & 0xFFFFFFFF)


def key_score(key: torch.Tensor) -> torch.Tensor:
    hi = (key >> 32).int()
    return torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).view(torch.float32)


def beam_levels_ref(cond: torch.Tensor, width: int, nodes: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cond: [B, K, K] -> per level d (the nodes at depth d + 1): the `width` best nodes' scores
    [B, W] float32, candidate index at their position [B, W] and parent's slot in level d - 1's
    beam [B, W] (int64). Level 0's parent is the root (slot 0).

    nodes > 0: the tree's node budget N, and the levels stop early. Once `nodes` entries of levels
    0..d score at least level d's best, no deeper node can be among the N best (a child never
    scores above its parent, and ties go to the shallower entry, which comes first), so levels
    d + 1.. are not computed: their scores are -inf, their candidates and slots 0. The N best
    entries, and so the tree, are those of the full levels. (On the bundled block drafter's MBPP
    trees, N = 32, that is 9.5 of 16 levels on average.)"""
    B, K, _ = cond.shape
    dev = cond.device
    score = torch.full((width,), float("-inf"), device=dev)
    score[0] = 0.0
    cand = torch.zeros(width, dtype=torch.long, device=dev)
    scores = torch.full((B, width), float("-inf"), device=dev)
    cands = torch.zeros(B, width, dtype=torch.long, device=dev)
    pslots = torch.zeros(B, width, dtype=torch.long, device=dev)
    for d in range(B):
        s = (score[:, None] + cond[d].index_select(0, cand)).reshape(-1)  # [W * K]
        top = score_keys(s).topk(width).values  # sorted, distinct
        idx = key_index(top, width * K)
        score, cand = key_score(top), idx % K
        scores[d], cands[d], pslots[d] = score, cand, idx // K
        if nodes and (scores[:d + 1] >= score.max()).sum() >= nodes:
            break
    return scores, cands, pslots


def _beams_fit(width: int, k: int) -> bool:
    """Whether the one-program beam kernels (_beam_body) take beams of this width over k candidates a
    position: both powers of two, width * k >= 16 (the dispatchers also ask triton_enabled)."""
    return width & (width - 1) == 0 and k & (k - 1) == 0 and width * k >= 16


def _tree_block(nodes: int) -> int:
    """The row block of a tree of nodes + 1 rows in _finish_tree (its ancestor closure by tl.dot: >= 16)."""
    return max(16, pow2(nodes + 1))


def _beam_buffers(levels: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The beams' outputs: scores [levels, W] float32, candidates and parent slots [levels, W] int64."""
    return (torch.empty(levels, width, device=device), torch.empty(levels, width, dtype=torch.long, device=device),
            torch.empty(levels, width, dtype=torch.long, device=device))


def beam_levels(cond: torch.Tensor, width: int, nodes: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """beam_levels_ref, as one Triton program on CUDA (TANDEM_TRITON=0: the reference)."""
    if not (triton_enabled(cond) and _beams_fit(width, cond.shape[1])):
        return beam_levels_ref(cond, width, nodes)
    return launch_beam_levels(cond, width, nodes)


def launch_beam_levels(cond: torch.Tensor, width: int, nodes: int = 0):
    B, K, _ = cond.shape
    cond = cond.float().contiguous()
    scores, cands, pslots = _beam_buffers(B, width, cond.device)
    _beam_kernel[(1,)](cond, scores, cands, pslots, nodes, B=B, W=width, K=K, BP=pow2(B),
                       EXIT=nodes > 0, **pdl(cond))
    return scores, cands, pslots


def select_nodes(tok: torch.Tensor, root: torch.Tensor, scores: torch.Tensor, cands: torch.Tensor,
                pslots: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `nodes` best nodes over all level beams -> (tokens [M], parents [M], depth [M]) with
    M = nodes + 1, root first, in topological order (parents[0] = -1). root: [1] int64."""
    B, W = scores.shape
    flat = score_keys(scores.reshape(-1)).topk(nodes).values  # [N]
    sel = key_index(flat, B * W).sort().values  # depth-major: a topological order
    level = sel // W  # [N] each node's level (its depth - 1)
    ids = torch.zeros(B * W, dtype=torch.long, device=tok.device)
    ids.index_copy_(0, sel, torch.arange(1, nodes + 1, device=tok.device))  # node id of each kept entry
    parent_entry = (level - 1).clamp(min=0) * W + pslots.reshape(-1).index_select(0, sel)
    parent = torch.where(level == 0, 0, ids.index_select(0, parent_entry))
    cand = cands.reshape(-1).index_select(0, sel)
    token = tok.reshape(-1).index_select(0, level * tok.shape[1] + cand)
    minus1 = torch.full((1,), -1, dtype=torch.long, device=tok.device)
    return (torch.cat([root, token]), torch.cat([minus1, parent]),
            torch.cat([torch.zeros_like(minus1), level + 1]))


def ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents: [M] (root -1) -> [M, M] bool, [i, j] True when j is i or an ancestor of i.
    Reachability by squaring (I + P): log2(max_depth) small matrix products, no host loop."""
    M = parents.shape[0]
    a = torch.eye(M, device=parents.device)
    a[1:].scatter_(1, parents[1:, None].clamp(min=0), 1.0)  # (a scalar value: nothing copied from the host)
    for _ in range(max(1, max_depth - 1).bit_length()):
        a = (a @ a).clamp_(max=1.0)
    return a > 0



# ---- the lattice -----------------------------------------------------------------------------
def lattice_ref(logits: torch.Tensor, root: torch.Tensor, u: torch.Tensor | None, v: torch.Tensor | None,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V] of the root's row and the mask rows; root: [1]; u, v: [V, R] Markov factors
    (None: no Markov head) -> tok [B, K] int64, cond [B, K, K] float32 with cond[b, a, c] the
    log-prob of candidate c at position b + 1 given candidate a at position b (b = 0: given the
    root, every row alike), as BlockDrafter.lattice_rows and lattice_tables compute it."""
    lp, tok = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, K]
    return tok, lattice_cond_ref(tok, lp, root, u, v)


def lattice_cond_ref(tok: torch.Tensor, lp: torch.Tensor, root: torch.Tensor, u: torch.Tensor | None,
                     v: torch.Tensor | None) -> torch.Tensor:
    """The lattice's parent-conditioned log-probs from each position's top K: tok [B, K] int64, lp [B, K]
    float32 (best first) -> cond [B, K, K] float32 (lattice_ref's)."""
    B, k = lp.shape
    if u is None:
        return lp[:, None, :].expand(B, k, k).contiguous()
    rest = torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-6))  # [B] the mass outside the top K
    prev = torch.cat([root.expand(1, k), tok[:-1]])  # [B, K] the parent candidates of each position
    g = lp[:, None, :] + (u[prev].float()[:, :, None, :] * v[tok].float()[:, None, :, :]).sum(-1)  # [B, K, K]
    return g - torch.logaddexp(torch.logsumexp(g, -1), rest[:, None])[..., None]


def lattice_cond(tok: torch.Tensor, lp: torch.Tensor, root: torch.Tensor, u: torch.Tensor | None,
                 v: torch.Tensor | None) -> torch.Tensor:
    """lattice_cond_ref, one program a position on CUDA (the resident loop's block drafter takes its
    top K from head_topk, which folds the final norm and the LM head into the top-k's launch)."""
    if not triton_enabled(lp):
        return lattice_cond_ref(tok, lp, root, u, v)
    B, k = lp.shape
    cond = torch.empty(B, k, k, device=lp.device)
    markov = u is not None
    R = u.shape[1] if markov else 1
    _cond_kernel[(B,)](tok, lp, root, u if markov else lp, v if markov else lp, cond, R=R, K=k,
                       HAS_MARKOV=markov, **pdl(tok))
    return cond


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> the k largest log-probs [..., k] float32 and their tokens [..., k]
    int64, best first. On CUDA one program per row (the lattice's top-K kernel: the row's
    logsumexp and k argmax sweeps) instead of a cast, a radix top-k, a logsumexp and a subtract
    (~50 us at an 8k vocabulary, once per EAGLE level); rows wider than 16k stay on torch (one
    program would not hold them in registers)."""
    V = logits.shape[-1]
    if not triton_enabled(logits) or pow2(V) > 16384 or logits.stride(-1) != 1:
        lf = logits.float()
        top, tok = lf.topk(k, dim=-1)
        return top - torch.logsumexp(lf, dim=-1, keepdim=True), tok
    rows = logits.reshape(-1, V)  # a view: the leading dims of a contiguous row block
    R = rows.shape[0]
    tok = torch.empty(R, k, dtype=torch.long, device=logits.device)
    lp = torch.empty(R, k, device=logits.device)
    _topk_kernel[(R,)](rows, rows.stride(0), tok, lp, V, K=k, BLOCK_V=pow2(V), num_warps=8, **pdl(rows))
    return lp.view(*logits.shape[:-1], k), tok.view(*logits.shape[:-1], k)


# ---- the tree --------------------------------------------------------------------------------
def select_tree_ref(tok, root, scores, cands, pslots, nodes: int):
    """-> (tokens [M], parents [M], depth [M], ancestors [M, M] bool), M = nodes + 1."""
    t, p, d = select_nodes(tok, root, scores, cands, pslots, nodes)
    return t, p, d, ancestors(p, scores.shape[0])


def select_tree_fused(tok, root, scores, cands, pslots, nodes: int, out: tuple[torch.Tensor, ...]) -> None:
    """select_tree_ref, written into `out` = (tokens, parents, depth, ancestors)."""
    if not triton_enabled(scores):
        for o, r in zip(out, select_tree_ref(tok, root, scores, cands, pslots, nodes)):
            o.copy_(r)
        return
    B, W = scores.shape
    dev = scores.device
    ids = torch.empty(B * W, dtype=torch.long, device=dev)
    t, p, d, anc = out
    _select_kernel[(1,)](scores, cands, pslots, tok, root, t, p, d, anc, ids, B * W, W=W,
                         K=tok.shape[1], N=nodes, NP=pow2(nodes), MP=_tree_block(nodes), BWP=pow2(B * W), MAXD=B,
                       **pdl(scores))


def tree_fused(tok: torch.Tensor, root: torch.Tensor, cond: torch.Tensor, width: int, nodes: int,
               out: tuple[torch.Tensor, ...]) -> bool:
    """The level beams (stopping early) and the selection in one launch on CUDA, written into `out` =
    (tokens, parents, depth, ancestors); False (nothing done) where the one-program kernels do not take
    the shapes (the caller then runs beam_levels and select_tree_fused)."""
    if not (triton_enabled(cond) and _beams_fit(width, cond.shape[1])):
        return False
    launch_tree(tok, root, cond, width, nodes, out)
    return True


def narrow_tree_kept(depth: torch.Tensor, narrow: int, levels: int, k: int) -> bool:
    """Whether the tree built from beams of width `narrow` is kept (_tree_kernel's rule): no level holds
    `narrow` of its nodes (depth [M], the root's 0 first), level 0 exempt when its k children fit the beam.
    Then it is the full beams' tree: each level's worst narrow-beam entry is outside it, and every node
    the narrow beams dropped scores no higher than that entry (or than an ancestor that was dropped)."""
    per_level = torch.bincount(depth[1:] - 1, minlength=levels)
    if k <= narrow:
        per_level[0] = 0
    return not bool((per_level >= narrow).any())


def launch_tree(tok, root, cond, width: int, nodes: int, out: tuple[torch.Tensor, ...],
                num_warps: int = TREE_WARPS, narrow: int | None = None) -> None:
    """The one-program tree (tree_fused). narrow (a power of two below width; None: width // TREE_NARROW,
    0: off): the width of a first pass, kept where its tree holds fewer than `narrow` nodes at every
    level, exactly the tree of the full beams then (_tree_kernel)."""
    B, K, _ = cond.shape
    cond = cond.float().contiguous()
    scores, cands, pslots = _beam_buffers(B, width, cond.device)
    ids = torch.empty(B * width, dtype=torch.long, device=cond.device)
    t, p, d, anc = out
    if narrow is None:
        narrow = width // TREE_NARROW if TREE_NARROW else 0
    narrow = narrow if 0 < narrow < width and _beams_fit(narrow, K) and B * narrow >= nodes else 0
    _tree_kernel[(1,)](cond, scores, cands, pslots, tok, root, t, p, d, anc, ids, B=B, W=width, K=K, BP=pow2(B),
                       N=nodes, NP=pow2(nodes), MP=_tree_block(nodes), BWP=pow2(B * width), NARROW=narrow,
                       NBWP=pow2(B * narrow) if narrow else 1,
                       num_warps=num_warps, **pdl(cond))


def chain_fused(tok: torch.Tensor, root: torch.Tensor, cond: torch.Tensor, k: int, out: torch.Tensor) -> bool:
    """The greedy path's tokens [k + 1] (root first) written into `out`, in one launch on CUDA; False
    (nothing done) where the one-program kernel does not take the shapes."""
    if not (triton_enabled(cond) and _beams_fit(1, cond.shape[1]) and tok.is_contiguous()):
        return False
    c = cond[:k].float().contiguous()
    _chain_kernel[(1,)](c, *_beam_buffers(k, 1, c.device), tok, root, out, B=k, K=cond.shape[1], BP=pow2(k), **pdl(c))
    return True


# ---- the EAGLE-2 levels (tandem.drafting.eagle_drafter.HeadLevels) ----------------------------
def level_step_ref(ctok, clp, d2t, tok, par, lp, fed, ids, src, anc, prefix, d: int, width: int,
                   prep: bool) -> torch.Tensor | None:
    """The glue after level d's pass (d = 0: after the root's logits), in place. HeadLevels
    explains the node layout. ctok, clp: [P, W] the top-W children (draft ids) and their
    log-probs of the P = 1 (d = 0) or W fed nodes `fed`; d2t maps draft ids to the target's.

    Writes the new nodes' tok, par (-1: the root) and cumulative lp. With `prep`, picks the W
    best new nodes (ties to the earlier node) as the next level's fed nodes and writes their ids,
    `src` (each one's parent's slot among this level's fed: the hidden row it reads), their
    ancestry rows in `anc` [R, R] (tree rows: the s-th node fed at level d + 1 has row d * W + s)
    and returns the next pass's attention mask [W, width] (the head's prefix columns, then its
    ancestors' tree rows)."""
    P, W = ctok.shape
    first = d == 0
    base = 0 if first else W + (d - 1) * W * W
    parent_lp = torch.zeros(P, device=lp.device) if first else lp[fed]  # [P]
    new = slice(base, base + P * W)
    tok[new] = (ctok + d2t[ctok]).reshape(-1)
    par[new] = (torch.full((P,), -1, device=tok.device) if first else fed)[:, None].expand(P, W).reshape(-1)
    lp[new] = (parent_lp[:, None] + clp.float()).reshape(-1)
    if not prep:
        return None
    pick = key_index(score_keys(lp[new]).topk(W).values, P * W)  # [W] the best, ties to the earlier node
    fed.copy_(base + pick)
    ids.copy_(tok[fed])
    src.copy_(pick // W)
    R = anc.shape[0]
    rows = d * W + torch.arange(W, device=anc.device)  # [W] the fed nodes' tree rows
    a = torch.zeros(W, R, dtype=torch.bool, device=anc.device) if first else anc[(d - 1) * W + src]
    a[torch.arange(W), rows] = True
    anc[rows] = a
    cols = torch.arange(width, device=anc.device)
    t = cols - prefix  # [width] tree row of each cache column (< 0: the prefix)
    inside = (t >= 0) & (t < R)
    return (a[:, t.clamp(0, R - 1)] & inside) | (cols < prefix)  # [W, width]


def level_step(ctok, clp, d2t, tok, par, lp, fed, ids, src, anc, prefix, d: int, width: int,
               prep: bool) -> torch.Tensor | None:
    """level_step_ref; on CUDA one program (prefix: [1] long on the device)."""
    if not triton_enabled(lp):
        return level_step_ref(ctok, clp, d2t, tok, par, lp, fed, ids, src, anc, prefix, d, width, prep)
    P, W = ctok.shape
    R = anc.shape[0]
    mask = torch.empty(W, width, dtype=torch.bool, device=lp.device) if prep else anc
    _level_kernel[(1,)](ctok, clp, d2t, tok, par, lp, fed, ids, src, anc, mask, prefix, d, width, P=P, W=W,
                        NP=pow2(P * W), R=R, RP=pow2(R), PREP=prep, BLOCK_C=256, **pdl(ctok))
    return mask if prep else None


# ---- a pass's rows: positions, cache slots, attention mask ----------------------------------------
def context_view_ref(P: torch.Tensor, pre: torch.Tensor, pmax: int, T: int, width: int, scratch: int):
    """The rows of a drafter's context pass: P [1] pending context rows, right-aligned in the first
    pmax of T rows (then T - pmax mask rows), after the drafter's prefix pre [1] ->
    (positions [T], cache slots [T], mask [T, width] bool): the real rows are causal after the
    prefix; padding rows sit at position pre, write the scratch slot and see column 0 only."""
    r = torch.arange(T, device=P.device)
    q = r - (pmax - P)  # [T] the row's index among the real rows (< 0: padding)
    real = q >= 0
    cols = torch.arange(width, device=P.device)
    rel = cols[None, :] - pre  # [1, W]
    see = torch.where(real[:, None], (rel < 0) | (rel <= q[:, None]), cols[None, :] == 0)  # [T, W]
    return pre + q.clamp(min=0), torch.where(real, pre + q, scratch), see


def tree_view_ref(pre: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor, width: int):
    """The rows of a tree pass over the M nodes after the prefix pre [1]: node i at position
    pre + depth[i], slot pre + i, seeing the prefix and its ancestors' rows (anc [M, M]) ->
    (positions [M], slots [M], mask [M, width] bool)."""
    M = depth.shape[0]
    cols = torch.arange(width, device=pre.device)
    rel = cols - pre  # [W]
    inside = (rel >= 0) & (rel < M)
    tree = anc.gather(1, rel.clamp(0, M - 1).expand(M, -1)) & inside  # [M, W]
    return pre + depth, pre + torch.arange(M, device=pre.device), (rel < 0)[None, :] | tree


def context_view(P, pre, pmax: int, T: int, width: int, scratch: int, out: tuple[torch.Tensor, ...],
                 levels: tuple[torch.Tensor, ...] | None = None) -> None:
    """context_view_ref written into out = (positions, slots, mask); one program on CUDA (about a
    dozen small torch kernels otherwise, in every draft pass).

    levels = (prefix [1], level_pos [L, w], level_slot [L, w], pos_rows [L, w], slot_rows [L, w]): the
    tree levels that follow this pass (tandem.drafting.eagle_drafter.HeadLevels). Then the same program
    also advances the drafter's prefix past this pass's rows (pre += P; nothing after this pass in the
    draft reads the old one), writes it to prefix, and each level row's position and slot,
    prefix + level_pos and prefix + level_slot (four torch launches before)."""
    if not triton_enabled(P):
        for o, v in zip(out, context_view_ref(P, pre, pmax, T, width, scratch)):
            o.copy_(v)
        if levels is not None:
            prefix, level_pos, level_slot, pos_rows, slot_rows = levels
            pre.add_(P)
            prefix.copy_(pre)
            torch.add(prefix, level_pos, out=pos_rows)
            torch.add(prefix, level_slot, out=slot_rows)
        return
    launch_context_view(P, pre, pmax, T, width, scratch, out, levels)


def launch_context_view(P, pre, pmax: int, T: int, width: int, scratch: int, out: tuple[torch.Tensor, ...],
                        levels: tuple[torch.Tensor, ...] | None = None) -> None:
    """context_view's kernel, unconditionally (the interpreter checks call it on the CPU)."""
    pos, slots, see = out
    prefix, level_pos, level_slot, pos_rows, slot_rows = levels if levels is not None else (pre,) + (pos,) * 4
    assert levels is None or (level_pos.is_contiguous() and level_slot.is_contiguous() and pos_rows.is_contiguous()
                              and slot_rows.is_contiguous())
    nl = 0 if levels is None else level_pos.numel()
    _context_view_kernel[(1,)](P, pre, pos, slots, see, width, scratch, prefix, level_pos, level_slot, pos_rows,
                               slot_rows, nl, PMAX=pmax, T=T, TP=pow2(T), BW=128, LEVELS=levels is not None,
                               NLP=pow2(max(nl, 1)), **pdl(P))


def tree_view(pre, depth, anc, width: int, out: tuple[torch.Tensor, ...]) -> None:
    """tree_view_ref written into out = (positions, slots, mask); one program on CUDA."""
    if not triton_enabled(pre):
        for o, v in zip(out, tree_view_ref(pre, depth, anc, width)):
            o.copy_(v)
        return
    pos, slots, see = out
    M = depth.shape[0]
    _tree_view_kernel[(1,)](pre, depth, anc, pos, slots, see, width, M=M, MP=pow2(M), BW=128, **pdl(pre))


# ---- the accept ------------------------------------------------------------------------------
def accept_ref(am, tree_tok, tree_par, tree_depth, anc, prefix, pmax: int):
    """am: [M] the target's argmax after each node; prefix: [1] -> (accepted 0-dim, bonus [1],
    path [pmax] (depth -> accepted node; beyond the accepted depth: the depth itself),
    ctx [pmax] the committed tokens right-aligned (the bonus last), node [pmax] the node whose
    target features go with each ctx entry)."""
    M = tree_tok.shape[0]
    ar_M = torch.arange(M, device=am.device)
    ar_P = torch.arange(pmax + 1, device=am.device)
    match = (tree_tok == am.index_select(0, tree_par.clamp(min=0))) | (ar_M == 0)
    acc = ~(anc & ~match[None, :]).any(-1)  # [M] the node and all its ancestors match
    accepted, deepest = torch.where(acc, tree_depth, -1).max(0)
    bonus = am.index_select(0, deepest[None])
    path = ar_P.clone()
    path.scatter_(0, torch.where(acc, tree_depth, pmax), ar_M)
    path = path[:pmax]
    i = ar_P[:pmax] - (pmax - 1) + accepted  # [pmax] entry o holds path depth i; < 0: padding
    node = path.index_select(0, i.clamp(0, pmax - 1)).clamp(max=M - 1)
    child = path.index_select(0, (i + 1).clamp(0, pmax - 1)).clamp(max=M - 1)
    ctx = torch.where(i == accepted, bonus, tree_tok.index_select(0, child))
    return accepted, bonus, path, ctx, node


def accept_fused(am, tree_tok, tree_par, tree_depth, anc, prefix, pmax: int, state: dict[str, torch.Tensor]) -> None:
    """accept_ref, applied to the loop's state in place: `kv_src` / `kv_dst` [pmax] (the K/V
    rows to move), `node` [pmax], `ctx` [pmax], `P` [1] = accepted + 1, `prefix` += accepted + 1,
    `rec` [3 + pmax] = (P, accepted, the tree's depth, ctx...)."""
    if not triton_enabled(am):
        accepted, bonus, path, ctx, node = accept_ref(am, tree_tok, tree_par, tree_depth, anc, prefix, pmax)
        ar = torch.arange(pmax, device=am.device)
        state["kv_src"].copy_(prefix + path)
        state["kv_dst"].copy_(prefix + ar)
        state["node"].copy_(node)
        state["ctx"].copy_(ctx)
        state["P"].copy_(accepted + 1)
        prefix.add_(accepted + 1)
        state["rec"].copy_(torch.cat([(accepted + 1)[None], accepted[None], tree_depth.max()[None], ctx]))
        return
    M = tree_tok.shape[0]
    _accept_kernel[(1,)](am, tree_tok, tree_par, tree_depth, anc, prefix, state["kv_src"], state["kv_dst"],
                         state["node"], state["ctx"], state["P"], state["rec"], M=M, MP=pow2(M), PM=pmax,
                         PMP=pow2(pmax), **pdl(am))


def commit_rows_ref(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, feats: torch.Tensor | None,
                    node: torch.Tensor | None, out_feat: torch.Tensor | None) -> None:
    """kv [2, layers, 1, kv_heads, rows, D]: cache row src[i] -> row dst[i] (all read before any is
    written); feats [T, F] (None: none), node [P]: out_feat [P, F] = feats[node]."""
    kv.index_copy_(4, dst, kv.index_select(4, src))
    if feats is not None:
        torch.index_select(feats, 0, node, out=out_feat)


def commit_rows(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, feats: torch.Tensor | None = None,
                node: torch.Tensor | None = None, out_feat: torch.Tensor | None = None) -> None:
    """commit_rows_ref; on CUDA one launch (an index_select and an index_copy of the cache, an index_select
    of the features before): a program per (K or V, layer, KV head) reads its P source rows, then writes
    them (each program owns its rows, so every read precedes every write as in the reference), and a
    program per column block of the features gathers them."""
    if not triton_enabled(kv) or not kv.is_contiguous() or kv.shape[2] != 1 or (
            feats is not None and (feats.stride(-1) != 1 or not out_feat.is_contiguous())):
        return commit_rows_ref(kv, src, dst, feats, node, out_feat)
    regions, rows, D = kv.shape[0] * kv.shape[1] * kv.shape[3], kv.shape[4], kv.shape[5]
    P = src.shape[0]
    F = 0 if feats is None else feats.shape[-1]
    nf = 0 if feats is None else triton.cdiv(F, 256)
    _commit_kernel[(regions + nf,)](kv, src, dst, kv if feats is None else feats, src if node is None else node,
                                    kv if out_feat is None else out_feat, rows, F,
                                    0 if feats is None else feats.stride(0), NKV=regions, P=P, PP=pow2(P), D=D, BF=256,
                                    **pdl(kv))


# ---- the sampled walk ------------------------------------------------------------------------
def sample_walk_ref(probs: torch.Tensor, tree_tok: torch.Tensor, tree_par: torch.Tensor,
                    generator: torch.Generator) -> torch.Tensor:
    """Recursive rejection sampling over a tree of point-mass drafts (what verify.verifier's
    rejection_accept does with tree.q None, draw for draw with the same generator): from the
    root, each child in index order is accepted with probability residual(x), else x leaves the
    residual; with every child rejected the bonus is drawn from the residual. probs: [M, V]
    target distributions after each node. Returns am [M]: the token the walk chose after each
    node it visited (-1 elsewhere), which the greedy accept turns into the path and the bonus."""
    M = tree_tok.shape[0]
    tok, par = tree_tok.tolist(), tree_par.tolist()
    children = [[c for c in range(1, M) if par[c] == n] for n in range(M)]
    am = [-1] * M
    node = 0
    while True:
        p = probs[node].detach().float().cpu().clone()  # [V]
        nxt = None
        for c in children[node]:
            x = tok[c]
            u = float(torch.rand((), generator=generator))
            if u < float(p[x]):
                nxt = c
                break
            residual = p.clone()
            residual[x] = 0.0
            total = float(residual.sum())
            if total <= 0.0:  # only through rounding; keep p (as rejection_accept does)
                break
            p = residual / total
        if nxt is None:
            am[node] = int(torch.multinomial(p, 1, generator=generator).item())
            return torch.tensor(am, dtype=torch.long, device=tree_tok.device)
        am[node] = tok[nxt]
        node = nxt


def sample_walk(probs: torch.Tensor, tree_tok: torch.Tensor, tree_par: torch.Tensor, seed: torch.Tensor,
                generator: torch.Generator | None, out: torch.Tensor) -> None:
    """sample_walk_ref into `out` [M]; on CUDA one Triton program whose uniforms come from Philox
    keyed by `seed` [1] (advanced by one per call, so a captured graph draws anew each replay)."""
    if not triton_enabled(probs):
        out.copy_(sample_walk_ref(probs, tree_tok, tree_par, generator))
        return
    M, V = probs.shape
    _walk_kernel[(1,)](probs, V, tree_tok, tree_par, seed, out, M=M, MP=pow2(M), BLOCK_V=pow2(V), num_warps=8,
                       **pdl(probs))


if triton is not None:
    from tandem.kernels.fused import _pdl_enter

    @triton.jit
    def _topk_kernel(x_ptr, stride, tok_ptr, lp_ptr, V, K: tl.constexpr, BLOCK_V: tl.constexpr,
                     PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + b * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        lse = tl.log(tl.sum(tl.exp(x - m), 0)) + m
        for k in tl.static_range(K):
            best = tl.max(x, 0)
            i = tl.argmax(x, 0)  # the lowest index among equal maxima
            lp = best - lse
            tl.store(tok_ptr + b * K + k, i.to(tl.int64))
            tl.store(lp_ptr + b * K + k, lp)
            x = tl.where(offs == i, float("-inf"), x)

    @triton.jit
    def _cond_kernel(tok_ptr, lp_ptr, root_ptr, u_ptr, v_ptr, cond_ptr, R: tl.constexpr, K: tl.constexpr,
                     HAS_MARKOV: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        b = tl.program_id(0)
        a = tl.arange(0, K)  # parent candidates
        c = tl.arange(0, K)  # child candidates
        lp = tl.load(lp_ptr + b * K + c)  # [K]
        if HAS_MARKOV:
            prev_tok = tl.load(tok_ptr + tl.maximum(b - 1, 0) * K + a)
            prev = tl.where(b == 0, tl.load(root_ptr + a * 0), prev_tok)  # [K]
            nxt = tl.load(tok_ptr + b * K + c)
            r = tl.arange(0, R)
            uu = tl.load(u_ptr + prev[:, None] * R + r[None, :]).to(tl.float32)  # [K, R]
            vv = tl.load(v_ptr + nxt[:, None] * R + r[None, :]).to(tl.float32)  # [K, R]
            g = lp[None, :] + tl.sum(uu[:, None, :] * vv[None, :, :], 2)  # [K, K]
            mx = tl.max(g, 1)
            lse = tl.log(tl.sum(tl.exp(g - mx[:, None]), 1)) + mx  # [K]
            rest = tl.log(1.0 - tl.minimum(tl.sum(tl.exp(lp), 0), 1.0 - 1e-6))  # the mass outside the top K
            top = tl.maximum(lse, rest)
            norm = top + tl.log(tl.exp(lse - top) + tl.exp(rest - top))
            g = g - norm[:, None]
        else:
            g = lp[None, :] + tl.zeros([K, K], dtype=tl.float32)
        tl.store(cond_ptr + b * K * K + a[:, None] * K + c[None, :], g)

    @triton.jit
    def _top(key, N: tl.constexpr):
        # [N] the N largest keys, largest first: a bitonic top-k (no full sort of the keys, no trip
        # through memory); tl.topk fails for N = 1 (it reduces to a scalar), so that is a max
        if N == 1:
            return tl.zeros([1], key.dtype) + tl.max(key, 0)
        else:
            return tl.topk(key, N)

    @triton.jit
    def _best_n(score_ptr, ids_ptr, n_all, N: tl.constexpr, NP: tl.constexpr, TP: tl.constexpr):
        # the N best of n_all scores (keys as score_keys: ties to the lower index), in ascending
        # index order (a topological one where parents precede children) -> (j [NP], valid, index
        # [NP]: 0 where not valid); ids[index] = j + 1, each kept entry's node id (NOTE: the caller
        # reads ids only after a barrier)
        f = tl.arange(0, TP)
        live = f < n_all
        s = tl.load(score_ptr + f, mask=live, other=float("-inf"))
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << 32) | (TP - 1 - f).to(tl.int64)
        key = tl.where(live, key, tl.full([TP], -1, tl.int64) << 63)  # INT64_MIN: below every real key (-inf's too)
        j = tl.arange(0, NP)
        valid = j < N
        top = _top(key, NP)  # the NP best, best first
        idx = (TP - 1) - (top - ((top >> 32) << 32))
        idx = tl.sort(tl.where(valid, idx, TP), 0)
        idx = tl.where(valid, idx, 0)  # (in bounds where masked)
        tl.store(ids_ptr + idx, (j + 1).to(tl.int64), mask=valid)
        return j, valid, idx

    @triton.jit
    def _finish_tree(root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, M: tl.constexpr, MP: tl.constexpr, MAXD: tl.constexpr):
        # a tree whose nodes 1.. were just written to t, p, d: its root row (the root token, parent
        # -1, depth 0), then anc [M, M] bool. reach[i, j] (j is i or an ancestor of i) is the closure
        # of the parent relation, by squaring in registers: after s products it holds the paths of
        # length <= 2^s, so ceil(log2(MAXD)) products (MAXD: the deepest node) instead of MAXD
        # dependent loads up the parent chain. 0/1 in fp16, sums <= MP in fp32: exact. (MP >= 16:
        # tl.dot's smallest block.)
        tl.store(t_ptr, tl.load(root_ptr))
        tl.store(p_ptr, -1)
        tl.store(d_ptr, 0)
        tl.debug_barrier()
        i = tl.arange(0, MP)
        par = tl.load(p_ptr + i, mask=i < M, other=-1)  # [MP]
        reach = ((par[:, None] == i[None, :]) | (i[:, None] == i[None, :])).to(tl.float16)  # [MP, MP]
        for s in tl.static_range(8):
            if (1 << s) < MAXD:
                reach = (tl.dot(reach, reach) > 0).to(tl.float16)
        inside = (i[:, None] < M) & (i[None, :] < M)
        tl.store(anc_ptr + i[:, None] * M + i[None, :], reach > 0, mask=inside)

    @triton.jit
    def _select_kernel(score_ptr, cand_ptr, pslot_ptr, tok_ptr, root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, ids_ptr, BW,
                       W: tl.constexpr, K: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
                       BWP: tl.constexpr, MAXD: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        _select_body(score_ptr, cand_ptr, pslot_ptr, tok_ptr, root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, ids_ptr, BW, W,
                     K, N, NP, MP, BWP, MAXD)

    @triton.jit
    def _select_body(score_ptr, cand_ptr, pslot_ptr, tok_ptr, root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, ids_ptr, BW,
                     W: tl.constexpr, K: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
                     BWP: tl.constexpr, MAXD: tl.constexpr):
        # the N best of the B * W beam entries, level-major: a topological order
        j, valid, sel = _best_n(score_ptr, ids_ptr, BW, N, NP, BWP)
        level = sel // W
        tl.debug_barrier()
        ps = tl.load(pslot_ptr + sel, mask=valid, other=0)
        pentry = tl.maximum(level - 1, 0) * W + ps
        parent = tl.where(level == 0, 0, tl.load(ids_ptr + pentry, mask=valid & (level > 0), other=0))
        cand = tl.load(cand_ptr + sel, mask=valid, other=0)
        token = tl.load(tok_ptr + level * K + cand, mask=valid, other=0)
        tl.store(t_ptr + 1 + j, token, mask=valid)
        tl.store(p_ptr + 1 + j, parent, mask=valid)
        tl.store(d_ptr + 1 + j, level + 1, mask=valid)
        _finish_tree(root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, N + 1, MP, MAXD)

    @triton.jit
    def _accept_kernel(am_ptr, tok_ptr, par_ptr, depth_ptr, anc_ptr, prefix_ptr, src_ptr, dst_ptr, node_ptr, ctx_ptr,
                       P_ptr, rec_ptr, M: tl.constexpr, MP: tl.constexpr, PM: tl.constexpr, PMP: tl.constexpr,
                       PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        i = tl.arange(0, MP)
        live = i < M
        tok = tl.load(tok_ptr + i, mask=live, other=-1)
        par = tl.load(par_ptr + i, mask=live, other=0)
        am_par = tl.load(am_ptr + tl.maximum(par, 0), mask=live, other=-2)
        match = ((tok == am_par) | (i == 0)) & live
        j = tl.arange(0, MP)
        anc = tl.load(anc_ptr + i[:, None] * M + j[None, :], mask=live[:, None] & (j[None, :] < M), other=0)
        failed = (anc.to(tl.int32) > 0) & (match[None, :] == 0)  # [MP, MP]
        bad = tl.max(failed.to(tl.int32), 1)  # [MP] an ancestor (or the node itself) does not match
        acc = (bad == 0) & live
        depth = tl.load(depth_ptr + i, mask=live, other=0)
        dacc = tl.where(acc, depth, -1)
        accepted = tl.max(dacc, 0)
        deepest = tl.argmax(dacc, 0)
        bonus = tl.load(am_ptr + deepest)
        pre = tl.load(prefix_ptr)
        # path[d]: the accepted node at depth d (beyond the accepted depth: d itself)
        d = tl.arange(0, PMP)
        hit = acc[None, :] & (depth[None, :] == d[:, None])  # [PMP, MP]
        path = tl.sum(tl.where(hit, i[None, :], 0), 1) + tl.where(tl.max(hit.to(tl.int32), 1) > 0, 0, d)
        dm = d < PM
        tl.store(src_ptr + d, pre + path, mask=dm)
        tl.store(dst_ptr + d, pre + d, mask=dm)
        tl.debug_barrier()
        # the next context, right-aligned: entry o holds path depth o - (PM - 1 - accepted)
        o = d
        k = o - (PM - 1) + accepted
        node = tl.minimum(tl.load(src_ptr + tl.minimum(tl.maximum(k, 0), PM - 1), mask=dm, other=pre) - pre, M - 1)
        child = tl.minimum(tl.load(src_ptr + tl.minimum(tl.maximum(k + 1, 0), PM - 1), mask=dm, other=pre) - pre,
                           M - 1)
        ctx = tl.where(k == accepted, bonus, tl.load(tok_ptr + child, mask=dm, other=0))
        tl.store(node_ptr + o, node, mask=dm)
        tl.store(ctx_ptr + o, ctx, mask=dm)
        tl.store(rec_ptr + 3 + o, ctx, mask=dm)
        tl.store(rec_ptr, accepted + 1)
        tl.store(rec_ptr + 1, accepted)
        tl.store(rec_ptr + 2, tl.max(depth, 0))
        tl.store(P_ptr, accepted + 1)
        tl.store(prefix_ptr, pre + accepted + 1)

    @triton.jit
    def _beam_kernel(cond_ptr, score_ptr, cand_ptr, pslot_ptr, N, B: tl.constexpr, W: tl.constexpr,
                     K: tl.constexpr, BP: tl.constexpr, EXIT: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        _beam_body(cond_ptr, score_ptr, cand_ptr, pslot_ptr, N, B, W, K, BP, EXIT)

    @triton.jit
    def _tree_kernel(cond_ptr, score_ptr, cand_ptr, pslot_ptr, tok_ptr, root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr,
                     ids_ptr, B: tl.constexpr, W: tl.constexpr, K: tl.constexpr, BP: tl.constexpr, N: tl.constexpr,
                     NP: tl.constexpr, MP: tl.constexpr, BWP: tl.constexpr, NARROW: tl.constexpr,
                     NBWP: tl.constexpr, PDL: tl.constexpr = False):
        # the level beams (stopping early) then the selection, in one program: one launch for the tree.
        # NARROW > 0: first with beams that narrow (each level's top-k half the work or less); that tree is
        # the exact one when it holds fewer than NARROW nodes at every level (the beams' worst entry is
        # then outside it, and every node the narrow beams dropped scores below that entry: launch_tree),
        # else the program runs the full beams too
        _pdl_enter(PDL)
        full = 1
        if NARROW > 0:
            _beam_body(cond_ptr, score_ptr, cand_ptr, pslot_ptr, N, B, NARROW, K, BP, True)
            tl.debug_barrier()
            _select_body(score_ptr, cand_ptr, pslot_ptr, tok_ptr, root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, ids_ptr,
                         B * NARROW, NARROW, K, N, NP, MP, NBWP, B)
            tl.debug_barrier()
            j = tl.arange(0, NP)
            depth = tl.load(d_ptr + 1 + j, mask=j < N, other=0)  # [NP] each node's level + 1
            lv = tl.arange(0, BP)
            per_level = tl.sum((depth[None, :] == lv[:, None] + 1).to(tl.int32), 1)  # [BP]
            # (the root's K children all fit a beam of NARROW >= K: nothing of level 0 was dropped)
            suspect = (per_level >= NARROW) & ((lv > 0) | (K > NARROW))
            full = tl.max(suspect.to(tl.int32), 0)
            tl.debug_barrier()
        if full > 0:
            _beam_body(cond_ptr, score_ptr, cand_ptr, pslot_ptr, N, B, W, K, BP, True)
            tl.debug_barrier()  # the beams were written by other threads of this program
            _select_body(score_ptr, cand_ptr, pslot_ptr, tok_ptr, root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, ids_ptr,
                         B * W, W, K, N, NP, MP, BWP, B)

    @triton.jit
    def _chain_kernel(cond_ptr, score_ptr, cand_ptr, pslot_ptr, tok_ptr, root_ptr, out_ptr, B: tl.constexpr,
                      K: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr = False):
        # the greedy path (a beam of width 1) and its tokens, root first, in one program
        _pdl_enter(PDL)
        _beam_body(cond_ptr, score_ptr, cand_ptr, pslot_ptr, 0, B, 1, K, BP, False)
        tl.debug_barrier()
        d = tl.arange(0, BP)
        dm = d < B
        c = tl.load(cand_ptr + d, mask=dm, other=0)
        tl.store(out_ptr + 1 + d, tl.load(tok_ptr + d * K + c, mask=dm, other=0), mask=dm)
        tl.store(out_ptr, tl.load(root_ptr))

    @triton.jit
    def _beam_body(cond_ptr, score_ptr, cand_ptr, pslot_ptr, N, B: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
                   BP: tl.constexpr, EXIT: tl.constexpr):
        # one program: the B levels run in sequence, each a top-W of W * K packed keys; with EXIT, the
        # levels after the one whose best is matched by N entries so far are -inf (beam_levels_ref)
        WK: tl.constexpr = W * K
        w = tl.arange(0, W)
        k = tl.arange(0, K)
        flat = tl.arange(0, WK)
        lv = tl.arange(0, BP)
        score = tl.where(w == 0, 0.0, float("-inf"))
        cand = tl.zeros([W], dtype=tl.int32)
        live = tl.full([], 1, tl.int32)
        so_far = tl.full([BP, W], float("-inf"), tl.float32)
        for d in range(B):
            if live > 0:
                row = tl.load(cond_ptr + d * K * K + cand[:, None] * K + k[None, :])  # [W, K]
                s = tl.reshape(score[:, None] + row, [WK])
                bits = s.to(tl.int32, bitcast=True)
                ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
                key = (ordered.to(tl.int64) << 32) | (WK - 1 - flat).to(tl.int64)
                top = _top(key, W)  # the W best, best first
                hi64 = top >> 32
                idx = (WK - 1) - (top - (hi64 << 32)).to(tl.int32)
                hi = hi64.to(tl.int32)
                score = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
                cand = idx % K
                tl.store(score_ptr + d * W + w, score)
                tl.store(cand_ptr + d * W + w, cand.to(tl.int64))
                tl.store(pslot_ptr + d * W + w, (idx // K).to(tl.int64))
                if EXIT:
                    so_far = tl.where(lv[:, None] == d, score[None, :], so_far)  # [BP, W] levels 0..d, in registers
                    best = tl.max(score, 0)
                    hits = tl.sum(tl.sum((so_far >= best).to(tl.int32), 1), 0)
                    live = (hits < N).to(tl.int32)
            else:
                tl.store(score_ptr + d * W + w, tl.full([W], float("-inf"), tl.float32))
                tl.store(cand_ptr + d * W + w, tl.zeros([W], tl.int64))
                tl.store(pslot_ptr + d * W + w, tl.zeros([W], tl.int64))

    @triton.jit
    def _level_kernel(ctok_ptr, clp_ptr, d2t_ptr, tok_ptr, par_ptr, lp_ptr, fed_ptr, ids_ptr, src_ptr, anc_ptr,
                      mask_ptr, prefix_ptr, d, width, P: tl.constexpr, W: tl.constexpr, NP: tl.constexpr,
                      R: tl.constexpr, RP: tl.constexpr, PREP: tl.constexpr, BLOCK_C: tl.constexpr,
                      PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        _level_glue(ctok_ptr, clp_ptr, d2t_ptr, tok_ptr, par_ptr, lp_ptr, fed_ptr, ids_ptr, src_ptr, anc_ptr, mask_ptr,
                    prefix_ptr, d, width, P, W, NP, R, RP, PREP, BLOCK_C)

    @triton.jit
    def _level_glue(ctok_ptr, clp_ptr, d2t_ptr, tok_ptr, par_ptr, lp_ptr, fed_ptr, ids_ptr, src_ptr, anc_ptr,
                    mask_ptr, prefix_ptr, d, width, P: tl.constexpr, W: tl.constexpr, NP: tl.constexpr,
                    R: tl.constexpr, RP: tl.constexpr, PREP: tl.constexpr, BLOCK_C: tl.constexpr):
        # level_step_ref in one program (also the tail of head_level's top-k kernel, which computes
        # ctok and clp in that same program just before)
        i = tl.arange(0, NP)  # new node i = j * W + c: child c of fed slot j
        live = i < P * W
        j = i // W
        first = d == 0
        base = tl.where(first, 0, W + (d - 1) * W * W)
        # read everything before writing: fed is overwritten below
        fed_j = tl.load(fed_ptr + j, mask=live & (d > 0), other=-1)
        plp = tl.load(lp_ptr + fed_j, mask=live & (d > 0), other=0.0)
        c = tl.load(ctok_ptr + i, mask=live, other=0)
        nt = c + tl.load(d2t_ptr + c, mask=live, other=0)
        nl = plp + tl.load(clp_ptr + i, mask=live, other=0.0).to(tl.float32)
        tl.store(tok_ptr + base + i, nt, mask=live)
        tl.store(par_ptr + base + i, fed_j, mask=live)
        tl.store(lp_ptr + base + i, nl, mask=live)
        if PREP:
            prefix = tl.load(prefix_ptr)
            score = tl.where(live, nl, float("-inf"))
            for s in tl.static_range(W):  # the W best new nodes, ties to the earlier one
                best = tl.max(score, 0)
                pick = tl.min(tl.where((score == best) & live, i, NP), 0)
                score = tl.where(i == pick, float("-inf"), score)
                slot = pick // W
                tl.store(fed_ptr + s, base + pick)
                tl.store(ids_ptr + s, tl.sum(tl.where(i == pick, nt, 0), 0))
                tl.store(src_ptr + s, slot)
                r = d * W + s  # its tree row
                t = tl.arange(0, RP)
                prow = (d - 1) * W + slot
                a = tl.load(anc_ptr + prow * R + t, mask=(t < R) & (d > 0), other=0) != 0
                a = a | (t == r)
                tl.store(anc_ptr + r * R + t, a.to(tl.int1), mask=t < R)
                for c0 in range(0, width, BLOCK_C):
                    col = c0 + tl.arange(0, BLOCK_C)
                    tt = col - prefix
                    inside = (tt >= 0) & (tt < R)
                    up = tl.load(anc_ptr + prow * R + tt, mask=inside & (d > 0), other=0) != 0
                    m = (col < prefix) | (inside & (up | (tt == r)))
                    tl.store(mask_ptr + s * width + col, m.to(tl.int1), mask=col < width)

    @triton.jit
    def _commit_kernel(kv_ptr, src_ptr, dst_ptr, f_ptr, node_ptr, out_ptr, rows, F, sf, NKV: tl.constexpr,
                       P: tl.constexpr, PP: tl.constexpr, D: tl.constexpr, BF: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        pid = tl.program_id(0)
        i = tl.arange(0, PP)
        im = i < P
        if pid < NKV:  # the rows of one (K or V, layer, KV head): [rows, D] at pid * rows * D
            base = kv_ptr + pid.to(tl.int64) * rows * D
            d = tl.arange(0, D)
            s = tl.load(src_ptr + i, mask=im, other=0)
            t = tl.load(dst_ptr + i, mask=im, other=0)
            kvrow = tl.load(base + s[:, None] * D + d[None, :], mask=im[:, None], other=0.0)
            tl.debug_barrier()  # every row read before any is written (a destination may be a later source)
            tl.store(base + t[:, None] * D + d[None, :], kvrow, mask=im[:, None])
        else:  # a column block of the features
            c = (pid - NKV) * BF + tl.arange(0, BF)
            cm = c < F
            n = tl.load(node_ptr + i, mask=im, other=0)
            m2 = im[:, None] & cm[None, :]
            frow = tl.load(f_ptr + n[:, None] * sf + c[None, :], mask=m2, other=0.0)
            tl.store(out_ptr + i[:, None] * F + c[None, :], frow, mask=m2)

    @triton.jit
    def _walk_kernel(p_ptr, V, tok_ptr, par_ptr, seed_ptr, am_ptr, M: tl.constexpr, MP: tl.constexpr,
                     BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        offs = tl.arange(0, BLOCK_V)
        vm = offs < V
        mi = tl.arange(0, MP)
        tl.store(am_ptr + mi, tl.full([MP], -1, tl.int64), mask=mi < M)
        seed = tl.load(seed_ptr)
        cur = 0
        done = 0
        draw = 0  # Philox offset: one uniform per decision
        for _ in range(M):  # at most M - 1 accepted nodes, then the bonus
            if done == 0:
                p = tl.load(p_ptr + cur * V + offs, mask=vm, other=0.0)
                total = tl.sum(p, 0)
                nxt = -1
                for c in range(1, M):  # the children in index order
                    if (tl.load(par_ptr + c) == cur) & (nxt < 0):
                        x = tl.load(tok_ptr + c)
                        px = tl.sum(tl.where(offs == x, p, 0.0), 0)
                        u = tl.rand(seed, draw)
                        draw += 1
                        if u * total < px:
                            nxt = c
                        else:
                            p = tl.where(offs == x, 0.0, p)
                            total = total - px
                if nxt >= 0:
                    tl.store(am_ptr + cur, tl.load(tok_ptr + nxt))
                    cur = nxt
                else:  # the bonus, from the residual: the first token whose cumulative mass passes u * total
                    u = tl.rand(seed, draw)
                    draw += 1
                    cs = tl.cumsum(p, 0)
                    hit = (cs > u * total) & (p > 0) & vm
                    tok = tl.min(tl.where(hit, offs, BLOCK_V), 0)
                    last = tl.max(tl.where((p > 0) & vm, offs, 0), 0)  # rounding at the top end
                    tl.store(am_ptr + cur, tl.minimum(tok, last).to(tl.int64))
                    done = 1
        tl.store(seed_ptr, seed + 1)

    @triton.jit
    def _context_view_kernel(P_ptr, pre_ptr, pos_ptr, slot_ptr, see_ptr, width, scratch, lpre_ptr, lpos_ptr,
                             lslot_ptr, opos_ptr, oslot_ptr, NL, PMAX: tl.constexpr, T: tl.constexpr,
                             TP: tl.constexpr, BW: tl.constexpr, LEVELS: tl.constexpr, NLP: tl.constexpr,
                             PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        r = tl.arange(0, TP)
        rm = r < T
        pre = tl.load(pre_ptr)
        n = tl.load(P_ptr)
        if LEVELS:  # the levels after this pass: the prefix past its rows, their rows' positions and slots
            nxt = pre + n
            i = tl.arange(0, NLP)
            im = i < NL
            tl.store(opos_ptr + i, nxt + tl.load(lpos_ptr + i, mask=im, other=0), mask=im)
            tl.store(oslot_ptr + i, nxt + tl.load(lslot_ptr + i, mask=im, other=0), mask=im)
            tl.store(lpre_ptr, nxt)
            tl.debug_barrier()  # every thread has read pre before it is advanced
            tl.store(pre_ptr, nxt)
        q = r - (PMAX - n)
        real = q >= 0
        tl.store(pos_ptr + r, pre + tl.maximum(q, 0), mask=rm)
        tl.store(slot_ptr + r, tl.where(real, pre + q, scratch), mask=rm)
        for c0 in range(0, width, BW):
            c = c0 + tl.arange(0, BW)
            rel = c[None, :] - pre
            see = tl.where(real[:, None], (rel < 0) | (rel <= q[:, None]), c[None, :] == 0)
            tl.store(see_ptr + r[:, None] * width + c[None, :], see, mask=rm[:, None] & (c[None, :] < width))

    @triton.jit
    def _tree_view_kernel(pre_ptr, depth_ptr, anc_ptr, pos_ptr, slot_ptr, see_ptr, width, M: tl.constexpr,
                          MP: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        i = tl.arange(0, MP)
        im = i < M
        pre = tl.load(pre_ptr)
        tl.store(pos_ptr + i, pre + tl.load(depth_ptr + i, mask=im, other=0), mask=im)
        tl.store(slot_ptr + i, pre + i, mask=im)
        for c0 in range(0, width, BW):
            c = c0 + tl.arange(0, BW)
            rel = c - pre
            inside = (rel >= 0) & (rel < M)
            j = tl.minimum(tl.maximum(rel, 0), M - 1)
            a = tl.load(anc_ptr + i[:, None] * M + j[None, :], mask=im[:, None] & inside[None, :], other=0) != 0
            see = (rel < 0)[None, :] | a
            tl.store(see_ptr + i[:, None] * width + c[None, :], see, mask=im[:, None] & (c[None, :] < width))
