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
"""
from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from tandem.bench.env import read_json
from tandem.cli import add_model_arguments
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig

DEFAULT_ROWS = "1,2,4,8,16,32,48,64,96,128,192,256"
DEFAULT_WIDTHS = "1,2,4,8"
DEFAULT_TAU_NODES = "4,8,16,32,64"


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
    p.add_argument("--context", type=int, default=512, help="verified prefix length the steps attend to")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="N values for T_target(N) (rows verified per step)")
    p.add_argument("--widths", default=DEFAULT_WIDTHS, help="w values for T_draft(w)")
    p.add_argument("--width", type=int, default=SpecConfig().width, help="tree width w used in the prediction")
    p.add_argument("--iters", type=int, default=None, help="timed repeats per figure (default 30 GPU, 5 CPU)")
    p.add_argument("--tau-json", default=None, help="tau(n) table: bench results.json or {\"n\": tau}")
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
        tau, tau_source = load_tau_json(args.tau_json), str(args.tau_json)
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
    if not args.no_plots:
        from tandem.bench.plots import cost_model

        ns = sorted(t_target)
        pred = {r["rows"]: r["predicted_speedup"] for r in prediction}
        cost_model(ns, [t_target[n] / t_ar for n in ns], [pred.get(n) for n in ns] if pred else None,
                   out / "cost_model.png")
        files.append("cost_model.png")
    report["files"] = files
    write_json(out / "profile.json", report)
    print(format_table(report))
    print(f"tandem profile: wrote {out / 'profile.json'}", file=sys.stderr)
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
        lines.append(f"best node budget: {r['best_nodes']} (predicted {r['best_predicted_speedup']:.2f}x)")
    return "\n".join(lines)
