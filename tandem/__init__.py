"""Tandem: a lossless speculative-decoding inference engine."""

# NOTE: `tandem --version` reads the installed package's metadata; this copy (kept equal to
# pyproject.toml's version, a test checks it) serves a checkout run without installing it.
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "SpecConfig", "EngineConfig", "__version__"]

# name -> its module (imported on first use)
_LAZY = {"LLM": "tandem.engine.llm", "SamplingParams": "tandem.engine.request", "SpecConfig": "tandem.config",
         "EngineConfig": "tandem.engine.config"}


def __getattr__(name: str):
    # NOTE: lazy, so `import tandem` (the CLI's --version, --help) does not import torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
