"""An EAGLE-3 head's tree levels in fewer launches: its top-k children in one kernel, the tree
selection in one.

At the bundled size every launch costs about as much as its work (~3-5 us), and a head's draft
is eight passes of ~11 launches plus ~20 launches of selection. Two pieces fold here:

- `head_topk`: the residual add, the final RMSNorm, the LM head and the top-k of each row's
  log-softmax (three launches before: add_rmsnorm, a cuBLAS GEMM, the top-k kernel). Programs
  split the vocabulary; each writes its block's k best logits, max and sum of exp; the last
  program to finish (an atomic counter, reset by that program, so CUDA graphs replay it) merges
  the blocks into the k best log-probs of each row.
- `head_select`: the N nodes of highest cumulative log-prob of the levels' node layout
  (tandem.drafting.eagle_drafter.HeadLevels), as a tree in node order with its ancestor mask
  (topk, sort, index ops and a reachability product before: about twenty launches).

Each has a torch reference (the semantics, and what runs on the CPU); the Triton versions equal
them up to the order of fp32 sums (tests/head_level_checks.py, under Triton's interpreter).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tandem.kernels import fused_layer
from tandem.kernels.fused import embed_norms_ref, pdl, pow2, rmsnorm_ref, triton_enabled
from tandem.kernels.resident import _tree_block, ancestors, key_index, level_step, score_keys, topk_logprobs

try:  # Triton ships with CUDA builds of PyTorch only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

BLOCK_V = 128  # vocabulary entries per program of head_topk
# ... where K >= 16 (the block drafter's lattice: 16 rows, top 16): half the blocks, so half the merge's
# [rows, blocks x K] keys to sweep K times; 22.0 us against 26.6 at 128 (one H100, bench/gpu_draft_kernels.py)
BLOCK_V_WIDE_K = 256
BLOCK_K = 128  # hidden columns per step of its product (bench/gpu_small_kernels.py: 11.8 us at 8 warps, 13.4
#                 at 64 columns and 4 warps, one H100, the bundled head)
TOPK_WARPS = 8
# eagle_qkv's launch: columns of each rotary half a program, input columns a step, warps. At the bundled head
# with 4 rows (bench/gpu_small_kernels.py, one H100): 32 columns (10 programs) 7.4 us, 16 columns (20) 9.5 us
QKV_CB, QKV_BK, QKV_WARPS = 32, 128, 4
# norm_gate_up_silu's launch at a level's few rows: 16 gate columns a program, 2 warps (4.69 us against 5.20
# at the target's 64 columns and 4 warps: bench/gpu_small_kernels.py --ops level, 4 rows, one H100, 2026-12-06)
GATE_UP_BN, GATE_UP_WARPS, GATE_UP_ROWS = 16, 2, 4


# ---- references -----------------------------------------------------------------------------
def head_topk_ref(r: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, eps: float, lm_w: torch.Tensor,
                  k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """r, delta: [R, H] -> (out = r + delta [R, H], the k best log-probs [R, k] float32 and their
    draft ids [R, k] int64 of softmax(lm_head(rmsnorm(out))), best first, ties to the lower id)."""
    out = r + delta
    logits = rmsnorm_ref(out, norm_w, eps) @ lm_w.t()  # [R, V] in the model dtype
    lp, tok = topk_logprobs(logits, k)
    return out, lp, tok


def eagle_qkv_ref(ids, embed, hidden, src, w_embed, w_hidden, eps, w_qkv, positions, inv_freq, n_q, n_kv, k_cache,
                  v_cache, slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An EAGLE-3 layer's input norms and q/k/v: x = cat(rmsnorm(embed[ids]), rmsnorm(hidden[src]))
    [T, 2H] through the q/k/v projection, RoPE, K/V stored at `slots` (src None: hidden's rows in
    order) -> (q [T, n_q, D], hidden[src] [T, H], rmsnorm(hidden[src]) [T, H])."""
    h = hidden if src is None else hidden.index_select(0, src)
    x, hn = embed_norms_ref(ids, embed, h, w_embed, w_hidden, eps)
    _, q = fused_layer.norm_qkv_rope_store_ref(x, None, None, 0.0, w_qkv, None, positions, inv_freq, n_q, n_kv, k_cache,
                                               v_cache, slots)
    return q, h, hn


