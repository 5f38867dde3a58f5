"""Run a checks script under Triton's interpreter and record every kernel launch's signature.

    TRITON_INTERPRET=1 python tests/triton_record.py RECORD.json tests/<name>_checks.py

Each launch (kernel, argument types, constexpr values) is written to RECORD.json at exit, once per
distinct variant; tests/triton_frontend.py then runs Triton's code generator over each variant, as a
GPU compile would, so that a kernel only the interpreter has run cannot hide a typing error.
"""
from __future__ import annotations

import atexit
import inspect
import json
import runpy
import sys

import torch
from triton.runtime import interpreter

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}
seen: dict[str, dict] = {}


def spec(fn, args, kwargs) -> dict:
    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    types, consts = {}, {}
    for name, p in sig.parameters.items():
        v = bound.arguments.get(name, p.default)
        if "constexpr" in str(p.annotation) or v is None:
            types[name] = "constexpr"
            consts[name] = v if isinstance(v, (int, float, bool, type(None))) else str(v)
        elif isinstance(v, torch.Tensor):
            types[name] = "*" + DTYPES[v.dtype]
        elif isinstance(v, bool):
            types[name] = "i1"
        elif isinstance(v, int):
            types[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            types[name] = "fp32"
        else:
            raise TypeError(f"{fn.__qualname__}: argument {name} of type {type(v).__name__}")
    return {"module": fn.__module__, "name": fn.__qualname__, "signature": types, "constexprs": consts}


real_run = interpreter.InterpretedFunction.run


def recording_run(self, *args, grid, warmup, **kwargs):
    s = spec(self.fn, args, kwargs)
    seen.setdefault(json.dumps(s, sort_keys=True), s)
    return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)


def dump(path: str) -> None:
    with open(path, "w") as f:
        json.dump(list(seen.values()), f)


if __name__ == "__main__":
    record, script = sys.argv[1], sys.argv[2]
    interpreter.InterpretedFunction.run = recording_run
    atexit.register(dump, record)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
