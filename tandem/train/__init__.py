"""Reproducible training recipe for the bundled draft/target pair (`tandem train-pair`).

`add_arguments(parser)` adds the recipe's flags to an argparse parser and `run(args) -> int`
runs it; `python -m tandem.train` does both. Heavy imports happen inside `run`.
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from tandem.train.recipe import add_arguments as _add

    return _add(parser)


def run(args: argparse.Namespace) -> int:
    from tandem.train.recipe import run as _run

    return _run(args)


__all__ = ["add_arguments", "run"]
