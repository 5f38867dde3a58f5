"""`tandem convert --w12`: write a W12 (lossless 12-bit) copy of a bf16 checkpoint folder.

The copy loads like any checkpoint (`--target OUT`): the loader sees its quantization_config,
decodes every matrix to bf16 and checks it against the original's checksum, so every method's
greedy output on it equals the bf16 checkpoint's.
"""
from __future__ import annotations

import argparse

from tandem.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--w12", action="store_true", help="write the W12 lossless 12-bit weight format (SpecPilot s4.1)")
    p.add_argument("--target", default=None, help="bf16 checkpoint folder to convert (default: the bundled target)")
    p.add_argument("--out", required=True, help="new folder for the converted checkpoint")
    p.add_argument("--device", default="cpu", help="cpu | cuda: where to encode (default: cpu)")


def run(args) -> int:
    from tandem.quant.checkpoint import write_w12_checkpoint
    from tandem.runtime.pair import BUNDLED_TARGET, resolve_device

    if not args.w12:
        raise ConfigError("name the format to write: --w12 (the only one for now)")
    src = args.target or BUNDLED_TARGET
    r = write_w12_checkpoint(src, args.out, resolve_device(args.device))
    mb = 1 / 2**20
    print(f"wrote {r.out}: {r.matrices} matrices ({r.weights} weights) in W12, {len(r.kept)} tensors kept; "
          f"escape rate {r.escape_rate:.2e}, {r.bits_per_weight:.3f} bits/weight; weight files "
          f"{r.source_file_bytes * mb:.1f} MiB -> {r.out_file_bytes * mb:.1f} MiB (size ratio {r.size_ratio:.3f}); "
          "every matrix restores bit for bit")
    return 0
