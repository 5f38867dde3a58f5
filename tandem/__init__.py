"""Tandem: a lossless speculative-decoding inference engine."""

# NOTE: `tandem --version` reads the installed package's metadata; this copy (kept equal to
# pyproject.toml's version, a test checks it) serves a checkout run without installing it.
__version__ = "0.1.0"
