"""The full reliability run of `tandem serve` (issue 13, item 5): an in-process server on 127.0.0.1
(the bundled pair, tree + ar, an API key), each check of tandem.serve.reliability in turn, the KV
invariant of every pool after each phase; a JSON and a Markdown report.

    python bench/serve_reliability.py --out out/reliability             (CPU: a few minutes)
    python bench/serve_reliability.py --device cuda --out $OUT          (device tool)
    python bench/serve_reliability.py --quick                           (the CI-sized figures)

Exit status 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.runtime.pair import load_pair  # noqa: E402
from tandem.serve import reliability as rel  # noqa: E402
from tandem.serve.chat_template import ChatTemplate  # noqa: E402
from tandem.serve.config import ServerConfig  # noqa: E402

KEY = "sk-reliability"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/serve_reliability")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--capacity", type=int, default=8, help="the server's max_pending")
    ap.add_argument("--quick", action="store_true", help="the CI-sized figures (60 generated bodies, 8 disconnects)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soak-seconds", type=float, default=None, help="check 3's duration (default 600; --quick: 10)")
    ap.add_argument("--engine-process", action="store_true",
                    help="every server's engines in a process of their own (tandem serve --engine-process)")
    args = ap.parse_args(argv)
    try:  # check 1 generates bad bodies with hypothesis: say so now, not as a failed check at the end
        import hypothesis  # noqa: F401
    except ImportError:
        print("serve_reliability: error: needs hypothesis for its generated bad inputs; pip install hypothesis "
              "(or pip install 'tandem[test]')", file=sys.stderr)
        return 2
    generated, disconnects, stream_prompts = (60, 8, 2) if args.quick else (1000, 200, len(rel.PROMPTS))
    soak = args.soak_seconds if args.soak_seconds is not None else (10.0 if args.quick else 600.0)

    from tandem.serve.app import Server

    pairs: dict[str, object] = {}

    def server(cfg: ServerConfig, ecfg: EngineConfig, dtype: str = args.dtype) -> Server:
        """The bundled pair served in this process, or by an engine process (--engine-process)."""
        if args.engine_process:
            from tandem.models.loader import load_tokenizer
            from tandem.runtime.pair import BUNDLED_TARGET
            from tandem.serve.engine_process import EngineSpec

            spec = EngineSpec(None, None, args.device, dtype, cfg.methods, ecfg, cfg.inject_faults)
            return Server(None, None, load_tokenizer(BUNDLED_TARGET), cfg, ecfg,
                          ChatTemplate.for_checkpoint(BUNDLED_TARGET), engine_process=spec)
        if dtype not in pairs:
            pairs[dtype] = load_pair(None, None, args.device, dtype)
        p = pairs[dtype]
        return Server(p.target, p.draft, p.tokenizer, cfg, ecfg, ChatTemplate.for_checkpoint(p.target_dir))

    live = rel.LoopbackServer(server(ServerConfig(api_key=KEY, methods=("tree", "ar"), max_pending=args.capacity),
                                     EngineConfig(num_blocks=512, max_num_seqs=8, debug_check=True)), KEY)
    t = live.target
    # check 7's server: a KV pool that holds about two growing requests, so requests are preempted
    tight = rel.LoopbackServer(server(ServerConfig(api_key=KEY, methods=("tree",), max_pending=64),
                                      EngineConfig(num_blocks=10, max_num_seqs=8, debug_check=True)), KEY)
    # check 10's server: faults injected on request, and killed at the end of the check
    doomed = rel.LoopbackServer(server(ServerConfig(api_key=KEY, methods=("tree",), max_pending=64, inject_faults=True),
                                       EngineConfig(num_blocks=512, max_num_seqs=8, debug_check=True)), KEY)
    # check 8's server: batch-invariant engines, in bf16 (where the fast kernels' near-ties show)
    det = rel.LoopbackServer(server(ServerConfig(api_key=KEY, methods=("tree", "ar"), max_pending=64),
                                    EngineConfig(num_blocks=512, max_num_seqs=16, debug_check=True,
                                                 deterministic=True), "bfloat16"), KEY)
    phases = [
        ("bad inputs", lambda: rel.check_bad_inputs(t, generated=generated, seed=args.seed)),
        ("status map", lambda: rel.check_status_map(t)),
        ("burst", lambda: rel.check_burst(t, factor=4)),
        ("disconnects", lambda: rel.check_disconnects(t, n=disconnects, seed=args.seed)),
        ("streaming", lambda: rel.check_streaming(t, prompts=rel.PROMPTS[:stream_prompts])),
        ("ledger", lambda: rel.check_ledger(t, rounds=2 if args.quick else 5)),
        ("soak", lambda: rel.check_soak(t, seconds=soak, concurrency=8)),
        ("preemptions", lambda: rel.check_preemptions(tight.target, n=8 if args.quick else 24,
                                                      max_tokens=24 if args.quick else 48,
                                                      min_preemptions=3 if args.quick else 50)),
        ("security", lambda: rel.check_security(t)),
        ("deterministic", lambda: rel.check_deterministic(det.target, batches=(1, 4, 16) if args.quick
                                                           else (1, 2, 4, 8, 16))),
        ("faults", lambda: rel.check_faults(doomed.target, n=20 if args.quick else 100, every=20)),
        ("sigterm", lambda: rel.check_sigterm(engine_process=args.engine_process)),
    ]
    results: list[tuple[rel.CheckResult, float]] = []
    try:
        for phase, run in phases:
            t0 = time.monotonic()
            try:
                res = run()
            except Exception as e:  # a check that crashes is a failed check, and the run goes on
                res = rel.CheckResult(phase.replace(" ", "_"), "crashed", False, (f"{type(e).__name__}: {e}",))
            results.append((res, time.monotonic() - t0))
            print(f"{'PASS' if res.passed else 'FAIL'}  {res.name}: {res.figure}", flush=True)
            kv = rel.check_kv_invariant(t, phase)
            results.append((kv, 0.0))
            print(f"{'PASS' if kv.passed else 'FAIL'}  {kv.name}: {kv.figure}", flush=True)
    finally:
        live.stop()
        tight.stop()
        doomed.stop()
        det.stop()

    os.makedirs(args.out, exist_ok=True)
    report = {"device": args.device, "dtype": args.dtype, "capacity": args.capacity, "quick": args.quick,
              "engine_process": args.engine_process,
              "python": platform.python_version(), "passed": all(r.passed for r, _ in results),
              "checks": [{**r.as_dict(), "seconds": round(s, 2)} for r, s in results]}
    with open(os.path.join(args.out, "serve_reliability.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = ["# tandem serve: reliability", "",
             f"{args.device} / {args.dtype}, capacity {args.capacity}{' (quick)' if args.quick else ''}"
             f"{', engines in a process of their own' if args.engine_process else ''}: "
             f"{sum(r.passed for r, _ in results)} of {len(results)} checks passed.", "",
             "| check | figure reached | passed | seconds |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.figure} | {'yes' if r.passed else '**no**'} | {s:.1f} |" for r, s in results]
    for r, _ in results:
        if r.details:
            lines += ["", f"## {r.name}", ""] + [f"- `{d}`" for d in r.details]
    with open(os.path.join(args.out, "serve_reliability.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"report: {args.out}/serve_reliability.{{json,md}}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
