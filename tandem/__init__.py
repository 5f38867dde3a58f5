"""Tandem: a lossless speculative-decoding inference engine."""

# NOTE: `tandem --version` reads the installed package's metadata; this copy (kept equal to
# pyproject.toml's version, a test checks it) serves a checkout run without installing it.
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "SpecConfig", "EngineConfig", "__version__"]

# name -> its module (imported on first use)
_LAZY = {"LLM": "tandem.engine.llm", "SamplingParams": "tandem.engine.request", "SpecConfig": "tandem.config",
         "EngineConfig": "tandem.engine.config"}


def lazy_exports(package: str, table: dict[str, str]):
    """A module `__getattr__` that imports each name of `table` from its module on first use, so that
    importing a package (`import tandem`: the CLI's --version and --help) does not import torch."""
    def __getattr__(name: str):
        if name in table:
            import importlib

            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = lazy_exports(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
