"""`tandem profile`: SpecPilot's cost model from measured step times.

    T_target(N)  one target step of N rows at batch 1 over a --context-token prefix, plus the
                 argmax read-back verification needs (N = 1 is the AR step, T_AR)
    c(N)         T_target(N) / T_AR: what verifying N rows costs in AR steps
    T_draft(w)   one draft expansion of w leaves (step + log-softmax + top-w read-back)
    speedup(n) = tau(n) / (c(n + 1) + (d(n) + 1) * T_draft(w) / T_AR)

for a tree of node budget n (n draft tokens + the root = n + 1 rows verified; d(n) expansion
rounds of width w after the root's, as `SpecConfig.resolved_depth`), given a tau(n) table from
`--tau-json` (a `tandem bench` results.json run with `--nodes` a comma list, or a plain
{"n": tau} object) or measured in-process on a real pair (`--measure-tau`).

Models are presets with random weights (`tandem.bench.presets`): cost depends on shapes only.
Steps run through `ModelRunner` as decoding runs them (fused q/k/v and gate/up projections; CUDA
graphs on GPU, the buckets extended to every requested N, the untimed warm-up runs capture them)
and are timed with CUDA events (perf_counter on CPU); each figure is a median.
The AR step is also compared with its bandwidth floor: weight bytes / the measured bandwidth
of a large device-to-device copy (read + write bytes counted).

profile.json keys: environment, config, target {preset, num_params, weight_bytes},
draft {...}, bandwidth_gb_s, ar_step_ms, ar_floor_ms, ar_vs_floor, t_target_ms {N: ms},
c {N: c(N)}, t_draft_ms {w: ms}, tau {n: tau} | null, tau_source, prediction [{nodes, rows,
depth, tau, c, draft_term, predicted_speedup}], best_nodes, best_predicted_speedup, files,
and with --replay: replay {source, methods: {name: {...}}}.

Acceptance replay (`--replay results.json` from `tandem bench`): every recorded target pass
of every Tandem request is re-timed with this profile's step costs: a pass of a method that
verifies R rows (1 for ar, k + 1 for chain, N + 1 for tree) costs T_target(R) plus its draft
steps, T_draft(1) for the first (it feeds the one or two pending tokens) and T_draft(w) for
each expansion round (k - 1 rounds of width 1 for chain, d rounds of width w for tree). The
predicted speedup over ar, tokens * T_AR / replayed time, is the geometric mean over prompts
of the recorded acceptance on these shapes and this device, beside the measured one.

Drafters (`--draft draft|block|eagle3|DIR`, a comma list, or `bundled` for every bundled
drafter; the target is --target, by default the bundled one): real weights on the chosen
device, each figure a median through the real runners and drafters (CUDA graphs on GPU):

    t_verify(R)   one target pass of R rows + argmax read-back: R = 1 for ar, the drafter's
                  proposed chain or tree plus the root for chain (k + 1) and tree (N + 1); with
                  the target's features on for a block drafter or head, off for ar and a draft model
    t_draft       the drafter's work per target pass: observe the committed tokens, then propose.
                  block: one pass of the pending rows + B - 1 mask rows through its LatticeHead,
                  the lattice read back, best-first walk / best chain on the host. eagle3: the
                  context pass, HeadLevels.run, the selection. draft model: TreeDrafter (greedy
                  chain = width-1 tree), re-rooted after a pass that accepted the greedy path's
                  first round(tau) - 1 nodes.
    tok/s         tau / (t_draft + t_verify);  speedup over ar = tok/s * t_ar
    break-even    tau* = (t_draft + t_verify) / t_ar: the method pays when its tau exceeds it

A hybrid (Qwen3.5) target is timed as the hybrid loop verifies with it (runtime.hybrid: every
GDN layer walks the pass's path from the committed state; the commit's replay is not timed),
with draft models only.

Pending rows per pass (committed tokens fed to the drafter) are round(tau) of the method, 2
without a tau, or --pending-rows. tau per method comes from `--tau-json` (repeatable): a
`tandem bench` results.json (summary[name].tau, shapes from config.method_specs; chain, tree
and tree@N; matched to a drafter by its recorded config.draft folder) or a plain {"N": tau}
table; without one, chain at --k and tree at each --nodes N get costs and break-even tau only.
The best is the highest predicted tok/s, `ar` unless a method beats it. profile.json keys:
environment, config, drafters [{label, path, kind, tau_source}], ar_ms, methods [{drafter,
kind, method, nodes, k, rows, pending_rows, draft_ms, verify_ms, pass_ms, draft_over_verify,
break_even_tau, tau, predicted_tokens_per_s, predicted_speedup, and but for ar the bench's
measured_speedup, measured_draft_ms, measured_verify_ms when its results.json has them}]
(ar first), best, files.
"""
from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.env import read_json
from tandem.cli import add_model_arguments
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig

DEFAULT_ROWS = "1,2,4,8,16,32,48,64,96,128,192,256"
DEFAULT_WIDTHS = "1,2,4,8"
DEFAULT_TAU_NODES = "4,8,16,32,64"
DEFAULT_DRAFTER_NODES = "8,16,32"


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = sorted({int(t) for t in str(text).split(",") if t.strip()})
    except ValueError:
        raise ConfigError(f"{flag} takes a comma list of integers (got {text!r})") from None
    if not out or out[0] < 1:
        raise ConfigError(f"{flag} needs positive integers (got {text!r})")
    return out


