"""`tandem bench`: methods run paired on one workload, checked token for token against `ar`.

    prompts  = load_workload(...)                     # tokenized, truncated from the left
    methods  = [ar, chain, tree@N..., hf, hf-assisted]
    warm_up(methods, longest prompts)                 # size KV caches, capture CUDA graphs
    for each prompt: run every method (order rotated per prompt) -> Request
    check(requests)                                   # greedy: each method's tokens == ar's
    summarise, paired speed ratios with bootstrap CIs, write results.json / results.md / PNGs

Methods: `ar`, `chain`, `tree` (one run per node budget when `--nodes` is a comma list, named
`tree@N`) and `async` (`tandem.runtime.async_decode`, `--async-transport`) run on Tandem's engine; `hf` is transformers' `generate(do_sample=False)` on the same
device and dtype and `hf-assisted` the same with `assistant_model=<draft>`. Both peers get the
same prompt token ids. `ar` is always run: it is the reference output and the speed baseline.

Speed is per-request *decode* tokens/s (tokens after the first over the time after the first,
so prefill is excluded; TTFT reports it). A speed ratio vs `ar` (and vs `hf`) is the geometric
mean of per-prompt ratios with a seeded bootstrap 95% CI (`tandem.bench.stats`).

Exit status: 0; 1 when a Tandem method's greedy output differs from `ar`'s (unless
`--allow-mismatch`). `hf`/`hf-assisted` differences are reported as *peer mismatches* only:
transformers may resolve near-ties differently in low precision.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tandem.bench.workloads import Prompt, add_workload_arguments, load_workload
from tandem.cli import add_decoding_arguments, add_model_arguments, configs_from_args, notice
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig

PEER_METHODS = ("hf", "hf-assisted")
REFERENCE = "ar"


# ---------------------------------------------------------------------------------------------
# Records
@dataclass(frozen=True)
class MethodSpec:
    name: str  # ar | chain | tree | tree@N | hf | hf-assisted
    kind: str  # tandem | hf
    method: str  # ar | chain | tree (tandem) ; hf | hf-assisted (peer)
    spec: SpecConfig

    @property
    def is_peer(self) -> bool:
        return self.kind == "hf"


@dataclass
class Request:
    """One request of one method: its output and the per-request figures."""

    method: str
    prompt_index: int
    token_ids: list[int]
    seconds: float
    ttft: float
    finish_reason: str
    target_passes: int | None = None  # None for peers (not observable)
    accept_lengths: list[int] = field(default_factory=list)
    per_depth: list[tuple[int, int]] = field(default_factory=list)
    timeline: dict | None = None  # async only: busy seconds of each worker and the draft's choices
    draft_seconds: float | None = None  # serial loop: time drafting / verifying over the request
    verify_seconds: float | None = None
    loop: str | None = None  # Tandem: "resident" (device-resident loop) or "host"; None for peers
    auto_pick: str | None = None  # method auto: the candidate it ran (e.g. "tree d=3")
    passes_past_end: int = 0  # resident loop: passes computed after the request ended (thrown away)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tau(self) -> float | None:
        return None if self.target_passes is None else self.new_tokens / max(1, self.target_passes)

    @property
    def decode_tokens_per_s(self) -> float:
        dt = self.seconds - self.ttft
        return (self.new_tokens - 1) / dt if dt > 0 and self.new_tokens > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(new_tokens=self.new_tokens, tau=self.tau, decode_tokens_per_s=self.decode_tokens_per_s,
                 tokens_per_s=self.tokens_per_s)
        d["per_depth"] = [list(x) for x in self.per_depth]
        return d


@dataclass(frozen=True)
class Divergence:
    method: str
    prompt_index: int
    position: int  # index into the new tokens
    expected: int | None  # ar's token there (None: ar's output ended)
    got: int | None  # the method's token there (None: its output ended)

    def describe(self) -> str:
        return (f"{self.method} diverges from ar on prompt {self.prompt_index} at new token {self.position}: "
                f"expected {self.expected}, got {self.got}")


# ---------------------------------------------------------------------------------------------
# Method runners: prompt ids -> Request
Runner = Callable[[int, list[int]], Request]


def parse_methods(text: str, node_budgets: list[int]) -> list[str]:
    """`ar,chain,tree,hf` -> names; `tree` expands to `tree@N` per budget when several are given."""
    names: list[str] = []
    known = tandem_methods() + PEER_METHODS
    for raw in [t.strip() for t in text.split(",") if t.strip()]:
        base = raw.split("@")[0]
        if base not in known or ("@" in raw and base != "tree"):
            raise ConfigError(f"unknown method {raw!r} in --methods; choose from {', '.join(known)}"
                              " (tree@N for a node budget)")
        if raw == "tree" and len(node_budgets) > 1:
            names += [f"tree@{n}" for n in node_budgets]
        else:
            names.append(raw)
    if not names:
        raise ConfigError("--methods is empty; e.g. --methods ar,chain,tree")
    if REFERENCE not in names:
        names.insert(0, REFERENCE)  # the reference output and speed baseline
    return list(dict.fromkeys(names))


def tandem_methods() -> tuple[str, ...]:
    """The engine's methods (what `Generator.generate` accepts)."""
    from tandem.runtime.generate import METHODS

    return tuple(METHODS)


