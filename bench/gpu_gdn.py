"""GDN tree verification and commit per kernel: the torch walk, the WY form (torch ops; the Triton WY
kernel in launch variants), the Triton path kernel.

At transformers' default Qwen3.5 GDN shape (`Qwen3_5TextConfig()`: 32 value heads of 128 x 128, 16
key heads, 24 of its 32 layers GDN; pass a checkpoint's own values with --heads / --dim / --gdn-layers), for trees of N = 16, 32 and 64 nodes shaped as best-first trees are (each node
under one of the 4 previous ones, so paths run deep), and the commit of an accepted path of 6.
Times are one layer's gated delta rule alone (inputs ready: q, k, v, g, beta), eager and inside a
CUDA graph; `x layers` multiplies by the GDN layer count (the paper's H100 figure is over 48 GDN
layers: verify 1485 -> 542 us, commit 208 -> 119 us). It also reports the memory that per-node
state snapshots would take against what the path kernel keeps (no state per node).

    python bench/gpu_gdn.py --out $OUT/gdn                  # CUDA: timings and outputs checked
    TRITON_INTERPRET=1 python bench/gpu_gdn.py --device cpu --heads 4 --dim 16 --iters 3   # smoke

Every kernel's outputs are checked against the walk before it is timed (exit 1 on a mismatch), and
the Triton kernels' also in bf16 ulps of the path kernel's (the `ulps` column: SpecPilot s4.2 keeps
its WY kernel within one). `--wy-variants` lists the WY kernel's launches to time, each
solve/BV/pieces (default: the shipped doubling/64/3 first).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.kernels.gdn import gdn_chain_chunked, gdn_replay, gdn_tree_walk, gdn_tree_wy, gdn_wy_commit
from tandem.kernels.gdn_path import gdn_path_commit, gdn_path_tree, path_kernel_runs, root_paths
from tandem.kernels.gdn_wy import bf16_ulps, gdn_wy_commit_, gdn_wy_tree
from tandem.tree.draft_tree import ancestor_mask


def best_first_like(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(max(0, i - 4), i) for i in range(1, n)]


def deepest_path(parents: list[int], length: int) -> list[int]:
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    node = min((i for i in range(len(parents)) if depth[i] == min(length - 1, max(depth))), default=0)
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def timed_ms(fn, device: str, iters: int, graph: bool) -> float | None:
    if device != "cuda":
        if graph:
            return None  # (no CUDA graphs off CUDA)
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    from gpu_timing import graph_ms, median_ms

    try:
        return graph_ms([fn], iters) if graph else median_ms([fn], iters)
    except Exception as e:  # a kernel that cannot be captured (e.g. the walk's host loop): no graph figure
        print(f"  (no graph timing: {type(e).__name__}: {str(e).splitlines()[0][:100]})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--heads", type=int, default=32, help="value heads (linear_num_value_heads)")
    ap.add_argument("--dim", type=int, default=128, help="linear_key_head_dim = linear_value_head_dim")
    ap.add_argument("--gdn-layers", type=int, default=24, help="GDN layers of the model (transformers' default config: 24)")
    ap.add_argument("--nodes", default="16,32,64")
    ap.add_argument("--accepted", type=int, default=6, help="length of the committed path")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--prefill", type=int, default=512, help="a prompt of this many tokens: walk vs chunked WY")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--wy-variants", default="doubling/64/3,loop/64/3,doubling/32/3,doubling/128/3,doubling/64/2",
                    help="the Triton WY kernel's launches: solve/BV/pieces, comma-separated ('' for none)")
    args = ap.parse_args()
    dev, H, D = args.device, args.heads, args.dim
    triton_runs = path_kernel_runs(torch.device(dev))
    variants = [v.split("/") for v in args.wy_variants.split(",") if v] if triton_runs else []
    kernels = ["walk", "wy"] + (["path"] if triton_runs else []) + [f"wy_triton {'/'.join(v)}" for v in variants]
    rows, bad = [], 0
    for n in (int(x) for x in args.nodes.split(",")):
        g = torch.Generator(device=dev).manual_seed(n)
        r = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
        q, k, v = r(1, n, H, D) * D ** -0.5, F.normalize(r(1, n, H, D), dim=-1), r(1, n, H, D)
        decay = -torch.rand(1, n, H, generator=g, device=dev)
        beta = torch.rand(1, n, H, generator=g, device=dev)
        S0 = r(1, H, D, D) * 0.1
        parents = best_first_like(n, n)
        path = deepest_path(parents, args.accepted)
        anc = ancestor_mask(parents, dev)
        pl = [t.to(dev) for t in root_paths(parents)]
        ref = gdn_tree_walk(S0, q, k, v, decay, beta, parents)
        ref_state = gdn_replay(S0, k, v, decay, beta, path)
        wy = {}

        def run_wy():
            wy["out"] = gdn_tree_wy(S0, q, k, v, decay, beta, anc)
            return wy["out"][0]

        S_work = S0.clone()
        verify = {"walk": lambda: gdn_tree_walk(S0, q, k, v, decay, beta, parents), "wy": run_wy,
                  "path": lambda: gdn_path_tree(S0, q, k, v, decay, beta, *pl)}
        commit = {"walk": lambda: gdn_replay(S0, k, v, decay, beta, path),
                  "wy": lambda: gdn_wy_commit(S0, k, wy["out"][1], wy["out"][2], path),
                  "path": lambda: gdn_path_commit(S_work.copy_(S0), k, v, decay, beta, *pl, path[-1])}
        on_path = torch.zeros(n, dtype=torch.bool, device=dev)
        on_path[path] = True
        for name in kernels[3:]:
            solve, bv, pieces = name.split()[1].split("/")
            bv, pieces = int(bv), int(pieces)
            wyt = {}

            def run_wyt(solve=solve, bv=bv, pieces=pieces, wyt=wyt):
                wyt["out"] = gdn_wy_tree(S0, q, k, v, decay, beta, anc, solve=solve, bv=bv, pieces=pieces)
                return wyt["out"][0]

            verify[name] = run_wyt
            commit[name] = lambda bv=bv, pieces=pieces, wyt=wyt: gdn_wy_commit_(
                S_work.copy_(S0), k, wyt["out"][1], wyt["out"][2], on_path, path[-1], bv=bv, pieces=pieces)
        ulp_ref = None
        for name in kernels:
            out = verify[name]()
            state = commit[name]().clone()
            err = max((out - ref).abs().max().item(), (state - ref_state).abs().max().item())
            ok = err < 1e-3
            bad += not ok
            if name == "path":
                ulp_ref = (out, state)
            ulps = None
            if ulp_ref is not None and name.startswith("wy_triton"):  # (bf16 ulps at the path kernel's values)
                ulps = max(bf16_ulps(a, b).max().item() for a, b in zip((out, state), ulp_ref))
            row = {"nodes": n, "kernel": name, "max_abs_err": err, "ulps": ulps, "ok": ok, "depth": max(pl[1].tolist()),
                   "verify_ms": timed_ms(verify[name], dev, args.iters, False),
                   "verify_graph_ms": timed_ms(verify[name], dev, args.iters, True) if name != "walk" else None,
                   "commit_ms": timed_ms(commit[name], dev, args.iters, False),
                   "commit_graph_ms": timed_ms(commit[name], dev, args.iters, True) if name != "walk" else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    prefill = {}
    if args.prefill:
        P = args.prefill
        g = torch.Generator(device=dev).manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
        q, k, v = r(1, P, H, D) * D ** -0.5, F.normalize(r(1, P, H, D), dim=-1), r(1, P, H, D)
        decay, beta = -torch.rand(1, P, H, generator=g, device=dev), torch.rand(1, P, H, generator=g, device=dev)
        S0 = r(1, H, D, D) * 0.1
        ref = gdn_tree_walk(S0, q, k, v, decay, beta, list(range(-1, P - 1)))
        got, _ = gdn_chain_chunked(S0, q, k, v, decay, beta)
        err = (got - ref).abs().max().item()
        bad += err >= 1e-3
        few = max(2, args.iters // 20)
        prefill = {"tokens": P, "max_abs_err": err,
                   "walk_ms": timed_ms(lambda: gdn_tree_walk(S0, q, k, v, decay, beta, list(range(-1, P - 1))),
                                       dev, few, False),
                   "chunked_wy_ms": timed_ms(lambda: gdn_chain_chunked(S0, q, k, v, decay, beta), dev, few, False)}
        print(json.dumps({"prefill": prefill}), flush=True)
    snap_bytes = {n: n * H * D * D * 4 * args.gdn_layers for n in (int(x) for x in args.nodes.split(","))}
    fmt = lambda x: "-" if x is None else f"{x * 1e3:.0f}"  # noqa: E731  (us)
    lines = [f"GDN shape: {H} value heads, {D} x {D} state, {args.gdn_layers} GDN layers; device {dev}; "
             f"committed path {args.accepted}", "",
             "| N | kernel | verify us/layer (eager / graph) | x layers (graph) | commit us/layer (eager / graph) "
             "| snapshots would take | max err | bf16 ulps of path |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["verify_graph_ms"] if r["verify_graph_ms"] is not None else r["verify_ms"]
        lines.append(f"| {r['nodes']} | {r['kernel']} | {fmt(r['verify_ms'])} / {fmt(r['verify_graph_ms'])} "
                     f"| {fmt(total * args.gdn_layers)} | {fmt(r['commit_ms'])} / {fmt(r['commit_graph_ms'])} "
                     f"| {snap_bytes[r['nodes']] / 2**30:.2f} GiB | {r['max_abs_err']:.1e} "
                     f"| {'-' if r['ulps'] is None else format(r['ulps'], '.2f')} |")
    if prefill:
        lines += ["", f"Prefill of {prefill['tokens']} tokens, one layer: walk {prefill['walk_ms']:.1f} ms, chunked WY "
                  f"{prefill['chunked_wy_ms']:.1f} ms (max err {prefill['max_abs_err']:.1e})"]
    lines.append("")
    lines.append("Per-node snapshots: N x heads x dk x dv x 4 bytes x GDN layers. The walk keeps at most "
                 "depth + 1 states a layer at once; the path kernel and WY keep none.")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gdn.json").write_text(json.dumps({"rows": rows, "prefill": prefill}, indent=1))
        (args.out / "gdn.md").write_text(table + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
