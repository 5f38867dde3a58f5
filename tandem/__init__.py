"""Tandem: a lossless speculative-decoding inference engine."""

from tandem.config import lazy_exports  # (no torch: the package stays light to import)

# NOTE: `tandem --version` reads the installed package's metadata; this copy (kept equal to
# pyproject.toml's version, a test checks it) serves a checkout run without installing it.
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "SpecConfig", "EngineConfig", "__version__"]

# name -> its module (imported on first use)
__getattr__ = lazy_exports(__name__, {"LLM": "tandem.engine.llm", "SamplingParams": "tandem.engine.request",
                                      "SpecConfig": "tandem.config", "EngineConfig": "tandem.engine.config"})


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