def parse_nodes(text: str | int) -> list[int]:
    try:
        out = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--nodes takes an integer or a comma list of integers (got {text!r})") from None
    if not out or min(out) < 1:
        raise ConfigError(f"--nodes must be >= 1 (got {text!r})")
    return list(dict.fromkeys(out))


def method_specs(names: list[str], spec: SpecConfig) -> list[MethodSpec]:
    out = []
    for n in names:
        if n in PEER_METHODS:
            out.append(MethodSpec(n, "hf", n, spec))
        elif n.startswith("tree@"):
            s = replace(spec, method="tree", nodes=int(n.split("@")[1]))
            s.validate()
            out.append(MethodSpec(n, "tandem", "tree", s))
        else:
            out.append(MethodSpec(n, "tandem", n, replace(spec, method=n)))
    return out


class TandemRunner:
    """Runs one Tandem method through a shared `Generator` (runners and CUDA graphs are shared)."""

    def __init__(self, engine, ms: MethodSpec, sampling: SamplingConfig, gen: GenerationConfig,
                 transport: str = "auto"):
        self.engine, self.ms, self.sampling, self.gen, self.transport = engine, ms, sampling, gen, transport

    def __call__(self, prompt_index: int, ids: list[int]) -> Request:
        r = self.engine.generate(ids, self.ms.method, self.ms.spec, self.sampling, self.gen, transport=self.transport)
        return Request(self.ms.name, prompt_index, list(r.token_ids), r.seconds, r.ttft, r.finish_reason,
                       r.target_passes, list(r.accept_lengths), list(r.per_depth), timeline_of(r),
                       getattr(r, "draft_seconds", None), getattr(r, "verify_seconds", None),
                       getattr(r, "loop", None), getattr(r, "auto_pick", None), getattr(r, "passes_past_end", 0))


def timeline_of(result) -> dict | None:
    """The async timeline of one request (None for other methods): each worker's busy seconds
    over the request's seconds, expansion rounds run while the target verified, re-root hits."""
    st = getattr(result, "stats", None)
    if not st or "target_busy_s" not in st:
        return None
    ctl = st.get("controller") or {}
    return {"seconds": st.get("seconds", result.seconds), "target_busy_s": st["target_busy_s"],
            "draft_busy_s": st.get("draft_busy_s"), "passes": result.target_passes,
            "overlap_rounds": sum(st.get("rounds", [])), "hit_rate": st.get("hit_rate"),
            "mean_reused": st.get("mean_reused"), "depth": ctl.get("depth"), "collapsed": ctl.get("collapsed")}


