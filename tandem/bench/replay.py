"""Acceptance replay: time methods at realistic shapes (random weights) with recorded acceptance.

    tandem bench --preset llama3-8b --draft-preset llama3.2-1b --replay runs/mbpp/results.json

A real pair's bench run (its results.json) records, for every request of every method, the
accepted-token count of each target pass. Replay builds random-weight models of the preset
shapes and runs the *same* method code (drafting rounds, the verify pass, KV commits) on random
prompts of the recorded lengths, taking each pass's accept count from the trace. Costs are real;
acceptance is simulated, and every output says so. Outputs are not decodings, so they are not
checked against `ar`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from tandem.config import ConfigError, GenerationConfig, SpecConfig

LABEL = "simulated acceptance"
SHARPEN = 64.0  # gain on the random draft's final RMSNorm (see run_replay)


def load_trace(path: str | Path) -> dict:
    """A `tandem bench` results.json with its per-request records (the acceptance trace)."""
    from tandem.bench.env import read_json

    trace = read_json(path, "--replay")
    if not isinstance(trace, dict) or not trace.get("requests") or "method_specs" not in trace.get("config", {}):
        raise ConfigError(f"--replay {str(path)!r} has no per-request records; pass a results.json written by tandem bench")
    return trace


def run_replay(args) -> int:
    from tandem.bench.env import environment
    from tandem.bench.harness import (REFERENCE, Request, markdown_table, speedups, summarize_method, timeline_of,
                                      write_outputs)
    from tandem.bench.presets import (DEFAULT_DRAFT, DEFAULT_HYBRID_DRAFT, EAGLE3_PRESETS, HYBRID_PRESETS, PRESETS,
                                      random_eagle3, random_model)
    from tandem.models.loader import resolve_dtype
    from tandem.runtime.generate import Generator
    from tandem.runtime.pair import resolve_device

    if not args.preset:
        raise ConfigError("--replay needs --preset NAME (the shapes to time), e.g. --preset llama3-8b")
    known = {**PRESETS, **HYBRID_PRESETS}
    for name in (args.preset, args.draft_preset):
        if name is not None and name not in known and (name != args.draft_preset or name not in EAGLE3_PRESETS):
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(known)}"
                              + (f" (drafts also: {', '.join(EAGLE3_PRESETS)})" if name == args.draft_preset else ""))
    if args.preset in HYBRID_PRESETS and args.draft_preset in EAGLE3_PRESETS:
        raise ConfigError(f"--draft-preset {args.draft_preset} is an EAGLE-3 head of an attention-only target; a hybrid "
                          f"preset takes a draft model preset (e.g. {DEFAULT_HYBRID_DRAFT[args.preset]})")
    trace = load_trace(args.replay)
    draft_preset = args.draft_preset or {**DEFAULT_DRAFT, **DEFAULT_HYBRID_DRAFT}[args.preset]
    if draft_preset not in EAGLE3_PRESETS:  # (a head embeds through the target's own table)
        tv, dv = known[args.preset].vocab_size, known[draft_preset].vocab_size
        if dv < tv:  # (on a GPU: a device-side assert when the draft embedded such a token)
            fits = [n for n, c in known.items() if c.vocab_size >= tv and n != args.preset]
            raise ConfigError(f"draft preset {draft_preset} has {dv} tokens, fewer than {args.preset}'s {tv}: the "
                              "replay feeds the target's tokens to the draft; give --draft-preset with the "
                              f"target's vocabulary ({', '.join(fits) or 'none of the presets has it'})")
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    specs = trace["config"]["method_specs"]
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = [REFERENCE] + [m for m in specs if m != REFERENCE and (m in wanted or m.split("@")[0] in wanted)]
    by_prompt: dict[int, dict[str, dict]] = {}
    for rec in trace["requests"]:
        by_prompt.setdefault(rec["prompt_index"], {})[rec["method"]] = rec
    indices = sorted(i for i, recs in by_prompt.items() if all(m in recs for m in methods))[: args.num_prompts]
    if not indices:
        raise ConfigError(f"--replay {args.replay!r} holds no prompt with every method of {', '.join(methods)}")
    prompt_len = {p["index"]: p["prompt_tokens"] for p in trace.get("prompts", [])}

    target = random_model(args.preset, device, dtype, seed=0)
    if draft_preset in EAGLE3_PRESETS:
        draft = random_eagle3(draft_preset, target, device, dtype, seed=1)
        final_norm = draft.norm
    else:
        draft = random_model(draft_preset, device, dtype, seed=1)
        final_norm = draft.model.norm
    with torch.no_grad():
        # NOTE: a random draft's next-token distributions are nearly flat, so best-first trees stay
        # shallow and a recorded accept count of 7 would not fit in them. Sharpening its output
        # (final-norm gain, which leaves tied embeddings alone) makes them peaked like a trained
        # draft's; the replayed tau is reported beside the trace's so any shortfall shows.
        if getattr(draft, "is_hybrid", False):  # (a zero-centred norm: gain 1 + w)
            final_norm.weight.add_(1.0).mul_(SHARPEN).sub_(1.0)
        else:
            final_norm.weight.mul_(SHARPEN)
    engine = Generator(target, draft)
    g = torch.Generator().manual_seed(0)
    vocab = min(target.config.vocab_size, draft.config.vocab_size)

    def run_one(method: str, ids: list[int], rec: dict) -> Request:
        s = specs[method]
        spec = SpecConfig(method=s["method"], k=s["k"], nodes=s["nodes"], width=s["width"], depth=s["depth"])
        gen = GenerationConfig(max_new_tokens=max(1, rec["new_tokens"]), ignore_eos=True)
        forced = None if s["method"] == "ar" else list(rec["accept_lengths"])
        r = engine.generate(ids, s["method"], spec, gen=gen, forced_accepts=forced)
        return Request(method, rec["prompt_index"], list(r.token_ids), r.seconds, r.ttft, r.finish_reason,
                       r.target_passes, list(r.accept_lengths), list(r.per_depth), timeline_of(r),
                       r.draft_seconds, r.verify_seconds, r.loop, passes_past_end=r.passes_past_end)

    warm_ids = torch.randint(0, vocab, (prompt_len.get(indices[0], 32),), generator=g).tolist()
    for m in methods:  # warm-up: capture graphs, size caches
        run_one(m, warm_ids, by_prompt[indices[0]][m])
    requests: list[Request] = []
    for n, i in enumerate(indices):
        ids = torch.randint(0, vocab, (max(1, prompt_len.get(i, 32)),), generator=g).tolist()
        order = methods[n % len(methods):] + methods[: n % len(methods)]  # rotate, as bench does
        for m in order:
            requests.append(run_one(m, ids, by_prompt[i][m]))
        print(f"tandem bench ({LABEL}): prompt {n + 1}/{len(indices)}", file=sys.stderr)
    by: dict[str, list[Request]] = {m: sorted((r for r in requests if r.method == m), key=lambda r: r.prompt_index)
                                    for m in methods}
    results = {
        "acceptance": f"{LABEL}: accept counts replayed from {args.replay}",
        "environment": environment(device),
        "config": {"workload": f"{trace['config'].get('workload')} [{LABEL}]", "num_prompts": len(indices),
                   "max_new_tokens": max(r.new_tokens for r in requests), "dtype": str(dtype).replace("torch.", ""),
                   "preset": args.preset, "draft_preset": draft_preset, "trace": str(args.replay),
                   "trace_environment": trace.get("environment"), "method_specs": {m: specs[m] for m in methods}},
        "prompts": [{"index": i, "prompt_tokens": prompt_len.get(i)} for i in indices],
        "requests": [r.to_dict() for r in requests],
        "summary": {m: summarize_method(rs) for m, rs in by.items()},
        "trace_tau": {m: (trace.get("summary", {}).get(m) or {}).get("tau") for m in methods},
        "speedup": {"metric": "decode_tokens_per_s", "vs_ar": speedups(by, REFERENCE, 0, args.bootstrap)},
        "check": {"checked": False, "note": f"not checked: {LABEL}, the tokens are not a decoding"},
    }
    out = Path(args.out)
    write_outputs(results, out, plots=not args.no_plots)
    print(markdown_table(results), end="")
    taus = ", ".join(f"{m} {results['summary'][m]['tau']:.2f} (trace {t:.2f})"
                     for m, t in results["trace_tau"].items() if m != REFERENCE and t is not None)
    print(f"replayed tau: {taus} (below the trace's where a recorded accept count was deeper than the random "
          f"draft's tree at that step)")
    print(f"tandem bench: wrote {out / 'results.json'} ({LABEL})", file=sys.stderr)
    return 0