def level_depths(width: int, nodes: int, device=None) -> torch.Tensor:
    """[nodes] the depth of each node of HeadLevels' layout: w at depth 1, then w * w per level."""
    i = torch.arange(nodes, device=device)
    return torch.where(i < width, 1, 2 + (i - width).clamp(min=0) // (width * width))


def head_select_ref(lp: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, root: torch.Tensor, width: int,
                    max_depth: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """lp, tok, par: [total] the levels' nodes (cumulative log-prob, target id, parent node or -1);
    root: [1] -> the tree of the n best nodes (ties to the earlier node) in node order, root first:
    (tokens [n + 1], parents [n + 1] (root -1), depth [n + 1], ancestors [n + 1, n + 1] bool)."""
    total = lp.shape[0]
    sel = key_index(score_keys(lp).topk(n).values, total).sort().values  # [n] node order: topological
    ids = torch.zeros(total, dtype=torch.long, device=lp.device)
    ids.index_copy_(0, sel, torch.arange(1, n + 1, device=lp.device))
    p = par.index_select(0, sel)
    parents = torch.cat([p.new_full((1,), -1), torch.where(p < 0, 0, ids.index_select(0, p.clamp(min=0)))])
    tokens = torch.cat([root.reshape(1), tok.index_select(0, sel)])
    depth = torch.cat([p.new_zeros(1), level_depths(width, total, lp.device).index_select(0, sel)])
    return tokens, parents, depth, ancestors(parents, max_depth)


# ---- dispatch -------------------------------------------------------------------------------
def enabled(t: torch.Tensor) -> bool:
    """Whether the fused level kernels take tensors like t: on CUDA, unless TANDEM_HEAD_FUSED=0
    (the A/B switch of bench/run_gpu_head.sh: then a level runs the layer, a cuBLAS LM head and
    the top-k kernel, and the selection runs as torch ops)."""
    return triton_enabled(t) and os.environ.get("TANDEM_HEAD_FUSED", "1") != "0"


def head_topk(r: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, eps: float, lm_w: torch.Tensor, k: int,
              counter: torch.Tensor | None = None, glue: "LevelGlue | None" = None):
    """head_topk_ref in one launch on CUDA -> (out, log-probs, draft ids, mask). counter: an int32 [1] zero
    that the kernel leaves zero (a static one per caller, so a captured graph replays it); None allocates
    one. glue: a tree level's glue to run on the k best children of each row (tandem.kernels.resident.
    level_step: in the kernel's merging program on CUDA, which saves the glue its own launch); mask is
    what level_step returns (None without glue)."""
    if not enabled(r):
        out, lp, tok = head_topk_ref(r, delta, norm_w, eps, lm_w, k)
        return out, lp, tok, None if glue is None else glue.run(tok, lp)
    if glue is not None and os.environ.get("TANDEM_HEAD_GLUE", "1") == "0":  # the A/B switch: a launch of its own
        out, lp, tok, _ = launch_head_topk(r, delta, norm_w, eps, lm_w, k, counter)
        return out, lp, tok, glue.run(tok, lp)
    return launch_head_topk(r, delta, norm_w, eps, lm_w, k, counter, glue=glue)


@dataclass(frozen=True)
class LevelGlue:
    """level_step's arguments other than the children (HeadLevels' node buffers, the level d, the
    attention width, whether to prepare the next level): what head_topk runs after a level's top-k."""
    d2t: torch.Tensor
    tok: torch.Tensor
    par: torch.Tensor
    lp: torch.Tensor
    fed: torch.Tensor
    ids: torch.Tensor
    src: torch.Tensor
    anc: torch.Tensor
    prefix: torch.Tensor
    d: int
    width: int
    prep: bool

    def run(self, ctok: torch.Tensor, clp: torch.Tensor) -> torch.Tensor | None:
        """level_step on its own (the unfused paths)."""
        return level_step(ctok, clp, self.d2t, self.tok, self.par, self.lp, self.fed, self.ids, self.src, self.anc,
                          self.prefix, self.d, self.width, self.prep)


def norm_gate_up_silu(x, delta, ln_w, eps, w_gate_up):
    """fused_layer.norm_gate_up_silu for an EAGLE-3 head's pass: a level's few rows (at most GATE_UP_ROWS)
    at the head's own launch shape, more rows (the context pass) at the target's."""
    few = x.shape[0] <= GATE_UP_ROWS
    return fused_layer.norm_gate_up_silu(x, delta, ln_w, eps, w_gate_up, GATE_UP_BN if few else None,
                                         GATE_UP_WARPS if few else None)


def launch_head_topk(r, delta, norm_w, eps, lm_w, k, counter=None, bv: int | None = None, bk: int = BLOCK_K,
                     num_warps: int = TOPK_WARPS, glue: LevelGlue | None = None, bitonic: bool = False,
                     pre: bool | None = None):
    # bitonic: each block's and the merge's top K by tl.topk where K is a power of two, else K max sweeps
    # (the sweeps: at the block lattice's 16 rows, top 16, tl.topk took 42-78 us against 22-27, one H100);
    # pre: fused_layer.preload's
    R, H = r.shape
    V = lm_w.shape[0]
    bv = bv or (BLOCK_V_WIDE_K if k >= 16 else BLOCK_V)
    assert r.stride(-1) == 1 and delta.stride(-1) == 1 and lm_w.is_contiguous() and k <= bv
    dev = r.device
    nb = triton.cdiv(V, bv)
    rp = max(16, pow2(R))  # tl.dot's smallest row block
    # a key packs a score and its vocabulary id in 32 bits where both fit (16-bit dtypes, V <= 2^16)
    key64 = r.dtype == torch.float32 or V > 1 << 16
    out = torch.empty(R, H, device=dev, dtype=r.dtype)
    pkey = torch.empty(nb, rp, k, dtype=torch.int64 if key64 else torch.int32, device=dev)
    pstat = torch.empty(2, nb, rp, dtype=torch.float32, device=dev)
    tok = torch.empty(R, k, dtype=torch.long, device=dev)
    lp = torch.empty(R, k, dtype=torch.float32, device=dev)
    if counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
    mask = None
    if glue is None:  # the glue's arguments go unused (GLUE off): any pointers, zeros
        g = (tok,) * 10 + (0, 0)
        gshape = dict(GP=1, GNP=1, GR=1, GRP=1, PREP=False)
    else:
        ra = glue.anc.shape[0]
        mask = torch.empty(k, glue.width, dtype=torch.bool, device=dev) if glue.prep else glue.anc
        g = (glue.d2t, glue.tok, glue.par, glue.lp, glue.fed, glue.ids, glue.src, glue.anc, mask, glue.prefix,
             glue.d, glue.width)
        gshape = dict(GP=R, GNP=pow2(R * k), GR=ra, GRP=pow2(ra), PREP=glue.prep)
    _head_topk_kernel[(nb,)](r, delta, norm_w, lm_w, out, pkey, pstat, counter, tok, lp, R, H, V, r.stride(0),
                             delta.stride(0), eps, *g, K=k, RP=rp, BV=bv, BK=bk, NB=nb, NBKP=pow2(nb * k),
                             IEEE=r.dtype == torch.float32, KEY64=key64, TOPK=bitonic and k > 1 and k & (k - 1) == 0,
                             GLUE=glue is not None, **gshape, PRE=fused_layer.preload(pre),
                             num_warps=num_warps, **pdl(r))
    return out, lp, tok, mask if glue is not None and glue.prep else None


def eagle_qkv(ids, embed, hidden, src, w_embed, w_hidden, eps, w_qkv, positions, inv_freq, n_q, n_kv, k_cache,
              v_cache, slots):
    """eagle_qkv_ref in one launch on CUDA (two before: the input norms, then q/k/v)."""
    if not enabled(hidden):
        return eagle_qkv_ref(ids, embed, hidden, src, w_embed, w_hidden, eps, w_qkv, positions, inv_freq, n_q, n_kv,
                             k_cache, v_cache, slots)
    return launch_eagle_qkv(ids, embed, hidden, src, w_embed, w_hidden, eps, w_qkv, positions, inv_freq, n_q, n_kv,
                            k_cache, v_cache, slots)


def launch_eagle_qkv(ids, embed, hidden, src, w_embed, w_hidden, eps, w_qkv, positions, inv_freq, n_q, n_kv, k_cache,
                     v_cache, slots, bk: int | None = None, cb: int | None = None, num_warps: int | None = None):
    T, H = ids.shape[0], hidden.shape[-1]
    heads = n_q + 2 * n_kv
    D = w_qkv.shape[0] // heads
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[0] == 1 and k_cache.dim() == 4
    assert hidden.stride(-1) == 1 and embed.is_contiguous() and w_qkv.is_contiguous() and w_qkv.shape[1] == 2 * H
    dev, dt = hidden.device, hidden.dtype
    q = torch.empty(T, n_q, D, dtype=dt, device=dev)
    h = torch.empty(T, H, dtype=dt, device=dev)
    hn = torch.empty(T, H, dtype=dt, device=dev)
    CB = min(cb or QKV_CB, D // 2)
    BK = min(bk or QKV_BK, pow2(H))
    _eagle_qkv_kernel[(heads * (D // 2 // CB), triton.cdiv(T, fused_layer.BLOCK_M))](
        ids, embed, hidden, src if src is not None else ids, w_embed, w_hidden, w_qkv, positions, slots, inv_freq,
        h, hn, q, k_cache, v_cache, T, H, eps, hidden.stride(0), k_cache.stride(1), k_cache.stride(2), N_Q=n_q,
        N_KV=n_kv, HALF=D // 2, GATHER=src is not None, BM=fused_layer.BLOCK_M, BK=BK, CB=CB,
        IEEE=dt == torch.float32, num_warps=num_warps or QKV_WARPS, **pdl(ids))
    return q, h, hn


def head_select(lp: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, root: torch.Tensor, width: int,
                max_depth: int, n: int, out: tuple[torch.Tensor, ...]) -> None:
    """head_select_ref written into out = (tokens, parents, depth, ancestors); one program on CUDA."""
    if not enabled(lp):
        for o, v in zip(out, head_select_ref(lp, tok, par, root, width, max_depth, n)):
            o.copy_(v)
        return
    launch_head_select(lp, tok, par, root, width, max_depth, n, out)


def launch_head_select(lp, tok, par, root, width, max_depth, n, out) -> None:
    total = lp.shape[0]
    t, p, d, anc = out
    tp = pow2(total)
    ids = torch.empty(total, dtype=torch.long, device=lp.device)
    _head_select_kernel[(1,)](lp, tok, par, root, t, p, d, anc, ids, total, W=width, N=n, NP=pow2(n),
                              MP=_tree_block(n), TP=tp, MAXD=max_depth, num_warps=4, **pdl(lp))


# ---- Triton ---------------------------------------------------------------------------------
if triton is not None:
    from tandem.kernels.fused import _pdl_enter
    from tandem.kernels.fused_layer import _mm, _normed, _qkv_store, _w_tile
    from tandem.kernels.resident import _best_n, _finish_tree, _level_glue

    @triton.jit
    def _key(x, idx, DT: tl.constexpr, KEY64: tl.constexpr):
        # one integer per (score, index) ordered as the score, ties to the lower index, so a top-k step
        # is one max reduction (a max and an arg-min before). x: fp32 holding values of the model dtype
        # DT; idx < 2^16 unless KEY64. A 16-bit dtype's score needs only its own 16 bits.
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 ranks as 0.0, as the float comparison has it
        if KEY64:
            b = x.to(tl.int32, bitcast=True)
            o = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
            return (o.to(tl.int64) << 32) + (0x7FFFFFFF - idx).to(tl.int64)
        else:
            b = x.to(DT).to(tl.int16, bitcast=True).to(tl.int32)
            o = tl.where(b >= 0, b, b ^ 0x7FFF)
            return (o << 16) + (0xFFFF - idx)

    @triton.jit
    def _lowest(KEY64: tl.constexpr):
        # a key below every _key (-inf's included)
        if KEY64:
            return tl.full([], -1, tl.int64) << 63
        else:
            return tl.full([], -1, tl.int32) << 31

    @triton.jit
    def _unkey(key, DT: tl.constexpr, KEY64: tl.constexpr):
        # _key's inverse -> (score fp32, index int32)
        if KEY64:
            hi = key >> 32
            idx = 0x7FFFFFFF - (key - (hi << 32)).to(tl.int32)
            o = hi.to(tl.int32)
            return tl.where(o >= 0, o, o ^ 0x7FFFFFFF).to(tl.float32, bitcast=True), idx
        else:
            hi = key >> 16
            idx = 0xFFFF - (key - (hi << 16))
            o = tl.where(hi >= 0, hi, hi ^ 0x7FFF)
            return o.to(tl.int16).to(DT, bitcast=True).to(tl.float32), idx

    @triton.jit
    def _head_topk_kernel(r_ptr, d_ptr, nw_ptr, w_ptr, out_ptr, pkey_ptr, pstat_ptr, cnt_ptr, tok_ptr, lp_ptr,
                          R, H, V, sr, sd, eps,
                          d2t_ptr, ntok_ptr, npar_ptr, nlp_ptr, fed_ptr, ids_ptr, src_ptr, anc_ptr, mask_ptr,
                          prefix_ptr, level, width,
                          K: tl.constexpr, RP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr,
                          NBKP: tl.constexpr, IEEE: tl.constexpr, KEY64: tl.constexpr, TOPK: tl.constexpr,
                          GLUE: tl.constexpr,
                          GP: tl.constexpr, GNP: tl.constexpr, GR: tl.constexpr, GRP: tl.constexpr,
                          PREP: tl.constexpr, PRE: tl.constexpr = False, PDL: tl.constexpr = False):
        pid = tl.program_id(0)
        v = pid * BV + tl.arange(0, BV)
        vm = v < V
        # PRE: the head's first weight step loads before the PDL wait (fused_layer's _norm_qkv_kernel says why)
        if not PRE:
            _pdl_enter(PDL)
        w = _w_tile(w_ptr, v, vm, 0, H, BK)  # [BK, BV]
        if PRE:
            _pdl_enter(PDL)
        dt = r_ptr.dtype.element_ty
        rows = tl.arange(0, RP)
        rm = rows < R
        # pass 1: each row's sum of squares of out = r + delta (rounded to the model dtype, as `r + delta`)
        ss = tl.zeros([RP], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            m2 = rm[:, None] & (kk[None, :] < H)
            x = tl.load(r_ptr + rows[:, None] * sr + kk[None, :], mask=m2, other=0.0)
            s = (x.to(tl.float32) + tl.load(d_ptr + rows[:, None] * sd + kk[None, :], mask=m2,
                                            other=0.0).to(tl.float32)).to(x.dtype)
            if pid == 0:
                tl.store(out_ptr + rows[:, None] * H + kk[None, :], s, mask=m2)
            s32 = s.to(tl.float32)
            ss += tl.sum(s32 * s32, 1)
        rstd = tl.rsqrt(ss / H + eps)
        # pass 2: this program's block of logits [RP, BV] = rmsnorm(out) @ W[block].T
        acc = tl.zeros([RP, BV], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            m2 = rm[:, None] & km[None, :]
            x = tl.load(r_ptr + rows[:, None] * sr + kk[None, :], mask=m2, other=0.0)
            s = (x.to(tl.float32) + tl.load(d_ptr + rows[:, None] * sd + kk[None, :], mask=m2,
                                            other=0.0).to(tl.float32)).to(x.dtype)
            y = (s.to(tl.float32) * rstd[:, None]).to(x.dtype)  # rmsnorm_ref: normalise in fp32, round,
            nw = tl.load(nw_ptr + kk, mask=km, other=0.0)
            y = (nw.to(tl.float32)[None, :] * y.to(tl.float32)).to(x.dtype)  # then the weight
            if k0 > 0:  # (the first step's was loaded above)
                w = _w_tile(w_ptr, v, vm, k0, H, BK)
            acc += _mm(y, w, IEEE)
        logit = acc.to(dt).to(tl.float32)  # rounded as the product in the model dtype is
        logit = tl.where(vm[None, :], logit, float("-inf"))
        # the block's partials: its K best as keys (the first is the block's max), its sum of exp
        key = _key(logit, v[None, :], dt, KEY64)  # [RP, BV]
        low = _lowest(KEY64)  # below every real key
        best = tl.max(key, 1)  # [RP]
        mx, _ = _unkey(best, dt, KEY64)
        if TOPK:  # the block's K best of each row by a bitonic top-k in registers
            kj = tl.arange(0, K)
            tl.store(pkey_ptr + (pid * RP + rows)[:, None] * K + kj[None, :], tl.topk(key, K))
        else:  # (K not a power of two) K max sweeps
            tl.store(pkey_ptr + (pid * RP + rows) * K, best)
            for j in tl.static_range(1, K):
                key = tl.where(key == best[:, None], low, key)
                best = tl.max(key, 1)
                tl.store(pkey_ptr + (pid * RP + rows) * K + j, best)
        tl.store(pstat_ptr + pid * RP + rows, mx)
        tl.store(pstat_ptr + (NB + pid) * RP + rows, tl.sum(tl.exp(logit - mx[:, None]), 1))
        # the last program to finish merges every block's partials
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == NB - 1:
            cb = tl.arange(0, NBKP) // K  # candidate c = cb * K + cj
            cj = tl.arange(0, NBKP) % K
            cm = cb < NB
            m2 = rm[:, None] & cm[None, :]
            bm = tl.load(pstat_ptr + cb[None, :] * RP + rows[:, None], mask=m2, other=float("-inf"),
                         cache_modifier=".cg")  # [RP, NBKP] (each block's max, K times)
            bs = tl.load(pstat_ptr + (NB + cb[None, :]) * RP + rows[:, None], mask=m2 & (cj[None, :] == 0),
                         other=0.0, cache_modifier=".cg")
            cand = tl.load(pkey_ptr + (cb[None, :] * RP + rows[:, None]) * K + cj[None, :], mask=m2,
                           other=low, cache_modifier=".cg")
            gm = tl.max(bm, 1)  # [RP]
            lse = gm + tl.log(tl.sum(bs * tl.exp(bm - gm[:, None]), 1))
            if TOPK:
                kj = tl.arange(0, K)
                val, at = _unkey(tl.topk(cand, K), dt, KEY64)  # [RP, K] each row's K best, best first
                km = rm[:, None] & (kj[None, :] < K)
                tl.store(tok_ptr + rows[:, None] * K + kj[None, :], at.to(tl.int64), mask=km)
                tl.store(lp_ptr + rows[:, None] * K + kj[None, :], val - lse[:, None], mask=km)
            else:
                for n in tl.static_range(K):
                    best = tl.max(cand, 1)
                    val, at = _unkey(best, dt, KEY64)
                    tl.store(tok_ptr + rows * K + n, at.to(tl.int64), mask=rm)
                    tl.store(lp_ptr + rows * K + n, val - lse, mask=rm)
                    cand = tl.where(cand == best[:, None], low, cand)
            tl.atomic_xchg(cnt_ptr, 0)
            if GLUE:  # the level's glue (resident.level_step) on the children just written, in this program
                tl.debug_barrier()
                _level_glue(tok_ptr, lp_ptr, d2t_ptr, ntok_ptr, npar_ptr, nlp_ptr, fed_ptr, ids_ptr, src_ptr,
                            anc_ptr, mask_ptr, prefix_ptr, level, width, GP, K, GNP, GR, GRP, PREP, 256)

    @triton.jit
    def _head_select_kernel(lp_ptr, tok_ptr, par_ptr, root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, ids_ptr,
                            total, W: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
                            TP: tl.constexpr, MAXD: tl.constexpr, PDL: tl.constexpr = False):
        # the N best nodes (ties to the earlier node), in node order: a topological one
        _pdl_enter(PDL)
        j, valid, sel = _best_n(lp_ptr, ids_ptr, total, N, NP, TP)
        tl.debug_barrier()
        pn = tl.load(par_ptr + sel, mask=valid, other=-1)
        parent = tl.where(pn < 0, 0, tl.load(ids_ptr + tl.maximum(pn, 0), mask=valid & (pn >= 0), other=0))
        depth = tl.where(sel < W, 1, 2 + (sel - W) // (W * W))
        tl.store(t_ptr + 1 + j, tl.load(tok_ptr + sel, mask=valid, other=0), mask=valid)
        tl.store(p_ptr + 1 + j, parent, mask=valid)
        tl.store(d_ptr + 1 + j, depth, mask=valid)
        _finish_tree(root_ptr, t_ptr, p_ptr, d_ptr, anc_ptr, N + 1, MP, MAXD)

    @triton.jit
    def _eagle_qkv_kernel(ids_ptr, e_ptr, h_ptr, src_ptr, we_ptr, wh_ptr, w_ptr, pos_ptr, slot_ptr, inv_ptr, hg_ptr,
                          hn_ptr, q_ptr, k_ptr, v_ptr, M, H, eps, sh, cache_h, cache_s, N_Q: tl.constexpr,
                          N_KV: tl.constexpr, HALF: tl.constexpr, GATHER: tl.constexpr, BM: tl.constexpr,
                          BK: tl.constexpr, CB: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
        # fused_layer's q/k/v kernel (the same grid: heads x column blocks, row blocks) whose input row
        # is cat(rmsnorm(embed[id]), rmsnorm(hidden[src])), built in its prologue from the two tables
        _pdl_enter(PDL)
        pid = tl.program_id(0)
        head = pid // (HALF // CB)
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        rm = rows < M
        tok = tl.load(ids_ptr + rows, mask=rm, other=0)
        if GATHER:
            hrow = tl.load(src_ptr + rows, mask=rm, other=0)
        else:
            hrow = rows
        # each half's 1 / rms (rmsnorm_ref's: fp32)
        se = tl.zeros([BM], tl.float32)
        sq = tl.zeros([BM], tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            m2 = rm[:, None] & (kk[None, :] < H)
            e = tl.load(e_ptr + tok[:, None] * H + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            se += tl.sum(e * e, 1)
            h = tl.load(h_ptr + hrow[:, None] * sh + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            sq += tl.sum(h * h, 1)
        rstd_e = tl.rsqrt(se / H + eps)
        rstd_h = tl.rsqrt(sq / H + eps)
        i = (pid % (HALF // CB)) * CB + tl.arange(0, CB)  # columns of the first half; i + HALF their partners
        n1 = head * 2 * HALF + i  # weight rows
        acc1 = tl.zeros([BM, CB], tl.float32)
        acc2 = tl.zeros([BM, CB], tl.float32)
        for k0 in range(0, H, BK):  # the embedding half of the input
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            e = tl.load(e_ptr + tok[:, None] * H + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            y = _normed(e, rstd_e, we_ptr, kk, km)
            w1 = tl.load(w_ptr + n1[None, :] * (2 * H) + kk[:, None], mask=km[:, None], other=0.0)  # [BK, CB]
            w2 = tl.load(w_ptr + (n1 + HALF)[None, :] * (2 * H) + kk[:, None], mask=km[:, None], other=0.0)
            acc1 = acc1 + _mm(y, w1, IEEE)
            acc2 = acc2 + _mm(y, w2, IEEE)
        for k0 in range(0, H, BK):  # the hidden half
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            m2 = rm[:, None] & km[None, :]
            h = tl.load(h_ptr + hrow[:, None] * sh + kk[None, :], mask=m2, other=0.0)
            y = _normed(h, rstd_h, wh_ptr, kk, km)
            # the layer's residual base (the row's hidden, or its norm), written by one program a row block
            tl.store(hg_ptr + rows[:, None] * H + kk[None, :], h, mask=m2 & (pid == 0))
            tl.store(hn_ptr + rows[:, None] * H + kk[None, :], y, mask=m2 & (pid == 0))
            w1 = tl.load(w_ptr + n1[None, :] * (2 * H) + (H + kk)[:, None], mask=km[:, None], other=0.0)
            w2 = tl.load(w_ptr + (n1 + HALF)[None, :] * (2 * H) + (H + kk)[:, None], mask=km[:, None], other=0.0)
            acc1 = acc1 + _mm(y, w1, IEEE)
            acc2 = acc2 + _mm(y, w2, IEEE)
        _qkv_store(acc1, acc2, head, i, rows, rm, pos_ptr, inv_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                   cache_h, cache_s, h_ptr.dtype.element_ty, N_Q, N_KV, HALF)