class _FirstTokenTimer:
    """A transformers streamer that notes when the first new token arrives (its first put is the prompt)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFRunner:
    """transformers `generate` on the same device/dtype (greedy unless --temperature > 0)."""

    def __init__(self, ms: MethodSpec, target_dir: Path, draft_dir: Path | None, device, dtype: str,
                 sampling: SamplingConfig, gen: GenerationConfig, context_window: int,
                 loaded: dict[str, object] | None = None):
        import torch

        self.torch = torch
        self.ms, self.device, self.sampling, self.gen = ms, device, sampling, gen
        self.context_window = context_window
        loaded = {} if loaded is None else loaded  # path -> model, shared by hf and hf-assisted
        self.model = _cached(loaded, target_dir, device, dtype)
        self.assistant = None
        if ms.method == "hf-assisted":
            if draft_dir is None:
                raise ConfigError("hf-assisted needs a draft model; pass --draft DIR")
            self.assistant = _cached(loaded, draft_dir, device, dtype)

    def __call__(self, prompt_index: int, ids: list[int]) -> Request:
        torch = self.torch
        gc = _hf_generation_config(self.model, self.gen, self.sampling,
                                   min(self.gen.max_new_tokens, self.context_window - len(ids)))
        x = torch.tensor([ids], device=self.device)
        kwargs = {"attention_mask": torch.ones_like(x), "generation_config": gc}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        timer = _FirstTokenTimer()
        if self.sampling.temperature > 0:
            torch.manual_seed(self.sampling.seed)
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode(), _quiet_transformers():
            out = self.model.generate(x, streamer=timer, **kwargs)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        eos = set(gc.eos_token_id or []) if isinstance(gc.eos_token_id, list) else (
            {gc.eos_token_id} if gc.eos_token_id is not None else set())
        finish = "eos" if new and new[-1] in eos else "length"
        ttft = (timer.first - t0) if timer.first is not None else seconds
        return Request(self.ms.name, prompt_index, new, seconds, ttft, finish)


@contextmanager
def _quiet_transformers():
    """Silence transformers' per-call deprecation chatter (assisted generation emits some)."""
    from transformers.utils import logging as tf_logging

    level = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)


def _cached(loaded: dict, path: Path, device, dtype: str):
    key = str(Path(path).resolve())
    if key not in loaded:
        loaded[key] = load_hf_model(path, device, dtype)
    return loaded[key]


def load_hf_model(path: Path, device, dtype: str):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ConfigError("the transformers peers (hf, hf-assisted; generate_batch and padded generate under "
                          "--concurrency) need transformers; pip install 'tandem[bench]'") from None
    from tandem.models.loader import resolve_dtype

    try:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype))
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        m = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=resolve_dtype(dtype))
    return m.to(device).eval()


