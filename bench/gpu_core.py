"""GPU checks and timings of the single-request core (run on the lent H200).

    python bench/gpu_core.py --preset llama3-8b --out $OUT

1. Each Triton kernel against its torch reference on fresh random inputs of several shapes.
2. Device copy bandwidth -> bandwidth floor of one batch-1 pass (weight bytes / bandwidth).
3. CUDA-graph step time of the runner at 1, 2, 4, ..., 128 rows (CUDA events, median), so
   the 64-row verify pass can be read against the 1-row pass.
4. End-to-end greedy AR decoding through Generator (host loop included): ms/token.

`--w12`: one-row passes read W12 copies of every projection and the LM head (Transformer.use_w12_gemv;
the preset's N(0, 0.02) weights, their escape rate printed), and the floor is then the W12 bytes'.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tandem.bench.presets import PRESETS, random_model  # noqa: E402
from tandem.bench.profile import copy_bandwidth  # noqa: E402
from tandem.config import GenerationConfig  # noqa: E402
from tandem.kernels import fused  # noqa: E402
from tandem.runtime.generate import Generator  # noqa: E402
from tandem.runtime.runner import ModelRunner  # noqa: E402
from tandem.runtime.timing import median_seconds  # noqa: E402


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check_kernels() -> dict:
    out = {}
    torch.manual_seed(0)
    with torch.no_grad():
        for dt in (torch.bfloat16, torch.float32):
            for rows, n in ((1, 4096), (7, 896), (65, 2048), (3, 384)):
                x = torch.randn(rows, n, device="cuda", dtype=dt)
                d = torch.randn(rows, n, device="cuda", dtype=dt)
                w = torch.randn(n, device="cuda", dtype=dt)
                rs, rn = fused.add_rmsnorm_ref(x.clone(), d, w, 1e-5)
                xs = x.clone()
                s, y = fused.add_rmsnorm(xs, d, w, 1e-5)
                out[f"add_rmsnorm/{dt}/{rows}x{n}"] = max(rel_err(s, rs), rel_err(y, rn))
                gu = torch.randn(rows, 2 * n, device="cuda", dtype=dt)
                out[f"silu_mul/{dt}/{rows}x{n}"] = rel_err(fused.silu_mul(gu), fused.silu_mul_ref(gu))
            for B, T, H, Hk, D in ((1, 1, 32, 8, 128), (1, 65, 14, 2, 64), (2, 9, 6, 2, 64)):
                qkv = torch.randn(B, T, H + 2 * Hk, D, device="cuda", dtype=dt)
                pos = torch.randint(0, 5000, (B, T), device="cuda")
                inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
                ref = fused.rope_ref(qkv[:, :, :H + Hk], pos, inv)
                got = qkv.clone()
                fused.rope_(got, pos, inv, H + Hk)
                out[f"rope/{dt}/{B}x{T}x{H}+{Hk}x{D}"] = rel_err(got[:, :, :H + Hk], ref)
                assert torch.equal(got[:, :, H + Hk:], qkv[:, :, H + Hk:]), "rope touched v heads"
    for k, v in out.items():
        tol = 1e-2 if "bfloat16" in k else 1e-5
        assert v < tol, f"kernel check failed: {k} rel err {v}"
    return out


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def time_steps(runner: ModelRunner, rows: list[int], context: int, iters: int = 50) -> dict[int, float]:
    """Median ms of one captured step at each row count (graph replay + input staging)."""
    vocab = runner.model.config.vocab_size
    runner.cache.truncate(0)
    runner.prefill(torch.randint(0, vocab, (context,)).tolist())
    res = {}
    for T in rows:
        toks = torch.randint(0, vocab, (T,)).tolist()
        pos = [context + i for i in range(T)]
        mask = torch.ones(T, T, dtype=torch.bool).tril()

        def step() -> None:
            runner.step(toks, pos, mask)
            runner.cache.drop_tree()

        res[T] = 1e3 * median_seconds(runner.device, step, iters, warmup=5)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128", help="row counts of the step timings")
    ap.add_argument("--gemv-launch", help="a launch table of the one-row GEMV kernels (bench/gpu_gemv.py's)")
    ap.add_argument("--w12", action="store_true", help="one-row passes read W12 copies of the weights")
    args = ap.parse_args()
    if args.gemv_launch:
        from tandem.kernels import gemv

        with open(args.gemv_launch) as f:
            gemv.set_launch(json.load(f))
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
                    "date": time.strftime("%Y-%m-%d"), "TANDEM_GEMV": os.environ.get("TANDEM_GEMV", "1")}
    if args.gemv_launch:
        from tandem.kernels import gemv

        report["gemv_launch"] = dict(gemv.LAUNCH)
    report["kernels_rel_err"] = check_kernels()
    print("kernels ok:", json.dumps(report["kernels_rel_err"]))
    # bytes read + written per second by a 2 GiB device-to-device copy (median of 20)
    bw = copy_bandwidth(torch.device("cuda"), 2 * 1024**3, 20)
    model = random_model(args.preset, "cuda", torch.bfloat16).fuse_projections()
    wb = weight_bytes(model)
    if args.w12:
        t0 = time.time()
        report["w12"] = model.use_w12_gemv()
        layers = [m for layer in model.model.layers for m in (layer.self_attn.w12, layer.mlp.w12)]
        w12_bytes = sum(op.nbytes for d in layers for op in d.values()) + model.head_w12.nbytes
        # the floor's bytes as the bf16 floor counts them (every matrix, the embedding table included), with the
        # W12 copies in place of the projections and the LM head (the bf16 ones stay, for passes of many rows)
        emb = model.model.embed_tokens.weight
        wb = w12_bytes + (emb.numel() * emb.element_size() if emb.data_ptr() != model.lm_head.weight.data_ptr() else 0)
        print(f"W12 copies in {time.time() - t0:.1f} s: escape rate {report['w12']['escape_rate']:.2e}, "
              f"{report['w12']['bits_per_weight']:.3f} bits a weight")
    report.update(copy_bw_TBps=bw / 1e12, weight_GB=wb / 1e9, floor_ms=wb / bw * 1e3)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, weights {wb / 1e9:.2f} GB, floor {wb / bw * 1e3:.3f} ms/token")
    capacity = args.context + args.new_tokens + 160
    runner = ModelRunner(model, capacity)
    rows = [int(r) for r in args.rows.split(",")]
    t0 = time.time()
    runner.warmup(rows)
    report["capture_s"] = time.time() - t0
    steps = time_steps(runner, rows, args.context)
    report["step_ms"] = steps
    for T, ms in steps.items():
        print(f"step rows={T:4d}: {ms:.3f} ms  ({ms / steps[1]:.3f}x the 1-row step)")
    gen = Generator(model, None)
    gen._runners["target"] = runner
    prompt = torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    gen.generate(prompt, "ar", gen=GenerationConfig(max_new_tokens=16, ignore_eos=True))  # warm-up
    runs = []
    for _ in range(3):
        r = gen.generate(prompt, "ar", gen=cfg)
        runs.append((r.seconds - r.ttft) / (r.new_tokens - 1) * 1e3)
    report["ar_ms_per_token"] = statistics.median(runs)
    print(f"AR end-to-end: {report['ar_ms_per_token']:.3f} ms/token (runs {['%.3f' % x for x in runs]}), "
          f"floor {report['floor_ms']:.3f} ms -> {report['floor_ms'] / report['ar_ms_per_token'] * 100:.1f}% of floor")
    os.makedirs(args.out, exist_ok=True)
    tag = ("" if report["TANDEM_GEMV"] == "1" else "_gemv0") + ("_w12" if args.w12 else "")
    with open(os.path.join(args.out, f"gpu_core_{args.preset}{tag}.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
