"""Tandem: a lossless speculative-decoding inference engine."""

# NOTE: `tandem --version` reads the installed package's metadata; this copy (kept equal to
# pyproject.toml's version, a test checks it) serves a checkout run without installing it.
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # NOTE: lazy, so `import tandem` (the CLI's --version, --help) does not import torch
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tandem.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