def _hf_generation_config(model, gen: GenerationConfig, sampling: SamplingConfig, max_new: int):
    """A fresh config (nothing inherited from the checkpoint's generation_config.json)."""
    from transformers import GenerationConfig as HFGenerationConfig

    eos = list(model.config.eos_token_id) if isinstance(model.config.eos_token_id, list) else (
        [model.config.eos_token_id] if model.config.eos_token_id is not None else [])
    sample = sampling.temperature > 0
    return HFGenerationConfig(
        max_new_tokens=max_new,
        # NOTE: to ignore EOS we drop it as a stop token rather than suppress it (min_new_tokens
        # would forbid emitting it), so the output matches Tandem's --ignore-eos token for token.
        eos_token_id=None if gen.ignore_eos else (eos or None),
        pad_token_id=eos[0] if eos else 0,
        do_sample=sample,
        temperature=sampling.temperature if sample else None,
        top_p=sampling.top_p if sample else None,
        top_k=None,
    )


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Checking
def first_divergence(expected: list[int], got: list[int]) -> tuple[int, int | None, int | None] | None:
    """(position, expected token, got token) of the first difference, or None when equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i, a, b
    if len(expected) != len(got):
        i = min(len(expected), len(got))
        return i, (expected[i] if i < len(expected) else None), (got[i] if i < len(got) else None)
    return None


def check_outputs(outputs: dict[str, list[list[int]]], peers: set[str], greedy: bool) -> dict:
    """Compare every method's outputs with `ar`'s, prompt by prompt.

    Returns {"checked", "reference", "mismatches": {method: {...}}, "peer_mismatches": {...},
    "mismatch_count", "peer_mismatch_count", "first_divergence"}; a method's entry has
    "count", "prompts" (indices) and "first" (a `Divergence` as a dict, or None).
    """
    report: dict = {"checked": greedy, "reference": REFERENCE, "mismatches": {}, "peer_mismatches": {},
                    "mismatch_count": 0, "peer_mismatch_count": 0, "first_divergence": None}
    if not greedy:
        report["note"] = "sampling (--temperature > 0): outputs legitimately differ, not checked"
        return report
    ref = outputs[REFERENCE]
    for name, outs in outputs.items():
        if name == REFERENCE:
            continue
        divs = []
        for i, (e, g) in enumerate(zip(ref, outs)):
            d = first_divergence(e, g)
            if d is not None:
                divs.append(Divergence(name, i, *d))
        entry = {"count": len(divs), "prompts": [d.prompt_index for d in divs],
                 "first": asdict(divs[0]) if divs else None}
        key = "peer_mismatches" if name in peers else "mismatches"
        report[key][name] = entry
        report["peer_mismatch_count" if name in peers else "mismatch_count"] += len(divs)
        if divs and name not in peers and report["first_divergence"] is None:
            report["first_divergence"] = asdict(divs[0])
    return report


# ---------------------------------------------------------------------------------------------
# Summaries
def summarize_method(reqs: list[Request]) -> dict:
    from tandem.bench.stats import histogram, summarize

    acc = [a for r in reqs for a in r.accept_lengths]
    passes = [r.target_passes for r in reqs if r.target_passes is not None]
    depth: dict[int, list[int]] = {}
    for r in reqs:
        for k, (offered, accepted) in enumerate(r.per_depth, start=1):
            rec = depth.setdefault(k, [0, 0])
            rec[0] += offered
            rec[1] += accepted
    tokens = sum(r.new_tokens for r in reqs)
    return {
        "requests": len(reqs),
        "new_tokens": tokens,
        # NOTE: a request that stopped after one token has no decode phase; it has no rate to average
        "decode_tokens_per_s": summarize([r.decode_tokens_per_s for r in reqs if r.new_tokens > 1]).to_dict(),
        "tokens_per_s": summarize([r.tokens_per_s for r in reqs]).to_dict(),
        "ttft_s": summarize([r.ttft for r in reqs]).to_dict(),
        # tau over the whole workload: committed tokens / target passes
        "tau": tokens / sum(passes) if passes and len(passes) == len(reqs) and sum(passes) else None,
        "tau_per_request": summarize([r.tau for r in reqs if r.tau is not None]).to_dict(),
        "accept_length_hist": histogram(acc),
        "per_depth": [{"depth": k, "offered": v[0], "accepted": v[1], "rate": v[1] / v[0] if v[0] else None}
                      for k, v in sorted(depth.items())],
        "timeline": summarize_timeline([r.timeline for r in reqs if r.timeline]),
        "pass_ms": pass_times(reqs),
        "loop": ",".join(sorted({r.loop for r in reqs if r.loop})) or None,
        # method auto: how many requests ran each candidate
        "auto_picks": dict(Counter(r.auto_pick for r in reqs if r.auto_pick).most_common()) or None,
    }


def pass_times(reqs: list[Request]) -> dict | None:
    """Mean draft and verify milliseconds per computed target pass (serial loop: the passes past a request's
    end included, since their time is in the request's), their ratio, and the mean passes past the end a
    request."""
    timed = [r for r in reqs if r.draft_seconds is not None and r.target_passes]
    if not timed:
        return None
    passes = sum(r.target_passes + r.passes_past_end for r in timed)
    draft = 1e3 * sum(r.draft_seconds for r in timed) / passes
    verify = 1e3 * sum(r.verify_seconds for r in timed) / passes
    return {"draft_ms": draft, "verify_ms": verify, "draft_over_verify": draft / verify if verify else None,
            "passes_past_end": sum(r.passes_past_end for r in timed) / len(timed)}


def summarize_timeline(tl: list[dict]) -> dict | None:
    """Async: target / draft busy as % of the summed request time, rounds hidden per pass."""
    if not tl:
        return None
    secs = sum(t["seconds"] for t in tl) or 1e-12
    passes = sum(t["passes"] or 0 for t in tl) or 1
    depths = dict(Counter(str(t["depth"]) for t in tl))
    return {"target_busy_pct": 100 * sum(t["target_busy_s"] for t in tl) / secs,
            "draft_busy_pct": 100 * sum(t["draft_busy_s"] or 0 for t in tl) / secs,
            "overlap_rounds_per_pass": sum(t["overlap_rounds"] for t in tl) / passes,
            "hit_rate": sum(t["hit_rate"] or 0 for t in tl) / len(tl),
            "reused_per_reroot": sum(t["mean_reused"] or 0 for t in tl) / len(tl),
            "depth_chosen": depths, "collapsed_requests": sum(bool(t["collapsed"]) for t in tl)}


def speedups(by_method: dict[str, list[Request]], baseline: str, seed: int, n_boot: int) -> dict:
    from tandem.bench.stats import paired_ratio_ci

    base = [r.decode_tokens_per_s for r in by_method[baseline]]
    return {name: paired_ratio_ci([r.decode_tokens_per_s for r in reqs], base, n_boot=n_boot, seed=seed).to_dict()
            for name, reqs in by_method.items() if name != baseline}


def markdown_table(results: dict) -> str:
    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    def ci(d):
        if not d or d.get("geomean") is None:
            return "-"
        lo, hi = d["ci95"]
        return f"{d['geomean']:.2f}x [{lo:.2f}, {hi:.2f}]"

    vs_hf = results["speedup"].get("vs_hf")
    cfg = results["config"]
    head = ("| method | tok/s mean | median | p5 | p95 | TTFT median (ms) | tau | speedup vs ar (95% CI) |"
            + (" vs hf (95% CI) |" if vs_hf else ""))
    sep = "|---" * (8 + (1 if vs_hf else 0)) + "|"
    lines = [f"# tandem bench: {cfg['workload']}, {cfg['num_prompts']} prompts, {cfg['max_new_tokens']} new tokens",
             "", (f"{results['environment']['gpu']}, {cfg['dtype']}, torch {results['environment']['torch']}, "
                  f"commit {results['environment']['git_commit']}"), "", head, sep]
    for name, s in results["summary"].items():
        t = s["decode_tokens_per_s"]
        ttft = s["ttft_s"]["median"]
        row = (f"| {name} | {f(t['mean'])} | {f(t['median'])} | {f(t['p5'])} | {f(t['p95'])} | "
               f"{f(None if ttft is None else ttft * 1000)} | {f(s['tau'], 2)} | "
               f"{'1.00x' if name == REFERENCE else ci(results['speedup']['vs_ar'].get(name))} |")
        if vs_hf:
            row += f" {'1.00x' if name == 'hf' else ci(vs_hf.get(name))} |"
        lines.append(row)
    depth_rows = [(name, s["per_depth"]) for name, s in results["summary"].items() if s["per_depth"]]
    if depth_rows:
        lines += ["", "Per-depth acceptance (accepted / offered passes):"]
        lines += [f"- {name}: " + ", ".join(f"d{d['depth']} {f(d['rate'], 2)}" for d in rows[:12])
                  for name, rows in depth_rows]
    pt_rows = [(name, s["pass_ms"]) for name, s in results["summary"].items()
               if s.get("pass_ms") and s["pass_ms"]["draft_ms"] > 0]
    if pt_rows:
        lines += ["", "Per target pass (mean; device time on the GPU): draft ms / verify ms (draft as a share "
                  "of the verify):"]
        loops = {name: s.get("loop") for name, s in results["summary"].items()}
        lines += [f"- {name}: {p['draft_ms']:.3f} / {p['verify_ms']:.3f} ms ({p['draft_over_verify']:.2f}x)"
                  + (f", {loops[name]} loop" if loops.get(name) else "")
                  + (f", {p['passes_past_end']:.2f} passes past a request's end" if p.get("passes_past_end") else "")
                  for name, p in pt_rows]
    picks = [(name, s["auto_picks"]) for name, s in results["summary"].items() if s.get("auto_picks")]
    if picks:
        lines += ["", "What `auto` ran (requests):"]
        lines += [f"- {name}: " + ", ".join(f"{label} x{n}" for label, n in p.items()) for name, p in picks]
    tl_rows = [(name, s["timeline"]) for name, s in results["summary"].items() if s.get("timeline")]
    if tl_rows:
        lines += ["", "Async timeline (busy time as a share of request time; d = rounds the draft may expand "
                  "while the target verifies):"]
        lines += [f"- {name}: target busy {t['target_busy_pct']:.0f}%, draft busy {t['draft_busy_pct']:.0f}%, "
                  f"{t['overlap_rounds_per_pass']:.2f} expansion rounds during each verify, bonus in tree "
                  f"{100 * t['hit_rate']:.0f}% of passes, {t['reused_per_reroot']:.1f} K/V rows reused per re-root, "
                  f"d chosen (requests) {t['depth_chosen']}, collapse in {t['collapsed_requests']} request(s)"
                  for name, t in tl_rows]
    chk = results["check"]
    lines.append("")
    if not chk["checked"]:
        lines.append(f"Output check: {chk.get('note')}")
    else:
        peers = any(n.split("@")[0] in PEER_METHODS for n in results.get("config", {}).get("methods", ()))
        lines.append(f"Output check vs ar: {chk['mismatch_count']} mismatching request(s)"
                     + (f"; {chk['peer_mismatch_count']} peer (hf) mismatch(es)." if peers else "."))
        if chk["first_divergence"]:
            lines.append(f"First divergence: {Divergence(**chk['first_divergence']).describe()}")
    if results.get("tau_by_nodes"):
        lines += ["", "| node budget N | tau |", "|---|---|"]
        lines += [f"| {n} | {t:.3f} |" for n, t in results["tau_by_nodes"].items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI
MAX_BOOTSTRAP = 100_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_decoding_arguments(p)
    _nodes_accepts_list(p)
    add_workload_arguments(p)
    p.add_argument("--methods", default="ar,chain,tree",
                   help=f"comma list of {', '.join(tandem_methods() + PEER_METHODS)} (tree@N: a node budget); "
                        "ar is always run")
    p.add_argument("--out", default="bench-out", help="output folder for results.json, results.md and plots")
    p.add_argument("--warmup", type=int, default=1, help="warm-up prompts (the longest ones) run before measuring")
    p.add_argument("--allow-mismatch", action="store_true", help="exit 0 even when a method's output differs from ar")
    p.add_argument("--bootstrap", type=int, default=2000,
                   help=f"bootstrap resamples for the speedup CI (1 to {MAX_BOOTSTRAP})")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--async-transport", default="auto",
                   help="transport of method async: auto | inline | streams | gloo | nccl")
    p.add_argument("--replay", default=None, metavar="TRACE",
                   help="acceptance replay: a results.json recorded with a real pair; time its methods at "
                        "--preset shapes with random weights (labelled simulated acceptance)")
    p.add_argument("--preset", default=None, help="with --replay: target shapes (llama3-8b, qwen2.5-7b, qwen3.5-4b, ...)")
    p.add_argument("--draft-preset", default=None, help="with --replay: draft shapes (default: the preset's usual draft; "
                   "eagle3-llama3.1-8b: an EAGLE-3 head of the published shape)")


def _nodes_accepts_list(p: argparse.ArgumentParser) -> None:
    # NOTE: the shared --nodes option is an int; bench also takes a comma list of budgets.
    for a in p._actions:
        if "--nodes" in a.option_strings:
            a.type = str
            a.help = "node budget N for tree; a comma list runs tree once per budget (tree@N)"


def tokenize_prompts(prompts: list[Prompt], tokenizer, max_prompt_tokens: int | None) -> tuple[list[list[int]], list[dict]]:
    ids_list, info = [], []
    for i, p in enumerate(prompts):
        ids = tokenizer.encode(p.text).ids
        n = len(ids)
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            ids = ids[-max_prompt_tokens:]
        ids_list.append(ids)
        info.append({"index": i, "id": p.id, "category": p.category, "prompt_tokens": len(ids),
                     "truncated_from": n if len(ids) < n else None})
    return ids_list, info


def check_common(args: argparse.Namespace) -> None:
    """The checks a real-pair run and an acceptance replay share (tandem.bench.command runs them)."""
    from tandem.bench.env import ensure_out_dir

    if not 1 <= args.bootstrap <= MAX_BOOTSTRAP:
        # NOTE: the resample index matrix is bootstrap x prompts int64s, built at once
        raise ConfigError(f"--bootstrap must be in [1, {MAX_BOOTSTRAP}] (got {args.bootstrap})")
    ensure_out_dir(args.out)


def run(args: argparse.Namespace) -> int:
    """`tandem bench` with a real pair (`--replay` runs tandem.bench.replay instead; see command.py)."""
    from tandem.runtime.async_decode import TRANSPORTS

    check_common(args)
    if args.preset is not None or args.draft_preset is not None:
        raise ConfigError("--preset/--draft-preset need --replay TRACE (random weights only make sense with "
                          "recorded acceptance)")
    budgets = parse_nodes(args.nodes)
    args.nodes = budgets[0]
    spec, sampling, gen = configs_from_args(args)
    if args.async_transport not in TRANSPORTS:
        raise ConfigError(f"unknown --async-transport {args.async_transport!r}; choose one of {', '.join(TRANSPORTS)}")
    names = parse_methods(args.methods, budgets)
    specs = method_specs(names, spec)
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0 (got {args.warmup})")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ConfigError(f"--max-prompt-tokens must be >= 1 (got {args.max_prompt_tokens})")
    prompts = load_workload(args.workload, args.num_prompts, args.data_dir, args.source_lines)
    results = run_bench(prompts, specs, sampling, gen, target=args.target, draft=args.draft, device=args.device,
                        dtype=args.dtype, warmup=args.warmup, max_prompt_tokens=args.max_prompt_tokens,
                        n_boot=args.bootstrap, async_transport=args.async_transport, config_extra={
                            "workload": args.workload, "num_prompts": len(prompts), "k": spec.k, "nodes": budgets,
                            "width": spec.width, "depth": spec.depth, "methods": names})
    out = Path(args.out)
    written = write_outputs(results, out, plots=not args.no_plots)
    print(markdown_table(results), end="")
    print(f"tandem bench: wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    chk = results["check"]
    if chk["mismatch_count"]:
        print(f"tandem bench: OUTPUT MISMATCH: {chk['mismatch_count']} request(s) differ from ar; first: "
              f"{Divergence(**chk['first_divergence']).describe()}", file=sys.stderr)
        return 0 if args.allow_mismatch else 1
    return 0


def run_bench(prompts: list[Prompt], specs: list[MethodSpec], sampling: SamplingConfig, gen: GenerationConfig, *,
              target=None, draft=None, device="cpu", dtype="float32", warmup: int = 1,
              max_prompt_tokens: int | None = None, n_boot: int = 2000, seed: int = 0,
              config_extra: dict | None = None, progress: bool = True, async_transport: str = "auto") -> dict:
    """Load the pair, run every method on every prompt (interleaved), check and summarise."""
    import torch
    from tqdm import tqdm

    from tandem.bench.env import environment
    from tandem.runtime.generate import Generator
    from tandem.runtime.pair import load_pair

    need_draft = any(s.method not in ("ar", "hf") for s in specs)
    pair = load_pair(target, draft, device, dtype, need_draft=need_draft)
    dev = pair.target.device
    engine = Generator(pair.target, pair.draft, pair.tokenizer)
    ctx = engine.context_window
    for note in sorted({n for ms in specs if not ms.is_peer for n in ms.spec.capped(ctx)[1]}):
        notice(note)
    ids_list, prompt_info = tokenize_prompts(prompts, pair.tokenizer, max_prompt_tokens)
    for i, ids in enumerate(ids_list):
        if not ids:
            raise ConfigError(f"prompt {i} ({prompts[i].id}) tokenizes to nothing")
        if len(ids) >= ctx:
            raise ConfigError(f"prompt {i} is {len(ids)} tokens but the context window is {ctx}; "
                              f"pass --max-prompt-tokens {max(1, ctx - gen.max_new_tokens - 1)}")
    runners: dict[str, Runner] = {}
    hf_models: dict[str, object] = {}
    for ms in specs:
        if ms.is_peer:
            runners[ms.name] = HFRunner(ms, pair.target_dir, pair.draft_dir, dev, dtype, sampling, gen, ctx, hf_models)
        else:
            runners[ms.name] = TandemRunner(engine, ms, sampling, gen, async_transport)

    # Warm-up on the longest prompts: the first round sizes the shared KV caches for good (a
    # runner is rebuilt only when a request needs more rows), then every graph is captured on
    # those final runners, so no capture lands in a measurement; CUDA gets a second warm round.
    longest = sorted(range(len(ids_list)), key=lambda i: -len(ids_list[i]))[:warmup]
    with torch.inference_mode():
        for rnd in range(2 if dev.type == "cuda" and warmup else 1 if warmup else 0):
            for i in longest:
                for ms in specs:
                    runners[ms.name](i, ids_list[i])
            # NOTE: Generator keeps its runners in `_runners`; capture every graph up front.
            for r in engine._runners.values():
                precapture_graphs(r)
        if warmup and hasattr(engine, "auto"):
            engine.auto.reset()  # auto's trials run on the workload, not on the warm-up's longest prompts

        by_method: dict[str, list[Request]] = {ms.name: [] for ms in specs}
        bar = tqdm(total=len(ids_list) * len(specs), desc="bench", unit="req", disable=not progress,
                   file=sys.stderr, dynamic_ncols=True)
        for i, ids in enumerate(ids_list):
            # Rotate the method order per prompt (A B C, B C A, ...) so no method always runs first.
            order = specs[i % len(specs):] + specs[:i % len(specs)]
            for ms in order:
                bar.set_postfix_str(ms.name)
                by_method[ms.name].append(runners[ms.name](i, ids))
                bar.update(1)
        bar.close()

    peers = {ms.name for ms in specs if ms.is_peer}
    check = check_outputs({n: [r.token_ids for r in reqs] for n, reqs in by_method.items()}, peers, sampling.greedy)
    summary = {n: summarize_method(reqs) for n, reqs in by_method.items()}
    speed = {"metric": "decode_tokens_per_s", "vs_ar": speedups(by_method, REFERENCE, seed, n_boot)}
    if "hf" in by_method:
        speed["vs_hf"] = speedups(by_method, "hf", seed, n_boot)
    tau_by_nodes = {ms.spec.nodes: summary[ms.name]["tau"] for ms in specs
                    if ms.method == "tree" and ms.kind == "tandem" and summary[ms.name]["tau"] is not None}
    config = {"methods": [ms.name for ms in specs], "max_new_tokens": gen.max_new_tokens,
              "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed,
              "ignore_eos": gen.ignore_eos, "target": str(pair.target_dir),
              "draft": None if pair.draft_dir is None else str(pair.draft_dir), "device": str(dev), "dtype": dtype,
              "warmup": warmup, "max_prompt_tokens": max_prompt_tokens, "context_window": ctx,
              "method_specs": {ms.name: asdict(ms.spec) for ms in specs if not ms.is_peer},
              "bootstrap": {"resamples": n_boot, "seed": seed, "level": 0.95}}
    config.update(config_extra or {})
    config.setdefault("num_prompts", len(prompts))
    config.setdefault("workload", "custom")
    return {
        "environment": environment(dev),
        "config": config,
        "prompts": prompt_info,
        "requests": [r.to_dict() for reqs in by_method.values() for r in reqs],
        "summary": summary,
        "speedup": speed,
        "check": check,
        "tau_by_nodes": {str(n): t for n, t in sorted(tau_by_nodes.items())} if len(tau_by_nodes) > 1 else {},
    }


def precapture_graphs(runner) -> None:
    """Capture a runner's CUDA graphs for every row bucket (and attention-width bucket) now,
    so that no capture lands inside a measured request. No effect without graphs."""
    import inspect

    if not getattr(runner, "use_graphs", False):
        return
    if "widths" in inspect.signature(runner.warmup).parameters:
        # The runner keys graphs by (row bucket, attention width); widths are powers of two
        # from 256, capped at the cache capacity (+1 scratch row).
        cap = runner.capacity + 1
        widths = sorted({min(cap, 256 << i) for i in range(24) if (256 << i) >> 1 < cap})
        runner.warmup(runner.buckets, widths=tuple(widths))
    else:
        runner.warmup(runner.buckets)


def write_outputs(results: dict, out: Path, plots: bool = True) -> list[Path]:
    """results.json, results.md and (unless plots=False) the PNGs; returns the paths written."""
    from tandem.bench import plots as P
    from tandem.bench.env import write_json

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.md"]
    if plots and P.available():
        by: dict[str, list[dict]] = {}
        for r in results["requests"]:
            by.setdefault(r["method"], []).append(r)
        written.append(P.tokens_per_s_cdf({m: [r["decode_tokens_per_s"] for r in rs] for m, rs in by.items()},
                                          out / "tokens_per_s_cdf.png"))
        written.append(P.accept_length_hist({m: [a for r in rs for a in r["accept_lengths"]]
                                             for m, rs in by.items() if m != REFERENCE and rs[0]["target_passes"]},
                                            out / "accept_length_hist.png"))
        if results.get("tau_by_nodes"):
            written.append(P.tau_vs_nodes({int(n): t for n, t in results["tau_by_nodes"].items()},
                                          out / "tau_vs_nodes.png"))
    results["files"] = [p.name for p in written]
    write_json(out / "results.json", results)
    (out / "results.md").write_text(markdown_table(results))
    return written
