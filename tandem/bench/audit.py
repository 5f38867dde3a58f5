"""`tandem audit`: SpecPilot-style token forcing, an output-level check that a method is lossless.

The method's greedy output (and `ar`'s, as the control) is teacher-forced through the target
in one causal pass, with the LM head computed in fp32 (`hidden_states` in the model dtype,
then `F.linear` in fp32): the *scorer*. At every new token:

- **mismatch**: the token is not the scorer's argmax;
- **margin**: logp(argmax) - logp(token) >= 0 under the scorer.

`ar` shows how far the engine's own numerics stray from the scorer (low-precision near-ties):
**delta** = the largest margin among ar's mismatches, rounded UP to a multiple of 1/8 (1/8 when
ar has none). A **large event** is a mismatch with margin >= 2 * delta: more than numerics
explains. The audit fails (exit 1) when the method's mismatch rate exceeds ar's by more than
0.5 percentage points, or it has more large events than ar.

Test hook: `run_audit(..., fault_bias=(token_id, value))` adds `value` to one vocabulary logit
of the target's forward pass *during the method's generation only* (a deliberately faulty
verifier); the audit must catch it. A fresh engine is built for that run so that, on CUDA, its
graphs are captured with the fault in place.
"""
from __future__ import annotations

import argparse
import math
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.bench.workloads import add_workload_arguments, load_workload
from tandem.cli import add_decoding_arguments, add_model_arguments, configs_from_args, notice
from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig

RATE_TOLERANCE_PP = 0.5
DELTA_QUANTUM = 1 / 8
MAX_EVENTS_KEPT = 50


@dataclass(frozen=True)
class Event:
    prompt_index: int
    position: int  # index into the new tokens
    token: int
    argmax: int
    margin: float  # logp(argmax) - logp(token) under the fp32-head scorer


@dataclass
class Scored:
    """Token-forcing result of one method over the whole workload."""

    name: str
    tokens: int = 0
    events: list[Event] = field(default_factory=list)  # every mismatch

    @property
    def mismatches(self) -> int:
        return len(self.events)

    @property
    def rate(self) -> float:
        return self.mismatches / self.tokens if self.tokens else 0.0

    @property
    def max_margin(self) -> float | None:
        return max((e.margin for e in self.events), default=None)

    def large(self, delta: float) -> list[Event]:
        return [e for e in self.events if e.margin >= 2 * delta]

    def to_dict(self, delta: float) -> dict:
        big = self.large(delta)
        return {"name": self.name, "tokens": self.tokens, "mismatches": self.mismatches, "mismatch_rate": self.rate,
                "large_events": len(big), "max_margin": self.max_margin,
                "events": [asdict(e) for e in sorted(self.events, key=lambda e: -e.margin)[:MAX_EVENTS_KEPT]]}


def score_output(model, prompt_ids: list[int], new_ids: list[int], prompt_index: int = 0) -> list[Event]:
    """Teacher-force prompt + new tokens through `model`; the mismatches of the new tokens."""
    import torch
    import torch.nn.functional as F

    if not new_ids:
        return []
    ids = torch.tensor([prompt_ids + new_ids], device=model.device)  # [1, P + n]
    with torch.inference_mode():
        hidden = model.hidden_states(ids)[0, len(prompt_ids) - 1: len(prompt_ids) - 1 + len(new_ids)]  # [n, hidden]
        logits = F.linear(hidden.float(), model.lm_head.weight.float())  # [n, vocab] fp32 LM head
        logp = torch.log_softmax(logits, dim=-1)
        tok = torch.tensor(new_ids, device=model.device)
        best = logp.argmax(-1)  # [n]
        margin = logp.gather(1, best[:, None])[:, 0] - logp.gather(1, tok[:, None])[:, 0]  # [n]
        bad = (best != tok).nonzero()[:, 0].tolist()
        best_l, margin_l = best.tolist(), margin.tolist()
    return [Event(prompt_index, j, new_ids[j], best_l[j], float(margin_l[j])) for j in bad]


def compute_delta(ar: Scored) -> float:
    """Largest margin among ar's mismatches rounded UP to a multiple of 1/8 (1/8 when none)."""
    m = ar.max_margin
    if m is None:
        return DELTA_QUANTUM
    return max(DELTA_QUANTUM, math.ceil(m / DELTA_QUANTUM - 1e-9) * DELTA_QUANTUM)


