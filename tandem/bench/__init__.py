"""Measuring Tandem: `tandem bench` (harness), `tandem audit` (token forcing), `tandem profile` (cost model).

- `command`: the `tandem bench` entry: a real-pair run (harness), an acceptance replay (replay)
  or an online load of a server (online, `--online`).
- `online`: streamed completions against `tandem serve` (in-process on 127.0.0.1) or a --url at
  fixed concurrency / request rate; requests/s, tok/s, TTFT / ITL / e2e p50/p99, errors.
- `harness`: methods run paired per prompt on a workload, outputs checked against `ar`,
  per-request tokens/s, TTFT, tau, per-depth acceptance, bootstrap CIs of speed ratios.
- `workloads`: MBPP, Spec-Bench, MT-Bench, GSM8K, held-out Python source, generic JSONL.
- `replay`: acceptance replay: a recorded trace's accept counts timed at preset shapes (simulated).
- `stats`: summaries and the paired geometric-mean ratio with its seeded bootstrap CI.
- `audit`: SpecPilot token forcing through an fp32 LM head; catches a lossy verifier.
- `profile` + `presets`: step costs of real model shapes with random weights, c(N), the
  bandwidth floor of an AR step, and the speedup predicted from a tau(N) table.
- `plots`, `env`: PNGs (matplotlib, Agg) and the environment record every output carries.
"""
