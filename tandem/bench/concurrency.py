"""`tandem bench --concurrency 1,8,16,32,64`: offline throughput and per-request latency of the
batched engine (tandem.engine) by concurrency, beside transformers on the same model.

    prompts  = load_workload(...)                           # tokenized, truncated from the left
    refs     = each prompt alone through the engine, method ar (greedy: the reference output)
    for each method (ar, chain, tree) and each concurrency C:
        warm up on a throwaway engine, then a fresh engine gets C requests (prompts cycled) at once
        -> tok/s (all new tokens / wall seconds), TTFT, inter-token, end to end per request
    peers (--peers): transformers' continuous batching `generate_batch` (when this transformers
        has it) and its padded batched `generate`, the same C prompts, greedy
    check every output against its prompt's solo ar output; write results.json / results.md / PNG

Per-request latency, measured from the moment all C requests are submitted: TTFT = first new
token; end to end = last new token; inter-token = (end to end - TTFT) / (new tokens - 1), the
mean gap after the first token (speculation emits tokens in bursts; this is their average). The
engine is timed after each step (a step ends on a host read of the verified tokens, so no extra
sync is needed); padded `generate` gives every row the batch's times; `generate_batch` reports
each request's token timestamps, counted from when its manager starts serving (its setup, a
manager thread sizing its cache and capturing graphs, is left out as the engine's construction is).

Exit status: 0; 1 when an engine output differs from the solo ar output (unless
--allow-mismatch). Peer differences are reported as peer mismatches only.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tandem.bench import harness
from tandem.bench.workloads import load_workload
from tandem.cli import configs_from_args
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig

ENGINE_METHODS = ("ar", "chain", "tree")
PEERS = ("generate_batch", "generate")  # transformers: continuous batching, padded batched generate
REFERENCE = "ar"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default=None, metavar="C1,C2,...",
                   help="batched-engine mode: requests decoded together, a comma list (e.g. 1,8,16,32,64); "
                        "offline tok/s and TTFT / inter-token / end-to-end latency per method")
    p.add_argument("--batch-parallel", action="store_true",
                   help="with --concurrency: also run each speculative method in batch-parallel mode (MineDraft: "
                        "two batches alternate drafting and verifying), as METHOD+bp")
    p.add_argument("--deterministic", action="store_true",
                   help="with --concurrency: also run each method in batch-invariant mode, as METHOD+det (a "
                        "request's greedy output does not depend on its batch or on speculation)")
    p.add_argument("--row-selection", action="store_true",
                   help="with --concurrency: also run each speculative method with batch-aware row selection "
                        "(one node budget per step), as METHOD+sel, or METHOD+bp+sel with --batch-parallel")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="with --concurrency: transformers peers run on the same prompts, a comma list of "
                        f"{', '.join(PEERS)} (or 'none')")


# ---------------------------------------------------------------------------------------------
# Records
@dataclass(frozen=True)
class Timed:
    """One request of one run: its output and latencies (seconds from submission)."""

    index: int  # within the run (0..C-1)
    prompt_index: int
    token_ids: list[int]
    ttft: float
    e2e: float

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency after the first token (None with fewer than two tokens)."""
        n = len(self.token_ids)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


