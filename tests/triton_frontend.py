"""Triton's code generator (the first stage of a GPU compile: Python AST to Triton IR) over every
kernel variant a checks script launched (tests/triton_record.py wrote them), on the CPU.

    python tests/triton_frontend.py RECORD.json     (without TRITON_INTERPRET)

Prints one line per kernel and "frontend: ok"; exits 1 with the compile errors otherwise. The
interpreter runs kernels as Python, so it accepts code that Triton's typing rejects (a name bound
to a constexpr and then to a tensor in a branch, say); this stage rejects it as the GPU would.
"""
from __future__ import annotations

import importlib
import json
import sys

from triton._C import libtriton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

TARGET = GPUTarget("cuda", 90, 32)  # the H100 / H200's


def frontend(fn, signature: dict, constexprs: dict) -> None:
    backend = make_backend(TARGET)
    options = backend.parse_options({})
    ctx = libtriton.ir.context()
    libtriton.ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    src.make_ir(TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)


def main(path: str) -> int:
    failures, kernels = [], {}
    for rec in json.load(open(path)):
        fn = importlib.import_module(rec["module"])
        for part in rec["name"].split("."):
            fn = getattr(fn, part)
        variants = [rec["constexprs"]]
        if rec["constexprs"].get("PDL") is False:  # the CPU never launches with PDL; the GPU does (fused.pdl)
            variants.append({**rec["constexprs"], "PDL": True})
        if rec["constexprs"].get("BF16_DOT") is False:  # the interpreter's stand-in for bf16 dots (gdn_wy)
            variants.append({**rec["constexprs"], "BF16_DOT": True})
        for consts in variants:
            try:
                frontend(fn, rec["signature"], consts)
            except Exception as e:  # noqa: BLE001 - every compile error is reported
                failures.append(f"{rec['name']} {consts}: {type(e).__name__}: {str(e)[:800]}")
            kernels[rec["name"]] = kernels.get(rec["name"], 0) + 1
    for name, n in sorted(kernels.items()):
        print(f"{name}: {n} variant(s)")
    if failures:
        print("\n".join(failures))
        return 1
    print("frontend: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