@contextmanager
def biased_logits(model, token_id: int, value: float):
    """Test hook: every forward of `model` returns logits with `value` added at `token_id`."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)  # [B, T, vocab]
        bias = out.new_zeros(out.shape[-1])
        bias[token_id] = value
        return out + bias

    model.forward = forward
    try:
        yield
    finally:
        del model.forward  # back to the class's forward


def run_audit(prompt_ids: list[list[int]], method: str, spec: SpecConfig, gen: GenerationConfig, pair, *,
              fault_bias: tuple[int, float] | None = None, rate_tolerance_pp: float = RATE_TOLERANCE_PP,
              progress: bool = False) -> dict:
    """Generate with `ar` and `method` (greedy) on every prompt, token-force both, and judge.

    `pair` is a loaded `tandem.runtime.pair.Pair` (target + draft). `fault_bias=(token_id, value)`
    is the documented test hook described in the module docstring.
    """
    from tqdm import tqdm

    from tandem.runtime.generate import Generator

    if method not in ("chain", "tree", "async", "tlv"):
        raise ConfigError(f"--method must be chain, tree, async or tlv (got {method!r})")
    sampling = SamplingConfig()  # token forcing audits greedy decoding
    spec = SpecConfig(**{**asdict(spec), "method": method})
    engine = Generator(pair.target, pair.draft, pair.tokenizer)
    faulty = Generator(pair.target, pair.draft, pair.tokenizer) if fault_bias is not None else engine
    ar, me = Scored("ar"), Scored(method)
    outputs = []
    for i, ids in enumerate(tqdm(prompt_ids, desc=f"audit {method}", disable=not progress, file=sys.stderr)):
        a = engine.generate(ids, "ar", spec, sampling, gen).token_ids
        if fault_bias is not None:
            with biased_logits(pair.target, int(fault_bias[0]), float(fault_bias[1])):
                m = faulty.generate(ids, method, spec, sampling, gen).token_ids
        else:
            m = engine.generate(ids, method, spec, sampling, gen).token_ids
        for scored, out in ((ar, a), (me, m)):
            scored.tokens += len(out)
            scored.events += score_output(pair.target, ids, out, i)
        outputs.append({"prompt_index": i, "ar": a, method: m})
    delta = compute_delta(ar)
    excess_pp = 100.0 * (me.rate - ar.rate)
    reasons = []
    if excess_pp > rate_tolerance_pp:
        reasons.append(f"{method} mismatch rate {100 * me.rate:.2f}% exceeds ar's {100 * ar.rate:.2f}% "
                       f"by {excess_pp:.2f} pp (> {rate_tolerance_pp} pp)")
    if len(me.large(delta)) > len(ar.large(delta)):
        reasons.append(f"{method} has {len(me.large(delta))} large event(s) (margin >= {2 * delta:g}) vs ar's "
                       f"{len(ar.large(delta))}")
    return {
        "method": method,
        "delta": delta,
        "large_threshold": 2 * delta,
        "ar": ar.to_dict(delta),
        "candidate": me.to_dict(delta),
        "rate_excess_pp": excess_pp,
        "rate_tolerance_pp": rate_tolerance_pp,
        "passed": not reasons,
        "reasons": reasons,
        "outputs_differing_from_ar": sum(o["ar"] != o[method] for o in outputs),
        "fault_bias": list(fault_bias) if fault_bias is not None else None,
        "outputs": outputs,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="tree", choices=["chain", "tree", "async", "tlv"],
                   help="method audited against ar")
    add_model_arguments(p)
    add_decoding_arguments(p)
    for a in p._actions:  # greedy only (refused otherwise, in run): the sampling flags are not offered in --help
        if {"--temperature", "--top-p", "--seed"} & set(a.option_strings):
            a.help = argparse.SUPPRESS
    add_workload_arguments(p, num_prompts=8)
    p.add_argument("--out", default="audit-out", help="folder for audit.json")
    p.add_argument("--rate-tolerance", type=float, default=RATE_TOLERANCE_PP,
                   help="allowed excess mismatch rate over ar, in percentage points")


def run(args: argparse.Namespace) -> int:
    from tandem.bench.env import ensure_out_dir, environment, write_json
    from tandem.bench.harness import tokenize_prompts
    from tandem.runtime.pair import load_pair

    spec, sampling, gen = configs_from_args(args)
    if not math.isfinite(args.rate_tolerance) or args.rate_tolerance < 0:
        raise ConfigError(f"--rate-tolerance must be a finite number >= 0 (got {args.rate_tolerance})")
    ensure_out_dir(args.out)
    if not sampling.greedy:
        raise ConfigError("tandem audit forces greedy outputs; drop --temperature (or pass 0)")
    prompts = load_workload(args.workload, args.num_prompts, args.data_dir, args.source_lines)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=True, method=args.method)
    ctx = min(pair.target.config.max_position_embeddings, pair.draft.config.max_position_embeddings)
    for note in spec.capped(ctx)[1]:
        notice(note)
    ids, info = tokenize_prompts(prompts, pair.tokenizer, args.max_prompt_tokens)
    report = run_audit(ids, args.method, spec, gen, pair, rate_tolerance_pp=args.rate_tolerance, progress=True)
    report = {"environment": environment(pair.target.device),
              "config": {"workload": args.workload, "num_prompts": len(ids), "max_new_tokens": gen.max_new_tokens,
                         "target": str(pair.target_dir), "draft": str(pair.draft_dir), "dtype": args.dtype,
                         "spec": asdict(spec)},
              "prompts": info, **report}
    out = Path(args.out)
    write_json(out / "audit.json", report)
    print(summary_line(report))
    print(f"tandem audit: wrote {out / 'audit.json'}", file=sys.stderr)
    if not report["passed"]:
        for r in report["reasons"]:
            print(f"tandem audit: FAIL: {r}", file=sys.stderr)
        return 1
    return 0


def summary_line(report: dict) -> str:
    a, c = report["ar"], report["candidate"]
    return (f"audit {report['method']}: {'PASS' if report['passed'] else 'FAIL'}; delta {report['delta']:g}; "
            f"mismatch rate {100 * c['mismatch_rate']:.2f}% (ar {100 * a['mismatch_rate']:.2f}%); "
            f"large events {c['large_events']} (ar {a['large_events']}); tokens {c['tokens']} (ar {a['tokens']})")