@dataclass
class RunResult:
    """One (method or peer, concurrency) run."""

    name: str
    concurrency: int
    peer: bool
    seconds: float = 0.0
    requests: list[Timed] | None = None
    steps: int | None = None  # engine steps (one target pass each); None for peers
    tau: float | None = None  # tokens per verify pass over the run (engine)
    cached_tokens: int | None = None  # prompt tokens served by the engine's prefix cache
    preemptions: int | None = None  # engine: requests preempted (0 expected: the pool holds them all)
    skipped: str | None = None  # why a peer did not run
    call_seconds: float | None = None  # generate_batch: the whole call, manager setup included
    step_ms: float | None = None  # engine: mean wall ms of a step
    drafting_ms: float | None = None  # engine: of it, mean ms drafting (the drafts' read-back included)
    drafted_steps: int | None = None  # engine: steps that drafted (the draft gate turns it off in others)
    drafted_step_ms: float | None = None  # engine: mean wall ms of those steps
    plain_step_ms: float | None = None  # engine: mean wall ms of the others (prefill-only steps included)
    undrafted: int | None = None  # engine: of the others, steps that verified decodes (not prefill alone)
    empty: int | None = None  # engine: steps whose target pass had no rows (nothing planned)
    step_costs: object = None  # engine with a draft gate: its measured StepCosts (handed to the next engine)
    gate: str | None = None  # engine with a draft gate: what it learned and decided, in words
    gate_trace: list | None = None  # engine with a draft gate: its steps, runs alike (DraftGate.trace)

    @property
    def new_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests or [])

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.seconds if self.requests and self.seconds > 0 else None

    def to_dict(self) -> dict:
        from tandem.bench.stats import summarize

        reqs = self.requests or []
        return {"name": self.name, "concurrency": self.concurrency, "peer": self.peer, "skipped": self.skipped,
                "seconds": self.seconds, "new_tokens": self.new_tokens, "tokens_per_s": self.tokens_per_s,
                "call_seconds": self.call_seconds, "steps": self.steps, "tau": self.tau,
                "cached_tokens": self.cached_tokens, "preemptions": self.preemptions,
                "step_ms": self.step_ms, "drafting_ms": self.drafting_ms, "drafted_steps": self.drafted_steps,
                "drafted_step_ms": self.drafted_step_ms, "plain_step_ms": self.plain_step_ms,
                "undrafted": self.undrafted, "empty": self.empty, "gate": self.gate, "gate_trace": self.gate_trace,
                "ttft_s": summarize([r.ttft for r in reqs]).to_dict(),
                "itl_s": summarize([r.itl for r in reqs if r.itl is not None]).to_dict(),
                "e2e_s": summarize([r.e2e for r in reqs]).to_dict(),
                "requests": [{**asdict(r), "itl": r.itl} for r in reqs]}


# ---------------------------------------------------------------------------------------------
# Parsing
def parse_concurrency(text: str) -> list[int]:
    """`1,8,16` -> [1, 8, 16]; every value a positive integer."""
    vals = []
    for t in [t.strip() for t in text.split(",")]:
        try:
            v = int(t)
        except ValueError:
            raise ConfigError(f"--concurrency takes a comma list of positive integers (got {text!r})") from None
        if v < 1:
            raise ConfigError(f"--concurrency values must be >= 1 (got {v} in {text!r})")
        vals.append(v)
    return list(dict.fromkeys(vals))


# METHOD+bp, METHOD+sel, METHOD+bp+sel; METHOD+det (any method: batch-invariant arithmetic);
# METHOD+seq (chain / tree: each request drafted on its own, the A/B of batched drafting)
MODES = {"bp": "batch_parallel", "sel": "row_selection", "det": "deterministic"}
# modes that turn an on-by-default switch off (`+host`: trees read back and verified on the host,
# the A/B of verifying on the device; `+sync`: each step drafts its trees at its start, the A/B
# of drafting the next step's trees while the host keeps books; `+feed`: the EAGLE-3 head is fed
# the accepts after the host reads them, the A/B of running them on the device before the read;
# for `ar`, `+sync` turns async scheduling off: each step reads its tokens before the next plans)
OFF_MODES = {"seq": ("batched_drafting",), "host": ("device_verify",), "sync": ("draft_ahead", "async_scheduling"),
             "feed": ("device_context",)}
ON_MODES = {"gate": "draft_gate", "adapt": "adaptive_draft"}  # switches turned on (else left at their default)


