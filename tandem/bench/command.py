"""`tandem bench`: the flags (harness.add_arguments) and the dispatch between a real-pair run
(tandem.bench.harness), an acceptance replay at preset shapes (tandem.bench.replay), the batched
engine by concurrency (tandem.bench.concurrency, `--concurrency`) and an online load of a server
over HTTP (tandem.bench.online, `--online`, which reads the same `--concurrency` levels).

NOTE: the dispatch lives here, above both, so that replay may use the harness's records and
tables while the harness knows nothing of replay (no import circle).
"""
from __future__ import annotations

import argparse

from tandem.bench import concurrency, harness, online
from tandem.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_arguments(p)
    concurrency.add_arguments(p)  # NOTE: before online's: it registers --concurrency, online reuses it
    online.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.online:
        return online.run(args)
    if args.concurrency is not None:
        return concurrency.run(args)
    if any(getattr(args, f, False) for f in ("batch_parallel", "row_selection", "deterministic")):
        raise ConfigError("--batch-parallel / --row-selection / --deterministic are engine modes: use them with "
                          "--concurrency")
    if args.replay is not None:
        from tandem.bench.replay import run_replay

        harness.check_common(args)
        return run_replay(args)
    return harness.run(args)