def _seed(text: str) -> int:
    return int(text) % 2**63  # NOTE: seed + 1 must still fit torch's generator (< 2**64)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.bench.presets import PRESETS

    p.add_argument("--preset", default="llama3-8b", choices=list(PRESETS), help="target shapes (random weights)")
    p.add_argument("--draft-preset", default=None, choices=list(PRESETS),
                   help="draft shapes (default: the target preset's natural draft)")
    add_model_arguments(p, dtype_default="bfloat16")
    for a in p._actions:  # NOTE: real shapes are for a GPU; the shared --device defaults to cpu
        if "--device" in a.option_strings:
            a.default, a.help = "auto", "cpu | cuda | auto (default: auto, cuda when visible)"
        if "--draft" in a.option_strings:
            a.help = ("profile a real pair's drafters instead of preset shapes: draft | block | eagle3 (bundled), "
                      "a folder, a comma list, or 'bundled' (every bundled drafter); the target is --target "
                      "(default: the bundled one). With --measure-tau: the pair whose tau is measured")
    p.add_argument("--context", type=int, default=512, help="verified prefix length the steps attend to")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="N values for T_target(N) (rows verified per step)")
    p.add_argument("--widths", default=DEFAULT_WIDTHS, help="w values for T_draft(w)")
    p.add_argument("--width", type=int, default=SpecConfig().width, help="tree width w used in the prediction")
    p.add_argument("--iters", type=int, default=None, help="timed repeats per figure (default 30 GPU, 5 CPU)")
    p.add_argument("--tau-json", default=None, action="append",
                   help="tau(n) table: bench results.json or {\"n\": tau}; with --draft, each method's tau "
                        "(repeat it, one bench results.json per drafter)")
    p.add_argument("--measure-tau", action="store_true",
                   help="measure tau(n) on the real pair (--target/--draft, default bundled) first")
    p.add_argument("--tau-nodes", default=DEFAULT_TAU_NODES, help="node budgets for --measure-tau")
    p.add_argument("--tau-prompts", type=int, default=8, help="prompts for --measure-tau")
    p.add_argument("--tau-max-new-tokens", type=int, default=64, help="new tokens per prompt for --measure-tau")
    p.add_argument("--workload", default="source", help="workload for --measure-tau (as tandem bench)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--replay", default=None,
                   help="re-time a bench results.json's recorded acceptance with these step costs")
    p.add_argument("--seed", type=_seed, default=0, help="any integer (taken modulo 2**63; the draft uses seed + 1)")
    p.add_argument("--k", type=int, default=SpecConfig().k, help="--draft: chain length k without a --tau-json")
    p.add_argument("--nodes", default=DEFAULT_DRAFTER_NODES, help="--draft: tree node budgets N without a --tau-json")
    p.add_argument("--pending-rows", type=int, default=None,
                   help="--draft: committed tokens fed to the drafter per pass (default: round(tau), 2 without tau)")
    p.add_argument("--out", default="profile-out", help="folder for profile.json and cost_model.png")
    p.add_argument("--no-plots", action="store_true")


# ---------------------------------------------------------------------------------------------
# Timing
def timer(device) -> Callable[[Callable[[], object], int, int], float]:
    """`measure(fn, iters, warmup=2)`: median seconds of fn() on `device` (tandem.runtime.timing)."""
    from tandem.runtime.timing import median_seconds

    return functools.partial(median_seconds, device)