def parse_engine_methods(text: str, batch_parallel: bool = False, row_selection: bool = False,
                         deterministic: bool = False) -> list[str]:
    """Engine runs: a method (ar, chain, tree), optionally with engine modes (`tree+bp`,
    `tree+sel`, `tree+bp+sel`, `ar+det`, ...); the flags add those variants of every speculative
    method (`--deterministic`: of every method)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    for n in names:
        base, *mods = n.split("+")
        if base not in ENGINE_METHODS:
            raise ConfigError(f"--concurrency runs the engine methods {', '.join(ENGINE_METHODS)} (got {n!r}); "
                              "transformers peers come from --peers")
        bad = [m for m in mods if m not in MODES and m not in OFF_MODES and m not in ON_MODES]
        if bad or len(set(mods)) != len(mods):
            raise ConfigError(f"unknown engine mode in {n!r}; modes are +bp (batch parallel), +sel (row selection), "
                              "+det (deterministic), +seq (per-request drafting), +host (trees verified on the host), +sync (no drafting ahead; for ar: no async scheduling), +feed (the head fed after the read), +gate (the "
                              "draft gate) and +adapt (per-request draft length)")
        if set(mods) - {"det", "sync"} and base == "ar":
            raise ConfigError(f"{n!r}: batch parallelism, row selection, per-request drafting, the draft gate and "
                              "the adaptive draft length need a speculative method (chain or tree)")
    if not names:
        raise ConfigError("--methods is empty; e.g. --methods ar,tree")
    extra = []
    for n in names:
        if n in ("chain", "tree"):
            if batch_parallel:
                extra.append(n + "+bp")
            if row_selection:
                extra.append(n + ("+bp+sel" if batch_parallel else "+sel"))
        if deterministic and "+" not in n:
            extra.append(n + "+det")
    if (batch_parallel or row_selection) and not any(n.split("+")[0] != "ar" for n in names):
        raise ConfigError("--batch-parallel / --row-selection need a speculative method in --methods (chain or tree)")
    return list(dict.fromkeys([REFERENCE] + names + extra))  # ar: the reference and the speed baseline


def engine_modes(label: str) -> tuple[str, dict[str, bool]]:
    """`tree+bp+sel` -> ("tree", {"batch_parallel": True, "row_selection": True, ...}); `tree+seq`
    -> batched_drafting False; `tree+gate` -> draft_gate True (drafting skipped where it does not pay)."""
    base, *mods = label.split("+")
    modes = {flag: key in mods for key, flag in MODES.items()}
    modes.update({flag: False for key, flags in OFF_MODES.items() if key in mods for flag in flags})
    modes.update({flag: True for key, flag in ON_MODES.items() if key in mods})
    if not modes.get("draft_gate") and not modes.get("row_selection"):
        modes["draft_gate"] = False  # (`tree` drafts every step; the engine's GPU default gates it: `tree+gate`)
    return base, modes


def parse_peers(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise ConfigError(f"unknown peer {bad[0]!r} in --peers; choose from {', '.join(PEERS)} or 'none'")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------
# Runs
def _engine(pair, method: str, spec: SpecConfig, prompts: list[list[int]], params, num_batched: int,
            concurrency: int, **overrides):
    """A fresh engine for `concurrency` of these prompts at once, its pool holding every request
    whole (no preemption): sized for this workload rather than the default C full context
    windows, which at C=64 would hold tens of GB for nothing."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import Engine

    draft_rows = 1 + max(spec.k, spec.nodes)
    rows = max(num_batched, concurrency * draft_rows)
    block = EngineConfig().block_size
    per_request = -(-(max(map(len, prompts)) + params.max_tokens + draft_rows) // block)
    base, modes = engine_modes(method)
    cfg = EngineConfig(method=base, spec=replace(spec, method=base), max_num_seqs=concurrency,
                       max_num_batched_tokens=rows, num_blocks=concurrency * per_request, **{**modes, **overrides})
    return Engine(pair.target, pair.draft if base != "ar" else None, pair.tokenizer, cfg)


def solo_outputs(pair, spec: SpecConfig, prompts: list[list[int]], params, num_batched: int) -> list[list[int]]:
    """Each prompt alone through ONE ar engine, one after another: the reference outputs. (One
    engine, not one per prompt: on a GPU every engine captures its CUDA graphs when it starts.)
    No prefix cache, so every prompt is computed from scratch, as it would be alone."""
    engine = _engine(pair, "ar", spec, prompts, params, num_batched, 1, enable_prefix_caching=False)
    outs = []
    for p in prompts:
        req = engine.add_request(p, params)
        engine.run()
        outs.append(list(req.output_ids))
    return outs


def engine_run(pair, method: str, spec: SpecConfig, prompts: list[list[int]], prompt_index: list[int],
               params, num_batched: int, concurrency: int | None = None, **overrides) -> RunResult:
    """The prompts' requests submitted together to a fresh engine of `concurrency` sequences
    (default: one per prompt, one wave), stepped to the end; with more prompts than that the engine
    admits the next as one finishes (its FIFO queue), so at most `concurrency` are in flight and a
    request's TTFT includes its wait for a slot. Each step is timed.
    overrides: EngineConfig fields (a warm-up run's measured `step_costs`)."""
    c = concurrency or len(prompts)
    engine = _engine(pair, method, spec, prompts, params, num_batched, c, **overrides)
    if engine.gate is not None:
        engine.gate.trace = []
    harness._sync(pair.target.device)
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    first: list[float | None] = [None] * len(reqs)
    last = [t0] * len(reqs)
    seen = [0] * len(reqs)
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        for i, r in enumerate(reqs):
            n = len(r.output_ids)
            if n > seen[i]:
                seen[i], last[i] = n, now
                if first[i] is None:
                    first[i] = now
    seconds = time.perf_counter() - t0
    timed = [Timed(i, prompt_index[i], list(r.output_ids), (first[i] or last[i]) - t0, last[i] - t0)
             for i, r in enumerate(reqs)]
    passes = sum(r.figures.target_passes for r in reqs)
    k = engine.counters
    per_step = (lambda s: 1e3 * s / k.steps) if k.steps else (lambda s: None)
    # (from the counters' totals: `records` keeps the latest 4,096 steps only, and counting drafted
    # steps there made a 5,544-step run's 1,636 "others" look like steps that verified nothing)
    n_plain, plain_s = k.steps - k.drafted_steps, k.step_s - k.drafted_step_s
    return RunResult(method, c, False, seconds, timed, engine.steps,
                     sum(len(t.token_ids) for t in timed) / passes if passes else None,
                     sum(r.figures.cached_tokens for r in reqs), sum(r.figures.preemptions for r in reqs),
                     step_ms=per_step(k.step_s), drafting_ms=per_step(k.drafting_s), drafted_steps=k.drafted_steps,
                     drafted_step_ms=1e3 * k.drafted_step_s / k.drafted_steps if k.drafted_steps else None,
                     plain_step_ms=1e3 * plain_s / n_plain if n_plain else None,
                     undrafted=k.undrafted_steps, empty=k.empty_steps,
                     step_costs=engine.gate.costs if engine.gate is not None else None,
                     gate=gate_summary(engine.gate, c) if engine.gate is not None else None,
                     gate_trace=engine.gate.trace if engine.gate is not None else None)


def gate_summary(gate, c: int) -> str:
    """The draft gate's state after a run at concurrency C: what it learned and decided."""
    tp, td = gate.predicted(c)
    return (f"a {gate.accepted or 0:.2f}, plain x{gate.plain_scale:.2f} + {gate.plain.per_row * 1e6:.2f} us a "
            f"prefill row, drafting's extra x{gate.extra_scale:.2f}; predicted at {c}: plain {tp * 1e3:.3f} / "
            f"drafting {td * 1e3:.3f} ms; {gate.decisions_off} steps kept off, {gate.probes} probe steps"
            + (f"; measured: {gate.arms.summary()}" if gate.arms is not None else ""))


class _StepTimes:
    """A transformers streamer noting when each batched step's tokens arrive (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _eos_ids(gc) -> set[int]:
    e = gc.eos_token_id
    return set(e) if isinstance(e, list) else ({e} if e is not None else set())


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """A padded row ends at its first EOS (kept, as the engine keeps it); the rest is padding."""
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[:j + 1]
    return tokens


def padded_generate_run(model, prompts: list[list[int]], prompt_index: list[int], gc) -> RunResult:
    """transformers `generate` on the C prompts as one left-padded batch."""
    import torch

    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    pad = gc.pad_token_id
    x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)  # [C, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)  # [C, width]
    timer = _StepTimes()
    harness._sync(dev)
    t0 = time.perf_counter()
    with torch.inference_mode(), harness._quiet_transformers():
        out = model.generate(x, attention_mask=mask, generation_config=gc, streamer=timer)  # [C, width + new]
    harness._sync(dev)
    seconds = time.perf_counter() - t0
    ttft = (timer.times[1] if len(timer.times) > 1 else t0 + seconds) - t0
    eos = _eos_ids(gc)
    # NOTE: every row of a padded batch finishes when the batch does
    timed = [Timed(i, prompt_index[i], _cut_at_eos(out[i, width:].tolist(), eos), ttft, seconds)
             for i in range(len(prompts))]
    return RunResult("hf generate (padded)", len(prompts), True, seconds, timed)


def generate_batch_run(model, prompts: list[list[int]], prompt_index: list[int], gc) -> RunResult:
    """transformers continuous batching (`generate_batch`), timed by its own per-token timestamps.

    NOTE: the call first starts a manager thread that sizes its cache and captures graphs (about
    10 s on a CPU); the run is timed from the moment that manager begins serving (the earliest
    request's lifespan start, on the perf_counter clock) to the last token, so the setup is out
    of the figures as the engine's construction is. The whole call is kept as `call_seconds`.
    """
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode(), harness._quiet_transformers():
        outs = model.generate_batch(inputs=prompts, generation_config=gc, record_timestamps=True,
                                    progress_bar=False)
    harness._sync(next(model.parameters()).device)
    call = time.perf_counter() - t0
    ordered = list(outs.values())  # generate_batch returns them in input order
    if len(ordered) != len(prompts) or any(o.error for o in ordered):
        raise RuntimeError(f"generate_batch finished {sum(not o.error for o in ordered)} of {len(prompts)} requests")
    starts = [o.lifespan[0] for o in ordered if o.lifespan and o.lifespan[0] and o.lifespan[0] > 0]
    start = min(starts) if starts else t0
    timed = []
    for i, o in enumerate(ordered):
        ts = list(o.timestamps or [])
        toks = list(o.generated_tokens)
        end = ts[-1] if ts else t0 + call
        timed.append(Timed(i, prompt_index[i], toks, (ts[0] if ts else end) - start, end - start))
    seconds = max(t.e2e for t in timed)
    return RunResult("hf generate_batch", len(prompts), True, seconds, timed, call_seconds=call)


# ---------------------------------------------------------------------------------------------
# Checking and tables
def check(runs: list[RunResult], refs: list[list[int]], greedy: bool) -> dict:
    """Each run's outputs against its prompts' solo ar outputs: counts and the first divergence."""
    report: dict = {"checked": greedy, "reference": "solo ar (engine, concurrency 1)", "mismatch_count": 0,
                    "peer_mismatch_count": 0, "runs": {}, "first_divergence": None}
    if not greedy:
        report["note"] = "sampling (--temperature > 0): outputs legitimately differ, not checked"
        return report
    for run in runs:
        if run.requests is None:
            continue
        divs = []
        for r in run.requests:
            d = harness.first_divergence(refs[r.prompt_index], r.token_ids)
            if d is not None:
                divs.append({"request": r.index, "prompt_index": r.prompt_index, "position": d[0],
                             "expected": d[1], "got": d[2]})
        key = f"{run.name}@{run.concurrency}"
        report["runs"][key] = {"mismatches": len(divs), "of": len(run.requests), "first": divs[0] if divs else None}
        report["peer_mismatch_count" if run.peer else "mismatch_count"] += len(divs)
        if divs and not run.peer and report["first_divergence"] is None:
            report["first_divergence"] = {"run": key, **divs[0]}
    return report


def markdown(results: dict) -> str:
    def f(x, scale=1.0, nd=1):
        return "-" if x is None else f"{x * scale:.{nd}f}"

    cfg, env = results["config"], results["environment"]
    lines = [f"# tandem bench --concurrency: {cfg['workload']}, {cfg['num_prompts']} distinct prompts (cycled), "
             f"{cfg['max_new_tokens']} new tokens", "",
             f"{env['gpu']}, {cfg['dtype']}, torch {env['torch']}, transformers {env['transformers']}, "
             f"commit {env['git_commit']}", "",
             ("Latency in ms from submission of all C requests: median / p95." if not cfg.get("requests") else
              f"{cfg['requests']} requests per level (at least C), at most C in flight, the next admitted as one "
              "finishes; latency in ms from submission of all of them (TTFT includes the wait for a slot): "
              "median / p95." + (" The transformers rows run one wave of C requests (the first C prompts), "
                                 "not these requests: their tok/s is over other work." if cfg.get("peers") else "")),
             "",
             "| method | C | tok/s | vs ar | TTFT | inter-token | end to end | tau | steps | equal to solo ar |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ar = {r["concurrency"]: r["tokens_per_s"] for r in results["runs"] if r["name"] == REFERENCE}
    runs_chk = results["check"].get("runs", {})
    for r in results["runs"]:
        if r["skipped"]:
            continue
        chk = runs_chk.get(f"{r['name']}@{r['concurrency']}")
        eq = "-" if chk is None else f"{chk['of'] - chk['mismatches']}/{chk['of']}"
        base = ar.get(r["concurrency"])
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base and r["tokens_per_s"] else "-"

        def lat(s):
            return f"{f(s['median'], 1e3)} / {f(s['p95'], 1e3)}"

        lines.append(f"| {r['name']} | {r['concurrency']} | {f(r['tokens_per_s'])} | {vs} | {lat(r['ttft_s'])} | "
                     f"{lat(r['itl_s'])} | {lat(r['e2e_s'])} | {f(r['tau'], nd=2)} | {r['steps'] or '-'} | {eq} |")
    timed = [r for r in results["runs"] if not r["skipped"] and r.get("step_ms") is not None]
    if timed:
        lines += ["", "Engine step, mean wall ms (a step ends on the host's read of its tokens): whole step / "
                      "of it drafting:"]
        lines += [f"- {r['name']} C={r['concurrency']}: {f(r['step_ms'], nd=3)} / {f(r['drafting_ms'], nd=3)}"
                  + (f"; {r['drafted_steps']} of {r['steps']} steps drafted ({f(r['drafted_step_ms'], nd=3)} ms "
                     f"each), the others {f(r['plain_step_ms'], nd=3)} ms"
                     + (f" ({r['undrafted']} of them verified decodes, {r.get('empty') or 0} had no rows)"
                        if r.get("undrafted") is not None else "")
                     if r.get("drafted_steps") else "")
                  + (f"; gate: {r['gate']}" if r.get("gate") else "")
                  for r in timed]
    for name, why in results["peers_skipped"].items():
        lines += ["", f"Peer {name} skipped: {why}"]
    chk = results["check"]
    lines.append("")
    if not chk["checked"]:
        lines.append(f"Output check: {chk['note']}")
    else:
        lines.append(f"Output check vs solo ar: {chk['mismatch_count']} mismatching engine request(s); "
                     f"{chk['peer_mismatch_count']} peer (transformers) mismatch(es).")
        if chk["first_divergence"]:
            d = chk["first_divergence"]
            lines.append(f"First divergence: {d['run']} request {d['request']} (prompt {d['prompt_index']}) at new "
                         f"token {d['position']}: expected {d['expected']}, got {d['got']}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path | None:
    """tok/s vs concurrency, one line per method and peer; None when matplotlib is missing."""
    from tandem.bench import plots as P

    if not P.available():
        return None
    plt = P._plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by: dict[str, list[tuple[int, float]]] = {}
    for r in results["runs"]:
        if r["tokens_per_s"]:
            by.setdefault(r["name"], []).append((r["concurrency"], r["tokens_per_s"]))
    for name, pts in by.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests decoded together)")
    ax.set_ylabel("tokens/s (all requests)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Offline throughput by concurrency")
    return P._save(fig, path)


# ---------------------------------------------------------------------------------------------
# Entry point
def run(args: argparse.Namespace) -> int:
    """`tandem bench --concurrency ...` (tandem.bench.command dispatches here)."""
    from tandem.bench.env import ensure_out_dir

    levels = parse_concurrency(args.concurrency)
    methods = parse_engine_methods(args.methods, args.batch_parallel, args.row_selection, args.deterministic)
    peers = parse_peers(args.peers)
    if args.replay is not None or args.preset is not None or args.draft_preset is not None:
        raise ConfigError("--concurrency measures the real pair; it does not take --replay / --preset")
    budgets = harness.parse_nodes(args.nodes)
    if len(budgets) > 1:
        raise ConfigError(f"--concurrency takes one --nodes budget (got {args.nodes!r})")
    args.nodes = budgets[0]
    spec, sampling, gen = configs_from_args(args)
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0 (got {args.warmup})")
    if getattr(args, "requests", None) is not None and args.requests < 1:
        raise ConfigError(f"--requests must be >= 1 (got {args.requests})")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ConfigError(f"--max-prompt-tokens must be >= 1 (got {args.max_prompt_tokens})")
    ensure_out_dir(args.out)
    prompts = load_workload(args.workload, args.num_prompts, args.data_dir, args.source_lines)
    results = run_concurrency(prompts, methods, peers, levels, spec, sampling, gen, args)
    out = Path(args.out)
    written = write(results, out, plots=not args.no_plots)
    print(markdown(results), end="")
    print(f"tandem bench: wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    chk = results["check"]
    if chk["mismatch_count"]:
        d = chk["first_divergence"]
        print(f"tandem bench: OUTPUT MISMATCH: {chk['mismatch_count']} engine request(s) differ from solo ar; "
              f"first: {d['run']} request {d['request']} at new token {d['position']}", file=sys.stderr)
        return 0 if args.allow_mismatch else 1
    return 0


def run_concurrency(prompts, methods: list[str], peers: list[str], levels: list[int], spec: SpecConfig,
                    sampling: SamplingConfig, gen: GenerationConfig, args: argparse.Namespace) -> dict:
    import torch

    from tandem.bench.env import environment
    from tandem.engine.request import SamplingParams
    from tandem.runtime.pair import load_pair

    pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=methods != [REFERENCE])
    dev = pair.target.device
    ids_list, prompt_info = harness.tokenize_prompts(prompts, pair.tokenizer, args.max_prompt_tokens)
    if any(not ids for ids in ids_list):
        raise ConfigError("a prompt tokenizes to nothing")
    params = SamplingParams(max_tokens=gen.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                            seed=sampling.seed, ignore_eos=gen.ignore_eos)
    num_batched = 2048  # EngineConfig's default row budget, raised to hold every request's tree
    requests = getattr(args, "requests", None)  # per level (None: C, one wave)

    def batch(c: int) -> tuple[list[list[int]], list[int]]:
        idx = [i % len(ids_list) for i in range(c)]
        return [ids_list[i] for i in idx], idx

    runs: list[RunResult] = []
    skipped: dict[str, str] = {}
    with torch.inference_mode():
        # the reference: each distinct prompt alone, greedy ar
        refs = solo_outputs(pair, spec, ids_list, params, num_batched)
        # each level's methods back to back (the device host's speed drifted up to 1.4x between
        # runs minutes apart, H200 2026-12-03: a ratio to `ar` is only as good as its pairing);
        # the table lists them by method
        for c in levels:
            for method in methods:
                mspec = replace(spec, method=engine_modes(method)[0])
                ps, idx = batch(max(c, requests or c))  # (--requests: more prompts than slots, C at a time)
                given = {}
                if args.warmup:  # a throwaway engine: kernels compiled, allocator warm, prefix cache cold
                    warm = engine_run(pair, method, mspec, ps, idx, params, num_batched, c)
                    if warm.step_costs is not None:  # (the gate's costs, measured once per run)
                        given["step_costs"] = warm.step_costs
                r = engine_run(pair, method, mspec, ps, idx, params, num_batched, c, **given)
                runs.append(r)
                _progress(r)
        runs.sort(key=lambda r: methods.index(r.name))  # (stable: levels in order within a method)
    if peers:
        hf = None
        try:
            hf = harness.load_hf_model(pair.target_dir, dev, args.dtype)
        except Exception as e:  # noqa: BLE001 - a peer that cannot load is skipped, with the reason
            for name in peers:
                skipped[name] = f"transformers cannot load {pair.target_dir}: {str(e).splitlines()[0]}"
        if hf is not None:
            runs += peer_runs(hf, peers, levels, batch, gen, sampling, args.warmup, skipped)
        del hf
    for name, why in skipped.items():
        print(f"tandem bench: peer {name} skipped: {why}", file=sys.stderr)
    chk = check(runs, refs, sampling.greedy)
    config = {"methods": methods, "peers": peers, "concurrency": levels, "requests": requests,
              "max_new_tokens": gen.max_new_tokens,
              "temperature": sampling.temperature, "ignore_eos": gen.ignore_eos, "target": str(pair.target_dir),
              "draft": None if pair.draft_dir is None else str(pair.draft_dir), "device": str(dev),
              "dtype": args.dtype, "warmup": args.warmup, "workload": args.workload, "num_prompts": len(prompts),
              "max_prompt_tokens": args.max_prompt_tokens, "spec": asdict(spec)}
    return {"environment": environment(dev), "config": config, "prompts": prompt_info,
            "reference_outputs": refs, "runs": [r.to_dict() for r in runs], "peers_skipped": skipped,
            "check": chk}


def peer_runs(hf, peers: list[str], levels: list[int], batch, gen: GenerationConfig, sampling: SamplingConfig,
              warmup: int, skipped: dict[str, str]) -> list[RunResult]:
    runs: list[RunResult] = []
    if not sampling.greedy:
        for name in peers:
            skipped[name] = "peers run greedy only (--temperature > 0)"
        return runs
    fns = {"generate": padded_generate_run, "generate_batch": generate_batch_run}
    if "generate_batch" in peers and not hasattr(hf, "generate_batch"):
        import transformers

        skipped["generate_batch"] = (f"transformers {transformers.__version__} has no generate_batch "
                                     "(continuous batching)")
    for name in peers:
        if name in skipped:
            continue
        gc = harness._hf_generation_config(hf, gen, sampling, gen.max_new_tokens)
        try:
            for c in levels:
                ps, idx = batch(c)
                if warmup:
                    fns[name](hf, ps, idx, gc)
                r = fns[name](hf, ps, idx, gc)
                runs.append(r)
                _progress(r)
        except Exception as e:  # noqa: BLE001 - a failing peer must not lose the engine's results
            skipped[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return runs


def _progress(r: RunResult) -> None:
    print(f"tandem bench: {r.name} C={r.concurrency}: {r.tokens_per_s or 0:.1f} tok/s", file=sys.stderr, flush=True)


def write(results: dict, out: Path, plots: bool = True) -> list[Path]:
    """results.json, results.md and (matplotlib present, plots on) tokens_per_s_vs_concurrency.png."""
    from tandem.bench.env import write_json

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.md"]
    traces = {f"{r['name']} C={r['concurrency']}": t for r in results["runs"]
              if (t := r.pop("gate_trace", None))}
    if traces:  # (the gate's step-by-step view, apart: long, and read only to see why a gate run went as it did)
        write_json(out / "gate_trace.json", {"columns": ["R", "regime", "steps", "seconds", "tokens", "counted",
                                                         "dormant"], "runs": traces})
        written.append(out / "gate_trace.json")
    if plots:
        png = plot(results, out / "tokens_per_s_vs_concurrency.png")
        if png is not None:
            written.append(png)
    results["files"] = [p.name for p in written]
    write_json(out / "results.json", results)
    (out / "results.md").write_text(markdown(results))
    return written
