"""`tandem bench`: the flags (harness.add_arguments) and the dispatch between a real-pair run
(tandem.bench.harness), an acceptance replay at preset shapes (tandem.bench.replay) and the
batched engine by concurrency (tandem.bench.concurrency, `--concurrency`).

NOTE: the dispatch lives here, above both, so that replay may use the harness's records and
tables while the harness knows nothing of replay (no import circle).
"""
from __future__ import annotations

import argparse

from tandem.bench import concurrency, harness


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_arguments(p)
    concurrency.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.concurrency is not None:
        return concurrency.run(args)
    if args.replay is not None:
        from tandem.bench.replay import run_replay

        harness.check_common(args)
        return run_replay(args)
    return harness.run(args)