def copy_bandwidth(device, nbytes: int, iters: int) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`, counting the read and the write."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = timer(device)(lambda: dst.copy_(src), iters, 3)
    return 2 * src.numel() * 4 / t


def time_target_steps(runner, context: int, rows: list[int], iters: int, measure) -> dict[int, float]:
    """Median seconds of one verification step of N rows (+ argmax read-back) per N."""
    import torch

    def step(n: int) -> None:
        runner.cache.drop_tree()
        logits = runner.step(list(range(1, n + 1)), [context + i for i in range(n)],
                             torch.ones(n, n, dtype=torch.bool).tril())  # [n, vocab]
        logits.argmax(-1).tolist()
        runner.cache.drop_tree()

    return {n: measure(lambda n=n: step(n), iters) for n in rows}


def time_draft_expansions(runner, context: int, widths: list[int], iters: int, measure) -> dict[int, float]:
    """Median seconds of one draft expansion of w leaves: step + log-softmax + top-w read-back."""
    import torch

    def expand(w: int) -> None:
        runner.cache.drop_tree()
        logits = runner.step(list(range(1, w + 1)), [context] * w, torch.eye(w, dtype=torch.bool))  # [w, vocab]
        lp, tok = torch.log_softmax(logits.float(), -1).topk(w, dim=-1)
        lp.tolist(), tok.tolist()
        runner.cache.drop_tree()

    return {w: measure(lambda w=w: expand(w), iters) for w in widths}


def prefilled_runner(model, context: int, max_rows: int, buckets: tuple[int, ...], seed: int):
    import torch

    from tandem.runtime.runner import ModelRunner

    runner = ModelRunner(model, context + max_rows + 1, buckets=buckets)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
    runner.prefill(prompt)
    return runner


# ---------------------------------------------------------------------------------------------
# tau tables
def load_tau_json(path: str) -> dict[int, float]:
    data = read_json(path, "--tau-json")
    table = data.get("tau_by_nodes", data.get("tau", data)) if isinstance(data, dict) else None
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"--tau-json {path!r} has no tau table; give a bench results.json run with "
                          "--nodes a comma list, or an object {\"16\": 2.5, ...}")
    try:
        return {int(k): float(v) for k, v in table.items() if v is not None}
    except (TypeError, ValueError):
        raise ConfigError(f"--tau-json {path!r}: keys must be node budgets and values tau numbers") from None


def measure_tau(args, budgets: list[int]) -> dict[int, float]:
    """tau(n) of greedy tree decoding on the real pair, over a few workload prompts."""
    from tandem.bench.workloads import load_workload
    from tandem.runtime.generate import Generator
    from tandem.runtime.pair import load_pair

    pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=True)
    engine = Generator(pair.target, pair.draft, pair.tokenizer)
    prompts = load_workload(args.workload, args.tau_prompts, args.data_dir)
    ctx = engine.context_window
    gen = GenerationConfig(max_new_tokens=args.tau_max_new_tokens)
    keep = max(1, ctx - args.tau_max_new_tokens - 2 * max(budgets) - 8)
    ids_list = [pair.tokenizer.encode(p.text).ids[-keep:] for p in prompts]
    out = {}
    for n in budgets:
        spec = SpecConfig(method="tree", nodes=n, width=args.width)
        tokens = passes = 0
        for ids in ids_list:
            r = engine.generate(ids, "tree", spec, SamplingConfig(), gen)
            tokens, passes = tokens + r.new_tokens, passes + r.target_passes
        out[n] = tokens / max(1, passes)
        print(f"tandem profile: tau({n}) = {out[n]:.3f}", file=sys.stderr)
    del engine, pair
    return out


# ---------------------------------------------------------------------------------------------
def load_replay(path: str) -> dict:
    """A bench results.json's Tandem requests and, per method, (rows, first-step rows, width, rounds)."""
    from tandem.bench.replay import load_trace

    data = load_trace(path)
    specs = data["config"]["method_specs"]
    shapes = {}
    for name, sp in specs.items():
        kind = sp.get("method", name)
        if kind == "ar":
            shapes[name] = (1, 0, 1, 0)
        elif kind == "chain":
            shapes[name] = (sp["k"] + 1, 1, 1, sp["k"] - 1)
        elif kind == "tree":
            depth = SpecConfig(nodes=sp["nodes"], width=sp["width"], depth=sp.get("depth")).resolved_depth()
            shapes[name] = (sp["nodes"] + 1, 1, sp["width"], depth)
    reqs = [r for r in data["requests"] if r["method"] in shapes and r.get("target_passes")]
    measured = {m: v.get("geomean") for m, v in (data.get("speedup") or {}).get("vs_ar", {}).items()}
    return {"source": str(path), "shapes": shapes, "requests": reqs, "measured": measured}


def replay(trace: dict, t_target: dict[int, float], t_draft: dict[int, float]) -> dict:
    import math

    t_ar = t_target[1]
    out = {}
    for name, (rows, first, width, rounds) in trace["shapes"].items():
        reqs = [r for r in trace["requests"] if r["method"] == name]
        if not reqs:
            continue
        per_pass = t_target[rows] + first * t_draft[1] + rounds * t_draft[width]
        passes = sum(r["target_passes"] for r in reqs)
        tokens = sum(r["new_tokens"] for r in reqs)
        logs = [math.log(r["new_tokens"] * t_ar / (r["target_passes"] * per_pass)) for r in reqs if r["new_tokens"]]
        out[name] = {"requests": len(reqs), "passes": passes, "tokens": tokens, "tau": tokens / passes,
                     "rows": rows, "draft_steps_per_pass": first + rounds, "pass_ms": 1e3 * per_pass,
                     "predicted_tokens_per_s": tokens / (passes * per_pass),
                     "predicted_speedup_vs_ar": math.exp(sum(logs) / len(logs)) if logs else None,
                     "measured_speedup_vs_ar": 1.0 if name == "ar" else trace["measured"].get(name)}
    return {"source": trace["source"], "methods": out}


def predict(tau: dict[int, float], t_target: dict[int, float], t_draft: dict[int, float], width: int) -> list[dict]:
    t_ar = t_target[1]
    rows = []
    for n in sorted(tau):
        depth = SpecConfig(nodes=n, width=width).resolved_depth()
        c = t_target[n + 1] / t_ar
        draft_term = (depth + 1) * t_draft[width] / t_ar
        rows.append({"nodes": n, "rows": n + 1, "depth": depth, "tau": tau[n], "c": c, "draft_term": draft_term,
                     "predicted_speedup": tau[n] / (c + draft_term)})
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.bench.env import ensure_out_dir, environment, write_json
    from tandem.bench.presets import DEFAULT_DRAFT, preset_config, random_model, weight_bytes
    from tandem.models.loader import resolve_dtype
    from tandem.runtime.pair import resolve_device
    from tandem.runtime.runner import DEFAULT_BUCKETS

    rows = _int_list(args.rows, "--rows")
    widths = sorted(set(_int_list(args.widths, "--widths")) | {args.width})
    if args.context < 1:
        raise ConfigError(f"--context must be >= 1 (got {args.context})")
    for flag, value in (("--width", args.width), ("--tau-prompts", args.tau_prompts),
                        ("--tau-max-new-tokens", args.tau_max_new_tokens)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")
    if args.tau_json and args.measure_tau:
        raise ConfigError("give either --tau-json FILE or --measure-tau, not both")
    if args.draft is not None and not args.measure_tau:
        return run_drafters(args)
    if args.tau_json and len(args.tau_json) > 1:
        raise ConfigError("--tau-json is given once without --draft (one tau(n) table)")
    ensure_out_dir(args.out)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    iters = args.iters or (30 if device.type == "cuda" else 5)
    if iters < 1:
        raise ConfigError(f"--iters must be >= 1 (got {iters})")
    draft_name = args.draft_preset or DEFAULT_DRAFT.get(args.preset, "tiny")
    tcfg, dcfg = preset_config(args.preset), preset_config(draft_name)

    tau, tau_source = None, None
    if args.tau_json:
        tau, tau_source = load_tau_json(args.tau_json[0]), str(args.tau_json[0])
    elif args.measure_tau:
        tau = measure_tau(args, _int_list(args.tau_nodes, "--tau-nodes"))
        tau_source = "measured"
    replay_trace = load_replay(args.replay) if args.replay else None
    if replay_trace:
        widths = sorted(set(widths) | {w for _, _, w, _ in replay_trace["shapes"].values()})
    measured_rows = sorted(set(rows) | {1} | ({n + 1 for n in tau} if tau else set())
                           | ({r for r, _, _, _ in replay_trace["shapes"].values()} if replay_trace else set()))
    for cfg, name, need in ((tcfg, args.preset, measured_rows[-1]), (dcfg, draft_name, max(widths))):
        if args.context + need + 1 > cfg.max_position_embeddings:
            raise ConfigError(f"--context {args.context} + {need} rows exceeds {name}'s {cfg.max_position_embeddings} positions")
    measure = timer(device)
    buckets = tuple(sorted(set(DEFAULT_BUCKETS) | set(rows) | set(widths)))
    gb = (tcfg.num_params + dcfg.num_params) * dtype.itemsize / 1e9
    if device.type == "cpu" and gb > 2:  # (a GPU-sized preset: the CPU builds and times it for minutes)
        print(f"tandem: note: --preset {args.preset} builds random models of {gb:.1f} GB ({args.dtype}) on the CPU "
              f"and times their passes: minutes; it is sized for --device cuda (--preset tiny for a quick look)",
              file=sys.stderr)

    with torch.inference_mode():
        bw = copy_bandwidth(device, (512 << 20) if device.type == "cuda" else (64 << 20), max(5, iters // 3))
        target = random_model(tcfg, device, dtype, seed=args.seed)
        t_bytes = weight_bytes(target)
        runner = prefilled_runner(target, args.context, measured_rows[-1], buckets, args.seed)
        t_target = time_target_steps(runner, args.context, measured_rows, iters, measure)
        del runner, target
        if device.type == "cuda":
            torch.cuda.empty_cache()
        draft = random_model(dcfg, device, dtype, seed=args.seed + 1)
        d_bytes = weight_bytes(draft)
        druns = prefilled_runner(draft, args.context, max(widths), buckets, args.seed + 1)
        t_draft = time_draft_expansions(druns, args.context, widths, iters, measure)
        del druns, draft

    t_ar = t_target[1]
    floor = t_bytes / bw
    prediction = predict(tau, t_target, t_draft, args.width) if tau else []
    best = max(prediction, key=lambda r: r["predicted_speedup"]) if prediction else None
    report = {
        "environment": environment(device),
        "config": {"preset": args.preset, "draft_preset": draft_name, "device": str(device), "dtype": args.dtype,
                   "context": args.context, "rows": measured_rows, "widths": widths, "width": args.width,
                   "iters": iters, "buckets": list(buckets)},
        "target": {"preset": args.preset, "num_params": tcfg.num_params, "weight_bytes": t_bytes},
        "draft": {"preset": draft_name, "num_params": dcfg.num_params, "weight_bytes": d_bytes},
        "bandwidth_gb_s": bw / 1e9,
        "ar_step_ms": 1e3 * t_ar,
        "ar_floor_ms": 1e3 * floor,
        "ar_vs_floor": t_ar / floor,
        "t_target_ms": {str(n): 1e3 * t for n, t in t_target.items()},
        "c": {str(n): t / t_ar for n, t in t_target.items()},
        "t_draft_ms": {str(w): 1e3 * t for w, t in t_draft.items()},
        "tau": {str(n): v for n, v in sorted(tau.items())} if tau else None,
        "tau_source": tau_source,
        "prediction": prediction,
        "best_nodes": best["nodes"] if best else None,
        "best_predicted_speedup": best["predicted_speedup"] if best else None,
    }
    if replay_trace:
        report["replay"] = replay(replay_trace, t_target, t_draft)
    out = Path(args.out)
    files = ["profile.json"]
    from tandem.bench import plots as P

    if not args.no_plots and P.available():
        ns = sorted(t_target)
        pred = {r["rows"]: r["predicted_speedup"] for r in prediction}
        P.cost_model(ns, [t_target[n] / t_ar for n in ns], [pred.get(n) for n in ns] if pred else None,
                   out / "cost_model.png")
        files.append("cost_model.png")
    report["files"] = files
    write_json(out / "profile.json", report)
    print(format_table(report))
    print(f"tandem profile: wrote {', '.join(str(out / f) for f in files)}", file=sys.stderr)
    return 0


def format_table(r: dict) -> str:
    lines = [(f"{r['config']['preset']} (draft {r['config']['draft_preset']}) on {r['environment']['gpu']}, "
              f"{r['config']['dtype']}, context {r['config']['context']}"),
             (f"AR step {r['ar_step_ms']:.3f} ms; bandwidth floor {r['ar_floor_ms']:.3f} ms "
              f"({r['target']['weight_bytes'] / 1e9:.2f} GB at {r['bandwidth_gb_s']:.0f} GB/s): "
              f"{r['ar_vs_floor']:.2f}x the floor"), "",
             f"{'N':>5} {'T_target ms':>12} {'c(N)':>7}"]
    for n, ms in r["t_target_ms"].items():
        lines.append(f"{n:>5} {ms:12.3f} {r['c'][n]:7.2f}")
    lines += ["", f"{'w':>5} {'T_draft ms':>12}"]
    lines += [f"{w:>5} {ms:12.3f}" for w, ms in r["t_draft_ms"].items()]
    if r.get("replay"):
        lines += ["", f"replay of {r['replay']['source']}:",
                  f"{'method':>10} {'rows':>5} {'tau':>6} {'pred tok/s':>11} {'pred x':>7} {'measured x':>10}"]
        for name, m in r["replay"]["methods"].items():
            meas = "-" if m["measured_speedup_vs_ar"] is None else f"{m['measured_speedup_vs_ar']:.2f}"
            lines.append(f"{name:>10} {m['rows']:>5} {m['tau']:6.2f} {m['predicted_tokens_per_s']:11.1f} "
                         f"{m['predicted_speedup_vs_ar']:7.2f} {meas:>10}")
    if r["prediction"]:
        lines += ["", f"{'nodes':>5} {'d':>3} {'tau':>6} {'c':>6} {'draft':>6} {'speedup':>8}"]
        for p in r["prediction"]:
            lines.append(f"{p['nodes']:>5} {p['depth']:>3} {p['tau']:6.2f} {p['c']:6.2f} {p['draft_term']:6.2f} "
                         f"{p['predicted_speedup']:8.2f}")
        best = r["best_predicted_speedup"]
        lines.append(f"best node budget: {r['best_nodes']} (predicted {best:.2f}x)" if best >= 1.0 else
                     f"nothing pays: ar (the best node budget, {r['best_nodes']}, is predicted at {best:.2f}x)")
    return "\n".join(lines)


# =============================================================================================
# Drafter mode (`--draft draft|block|eagle3|DIR|bundled`): a real pair's costs per method
@dataclass(frozen=True)
class MethodShape:
    """One speculative method as a drafter runs it: chain of k, or a tree of N nodes (w, d)."""

    name: str  # the bench's name: chain | tree | tree@N
    method: str  # chain | tree
    k: int
    nodes: int
    width: int
    depth: int | None = None

    def spec(self) -> SpecConfig:
        return SpecConfig(method=self.method, k=self.k, nodes=self.nodes, width=self.width, depth=self.depth)

    @property
    def max_rows(self) -> int:
        """Rows a target pass verifies at most (the drafter's tree may be smaller)."""
        return (self.k if self.method == "chain" else self.nodes) + 1


@dataclass
class TauTable:
    """Measured tau per method (a bench results.json, or a plain {"N": tau} table for trees)."""

    source: str
    draft: str | None  # the drafter folder the bench ran, when recorded
    shapes: list[MethodShape]
    tau: dict[str, float]  # shape name -> tau
    skipped: list[str]  # methods with a tau this model does not cover (async, peers)
    # shape name -> what the bench measured: speedup (geomean vs ar), draft_ms, verify_ms per pass
    measured: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class Drafter:
    label: str  # as given: draft | block | eagle3 | a folder
    path: Path
    kind: str  # model | block | eagle3 (tandem.runtime.pair.draft_kind)


@dataclass
class MethodCost:
    """What one drafter x method costs per target pass, in seconds; tau when measured."""

    drafter: str | None  # None: ar
    kind: str | None
    method: str  # ar | chain | tree | tree@N
    nodes: int | None  # tree node budget N (None: ar, chain)
    k: int | None  # chain length (None: ar, tree)
    rows: int  # rows the target verifies per pass
    pending_rows: int  # committed tokens the drafter is fed per pass
    t_draft: float
    t_verify: float
    tau: float | None


def default_shapes(k: int, nodes: list[int], width: int) -> list[MethodShape]:
    return [MethodShape("chain", "chain", k, SpecConfig().nodes, width)] + [
        MethodShape(f"tree@{n}", "tree", k, n, width) for n in nodes]


def load_method_taus(path: str, k: int, width: int) -> TauTable:
    """Each method's tau from a `tandem bench` results.json (summary[name].tau, shapes from
    config.method_specs), or tree@N taus from a plain {"N": tau} / tau_by_nodes table."""
    data = read_json(path, "--tau-json")
    if not (isinstance(data, dict) and isinstance(data.get("summary"), dict)):
        table = load_tau_json(path)
        return TauTable(str(path), None, [MethodShape(f"tree@{n}", "tree", k, n, width) for n in sorted(table)],
                        {f"tree@{n}": t for n, t in table.items()}, [])
    cfg = data.get("config") or {}
    specs = cfg.get("method_specs") or {}
    shapes, tau, skipped = [], {}, []
    for name, summ in data["summary"].items():
        t = summ.get("tau") if isinstance(summ, dict) else None
        sp = specs.get(name)
        kind = sp.get("method", name) if isinstance(sp, dict) else name
        if name == "ar" or t is None:
            continue
        if kind not in ("chain", "tree") or not isinstance(sp, dict):
            skipped.append(name)
            continue
        try:
            shape = MethodShape(name, kind, int(sp.get("k", k)), int(sp.get("nodes", SpecConfig().nodes)),
                                int(sp.get("width", width)), None if sp.get("depth") is None else int(sp["depth"]))
            tau[name] = float(t)
        except (TypeError, ValueError):
            raise ConfigError(f"--tau-json {path!r}: method {name!r} has a malformed spec or tau") from None
        shapes.append(shape)
    if not shapes:
        raise ConfigError(f"--tau-json {path!r} has no chain or tree method with a tau")
    vs_ar = ((data.get("speedup") or {}).get("vs_ar") or {}) if isinstance(data.get("speedup"), dict) else {}
    measured = {}
    for s in shapes:
        pt = data["summary"][s.name].get("pass_ms") or {}
        sp = vs_ar.get(s.name) or {}
        measured[s.name] = {"speedup": sp.get("geomean") if isinstance(sp, dict) else None,
                            "draft_ms": pt.get("draft_ms"), "verify_ms": pt.get("verify_ms")}
    return TauTable(str(path), cfg.get("draft"), shapes, tau, skipped, measured)


def resolve_drafters(text: str) -> list[Drafter]:
    """--draft: bundled names, folders, a comma list of them, or 'bundled' (every bundled drafter)."""
    from tandem.runtime.pair import BUNDLED_DRAFTERS, draft_kind

    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if names == ["bundled"]:
        names = [n for n, d in BUNDLED_DRAFTERS.items() if (d / "config.json").is_file()]
        if not names:
            raise ConfigError("--draft bundled: this install has no bundled drafters; pass --draft DIR")
    if not names:
        raise ConfigError("--draft needs a drafter: draft, block, eagle3, a folder, or 'bundled'")
    out = []
    for n in dict.fromkeys(names):
        path = BUNDLED_DRAFTERS[n] if n in BUNDLED_DRAFTERS and not Path(n).exists() else Path(n)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--draft {n!r}: no drafter there ({str(path / 'config.json')!r} is missing)")
        out.append(Drafter(n, path, draft_kind(path)))
    return out


def assign_taus(drafters: list[Drafter], tables: list[TauTable]) -> dict[str, TauTable]:
    """Which tau table belongs to which drafter: the drafter folder the bench recorded (the
    same path, else the same folder name); one table and one drafter go together."""
    out: dict[str, TauTable] = {}
    for t in tables:
        match = None
        if t.draft is not None:
            rec = Path(t.draft)
            match = (next((d for d in drafters if d.path.resolve() == rec.resolve()), None)
                     or next((d for d in drafters if d.path.name == rec.name), None))
        if match is None and t.draft is None and len(drafters) == 1 and len(tables) == 1:
            match = drafters[0]  # (a file that names no drafter: the one profiled; one that names another is refused)
        if match is None:
            raise ConfigError(f"--tau-json {t.source!r} was measured with draft {t.draft!r}, which is none of the "
                              f"profiled drafters ({', '.join(d.label for d in drafters)})")
        if match.label in out:
            raise ConfigError(f"two --tau-json files belong to drafter {match.label!r}; give one per drafter")
        out[match.label] = t
    return out


def predict_methods(t_ar: float, costs: list[MethodCost]) -> list[dict]:
    """One record per method, ar first: pass time, break-even tau (the tau at which the method
    ties ar: t_pass / t_ar), and with a tau, tok/s = tau / t_pass and the speedup over ar."""
    recs = [{"drafter": None, "kind": None, "method": "ar", "nodes": None, "k": None, "rows": 1, "pending_rows": 0,
             "draft_ms": 0.0, "verify_ms": 1e3 * t_ar, "pass_ms": 1e3 * t_ar, "draft_over_verify": 0.0,
             "break_even_tau": 1.0, "tau": 1.0, "predicted_tokens_per_s": 1.0 / t_ar, "predicted_speedup": 1.0}]
    for c in costs:
        t_pass = c.t_draft + c.t_verify
        tps = None if c.tau is None else c.tau / t_pass
        recs.append({"drafter": c.drafter, "kind": c.kind, "method": c.method, "nodes": c.nodes, "k": c.k,
                     "rows": c.rows, "pending_rows": c.pending_rows, "draft_ms": 1e3 * c.t_draft,
                     "verify_ms": 1e3 * c.t_verify, "pass_ms": 1e3 * t_pass,
                     "draft_over_verify": c.t_draft / c.t_verify,
                     "break_even_tau": t_pass / t_ar, "tau": c.tau, "predicted_tokens_per_s": tps,
                     "predicted_speedup": None if tps is None else tps * t_ar})
    return recs


def choose_best(recs: list[dict]) -> dict | None:
    """The record of highest predicted tok/s; `ar` (first) unless a method beats it strictly.
    None when no method has a tau (nothing to compare)."""
    if not any(r["predicted_tokens_per_s"] is not None for r in recs[1:]):
        return None
    best = recs[0]
    for r in recs[1:]:
        if r["predicted_tokens_per_s"] is not None and r["predicted_tokens_per_s"] > best["predicted_tokens_per_s"]:
            best = r
    return best


# ---- measuring ----------------------------------------------------------------------------------
def _load_drafter(d: Drafter, target, tokenizer, device, dtype: str):
    """A further drafter for the already loaded target (the first comes with load_pair)."""
    from tandem.models.loader import load_model, load_tokenizer, resolve_dtype

    if d.kind == "block":
        from tandem.models.block_drafter import load_block_drafter

        return load_block_drafter(d.path, target, device, resolve_dtype(dtype))
    if d.kind == "eagle3":
        from tandem.models.eagle3 import load_eagle3

        return load_eagle3(d.path, target, device, resolve_dtype(dtype))
    if load_tokenizer(d.path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"draft {str(d.path)!r} uses another tokenizer than the target")
    return load_model(d.path, device, dtype)


def _target_runner(target, layers, feature_drafter: bool, prompt: list[int], max_rows: int, buckets):
    """The target's runner as a method decodes with it (features on for a feature drafter, off
    for ar and a draft model), prefilled with prompt[:-1]. Returns (runner, features [len - 1, F])."""
    from tandem.runtime.runner import ModelRunner

    target.feature_layers = None  # NOTE: enable_features(None) would keep a previous drafter's layers
    if feature_drafter:
        target.enable_features(layers)
    runner = ModelRunner(target, len(prompt) + max_rows + 1, buckets=buckets)
    runner.prefill(prompt[:-1])
    feats = None if runner.last_features is None else runner.last_features.clone()
    return runner, feats


def _hybrid_target(target, prompt: list[int], max_rows: int):
    """A hybrid (Qwen3.5) target as the hybrid loop verifies with it (runtime.hybrid.HybridTarget:
    its KV cache and committed GDN state), prefilled with prompt[:-1]."""
    from tandem.runtime.hybrid import HybridTarget

    h = HybridTarget(target, len(prompt) + max_rows + 1)
    h.prefill(prompt[:-1])
    return h


def time_hybrid_steps(h, rows: list[int], iters: int, measure) -> dict[int, float]:
    """Median seconds of one hybrid verification pass of N rows (a chain: every GDN layer walks
    one path of N nodes from the committed state) + the argmax read-back; the rows are dropped
    after each pass (the commit's path replay into the GDN state is not timed)."""

    def step(n: int) -> None:
        logits, _ = h.model.tree_forward(list(range(1, n + 1)), list(range(-1, n - 1)), h.state, h.cache)
        logits.argmax(-1).tolist()
        h.cache.commit([])  # drop the pass's rows

    return {n: measure(lambda n=n: step(n), iters) for n in rows}


def _accepted_path(tree, accept: int) -> list[int]:
    """Node indices of a greedy accepted path: from the root, the most probable child, `accept` times."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents[1:], start=1):
        kids.setdefault(p, []).append(i)
    path, node = [], 0
    while len(path) < accept and kids.get(node):
        node = max(kids[node], key=lambda c: (tree.logp[c], -c))
        path.append(node)
    return path


def time_model_drafter(model, shape: MethodShape, prompt: list[int], accept: int, iters: int,
                       measure) -> tuple[float, int]:
    """Seconds of a small draft model's work per target pass (TreeDrafter: feed the committed
    tokens, the expansion rounds, the selection, and the re-root after the verify), with
    `accept` nodes of the greedy path accepted and a bonus token outside the tree. Greedy chain
    is the width-1 tree, as the Generator runs it. Returns (seconds, rows verified)."""
    from tandem.drafting.tree_drafter import TreeDrafter, tree_rows
    from tandem.runtime.runner import ModelRunner
    from tandem.verify.verifier import VerifyResult

    spec = shape.spec() if shape.method == "tree" else SpecConfig(
        method="tree", nodes=shape.k, width=1, depth=shape.k - 1)
    grow = (iters + 3) * (accept + 1)  # every pass commits accept + 1 tokens
    runner = ModelRunner(model, len(prompt) + grow + spec.nodes + spec.k + tree_rows(spec) + 1)
    drafter = TreeDrafter(runner, spec)
    drafter.start(prompt)
    box = [drafter.propose()]  # feeds the prompt: the prefix later passes attend to

    def one_pass() -> None:
        tree = box[0]
        path = _accepted_path(tree, accept)
        bonus = next(t for t in range(len(tree.tokens) + 1) if t not in set(tree.tokens))
        drafter.observe(VerifyResult([0] + path, [tree.tokens[i] for i in path] + [bonus], len(tree.tokens) - 1), tree)
        box[0] = drafter.propose()

    t = measure(one_pass, iters)
    return t, len(box[0].tokens)


def time_feature_drafter(kind: str, model, shape: MethodShape, prompt: list[int], feats, pending: int,
                         iters: int, measure) -> tuple[float, int]:
    """Seconds of a block drafter's or EAGLE-3 head's work per target pass, as decoding runs it:
    `observe` of `pending` committed tokens with their target features, then `propose` (block:
    one pass of the pending rows + B - 1 mask rows through its LatticeHead, the lattice read back,
    the best-first walk or best chain on the host; head: the context pass, the levels of
    HeadLevels.run, the selection). The prefix is reset after each pass, so every pass attends
    to the same prompt. Returns (seconds, rows verified)."""
    from tandem.runtime.runner import ModelRunner
    from tandem.verify.verifier import VerifyResult

    chain = shape.method == "chain"
    if kind == "block":
        from tandem.drafting.lattice_drafter import LatticeDrafter

        block = model.bconfig.block_size
        runner = ModelRunner(model.lattice_model(), len(prompt) + pending + 2 * block + 1)
        drafter = LatticeDrafter(runner, shape.spec(), chain=chain)
    else:
        from tandem.drafting.eagle_drafter import EagleDrafter

        runner = ModelRunner(model, len(prompt) + pending + EagleDrafter.rows_needed(shape.spec()) + 1)
        drafter = EagleDrafter(runner, shape.spec(), chain=chain)
    drafter.start(prompt, feats)
    box = [drafter.propose()]  # feeds the prompt: the prefix every timed pass attends to
    base = runner.cache.prefix_len
    result = VerifyResult(list(range(pending)), prompt[-pending:], 0)
    pf = feats[-pending:]  # [pending, F] real target features of the committed tokens

    def one_pass() -> None:
        drafter.observe(result, box[0], pf)
        box[0] = drafter.propose()
        runner.cache.truncate(base)

    t = measure(one_pass, iters)
    return t, len(box[0].tokens)


def run_drafters(args: argparse.Namespace) -> int:
    import torch

    from tandem.bench.env import ensure_out_dir, environment, write_json
    from tandem.runtime.pair import load_pair
    from tandem.runtime.runner import DEFAULT_BUCKETS

    if args.replay:
        raise ConfigError("--replay re-times a trace with preset shapes; it does not combine with --draft")
    for flag, value in (("--k", args.k), ("--width", args.width), ("--context", args.context),
                        ("--pending-rows", 1 if args.pending_rows is None else args.pending_rows)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")
    nodes = _int_list(args.nodes, "--nodes")
    drafters = resolve_drafters(args.draft)
    ensure_out_dir(args.out)
    taus = assign_taus(drafters, [load_method_taus(f, args.k, args.width) for f in args.tau_json or []])
    for t in taus.values():
        if t.skipped:
            print(f"tandem profile: note: {t.source}: {', '.join(t.skipped)} not modelled (ar, chain and tree are)",
                  file=sys.stderr)
    pair = load_pair(args.target, str(drafters[0].path), args.device, args.dtype, need_draft=True)
    target = pair.target
    device = target.device
    hybrid = getattr(target, "is_hybrid", False)
    if getattr(pair.draft, "is_hybrid", False):
        raise ConfigError("tandem profile times attention-only draft models; a Qwen3.5 (hybrid) draft is not "
                          "profiled yet (decode with it through tandem generate)")
    if hybrid and any(d.kind in ("block", "eagle3") for d in drafters):
        raise ConfigError("tandem profile times a hybrid (Qwen3.5) target with draft models only; give --draft DIR of a "
                          "small draft model, not block / eagle3")
    iters = args.iters or (30 if device.type == "cuda" else 5)
    if iters < 1:
        raise ConfigError(f"--iters must be >= 1 (got {iters})")
    shapes = {d.label: (taus[d.label].shapes if d.label in taus else default_shapes(args.k, nodes, args.width))
              for d in drafters}
    max_rows = max(s.max_rows for ss in shapes.values() for s in ss)

    def pending_for(label: str, shape: MethodShape) -> int:
        if args.pending_rows is not None:
            return args.pending_rows
        t = taus[label].tau.get(shape.name) if label in taus else None
        return 2 if t is None else max(1, round(t))

    max_pending = max(pending_for(d.label, s) for d in drafters for s in shapes[d.label])
    if max_pending > 64:
        raise ConfigError(f"--pending-rows {max_pending} is more than a pass commits; give at most 64")
    window = target.config.max_position_embeddings
    context = min(args.context, window - 2 * max_rows - max_pending - 34)  # verify rows, tree rows, a block
    if context < max(8, max_pending):
        raise ConfigError(f"--context {args.context} in the pair's window of {window} leaves no room for a prefix of "
                          f"{max(8, max_pending)} tokens beside {max_rows} verified rows; lower --nodes / --k")
    if context < args.context:
        print(f"tandem profile: note: --context {args.context} lowered to {context} (the pair's window is {window})",
              file=sys.stderr)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, target.config.vocab_size, (context + 1,), generator=g).tolist()
    buckets = tuple(sorted(set(DEFAULT_BUCKETS) | {s.max_rows for ss in shapes.values() for s in ss}))
    measure = timer(device)
    t_verify: dict[tuple, float] = {}  # (feature layers | None, rows) -> seconds

    def verify_s(runner, key, rows: int) -> float:
        if (key, rows) not in t_verify:
            # NOTE: the model's switch decides whether a step (or a graph captured now) keeps
            # features: on for a feature drafter's runner, off for ar's and a draft model's
            target.feature_layers = key
            steps = time_hybrid_steps(runner, [rows], iters, measure) if hybrid else \
                time_target_steps(runner, context, [rows], iters, measure)
            t_verify[(key, rows)] = steps[rows]
        return t_verify[(key, rows)]

    costs: list[MethodCost] = []
    with torch.inference_mode():
        plain = _hybrid_target(target, prompt, max_rows) if hybrid else \
            _target_runner(target, None, False, prompt, max_rows, buckets)[0]
        t_ar = verify_s(plain, None, 1)
        for i, d in enumerate(drafters):
            model = pair.draft if i == 0 else _load_drafter(d, target, pair.tokenizer, device, args.dtype)
            feature = d.kind in ("block", "eagle3")
            if feature:
                layers = model.target_feature_layers
                runner, feats = _target_runner(target, layers, True, prompt, max_rows, buckets)
                key = tuple(target.feature_layers)
            else:
                runner, feats, key = plain, None, None
            for s in shapes[d.label]:
                pend = pending_for(d.label, s)
                if feature:
                    t_d, rows = time_feature_drafter(d.kind, model, s, prompt, feats, pend, iters, measure)
                else:
                    t_d, rows = time_model_drafter(model, s, prompt, pend - 1, iters, measure)
                tau = taus[d.label].tau.get(s.name) if d.label in taus else None
                costs.append(MethodCost(d.label, d.kind, s.name, s.nodes if s.method == "tree" else None,
                                        s.k if s.method == "chain" else None, rows, pend, t_d,
                                        verify_s(runner, key, rows), tau))
                print(f"tandem profile: {d.label} {s.name}: draft {1e3 * t_d:.3f} ms, verify {rows} rows "
                      f"{1e3 * costs[-1].t_verify:.3f} ms", file=sys.stderr)
            if feature:
                del runner, feats
            if i > 0:
                del model
        target.feature_layers = None

    recs = predict_methods(t_ar, costs)
    best = choose_best(recs)
    for r in recs[1:]:  # beside each prediction, what the bench measured (a check of the model)
        m = taus[r["drafter"]].measured.get(r["method"], {}) if r["drafter"] in taus else {}
        r.update(measured_speedup=m.get("speedup"), measured_draft_ms=m.get("draft_ms"),
                 measured_verify_ms=m.get("verify_ms"))
    report = {
        "environment": environment(device),
        "config": {"mode": "drafters", "target": str(pair.target_dir), "device": str(device), "dtype": args.dtype,
                   "context": context, "iters": iters, "k": args.k, "nodes": nodes, "width": args.width,
                   "pending_rows": args.pending_rows, "buckets": list(buckets), "hybrid_target": hybrid},
        "drafters": [{"label": d.label, "path": str(d.path), "kind": d.kind,
                      "tau_source": taus[d.label].source if d.label in taus else None} for d in drafters],
        "ar_ms": 1e3 * t_ar,
        "methods": recs,
        "best": None if best is None else {k: best[k] for k in ("drafter", "method", "predicted_tokens_per_s",
                                                                  "predicted_speedup")},
        "files": ["profile.json"],
    }
    out = Path(args.out)
    write_json(out / "profile.json", report)
    print(format_drafter_table(report))
    print(f"tandem profile: wrote {out / 'profile.json'}", file=sys.stderr)
    return 0


def format_drafter_table(r: dict) -> str:
    def f(v, nd=2):
        return "-" if v is None else f"{v:.{nd}f}"

    c = r["config"]
    lines = [f"target {c['target']} on {r['environment']['gpu']}, {c['dtype']}, context {c['context']}", "",
             "| drafter | method | rows | draft ms | verify ms | draft/verify | break-even tau | tau "
             "| pred tok/s | pred x ar | bench x ar | best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    best = r["best"]
    for m in r["methods"]:
        mark = "**best**" if best and (m["drafter"], m["method"]) == (best["drafter"], best["method"]) else ""
        lines.append(f"| {m['drafter'] or '-'} | {m['method']} | {m['rows']} | {f(m['draft_ms'], 3)} "
                     f"| {f(m['verify_ms'], 3)} | {f(m['draft_over_verify'])} | {f(m['break_even_tau'])} "
                     f"| {f(m['tau'])} | {f(m['predicted_tokens_per_s'], 1)} | {f(m['predicted_speedup'])} "
                     f"| {f(m.get('measured_speedup'))} | {mark} |")
    lines.append("")
    if best is None:
        lines.append("no tau given: a method pays where its tau exceeds its break-even tau "
                     "(give --tau-json results.json from `tandem bench` to predict tok/s)")
    elif best["method"] == "ar":
        lines.append("best: ar (no drafter method is predicted to beat plain decoding)")
    else:
        lines.append(f"best: {best['drafter']} {best['method']} (predicted {best['predicted_tokens_per_s']:.1f} tok/s, "
                     f"{best['predicted_speedup']:.2f}x ar)")
    return "\n".join(lines)
