"""Host time of the block drafter's best-first trees for a batch of requests: a heap walk per
request (tandem.drafting.lattice.best_first_tree) against every tree at once
(best_first_trees, level beams in tensor ops), on random lattices of 16 positions x 16
candidates, N = 32 nodes, on the CPU (what decides where the engine builds them).

    python bench/cpu_lattice_trees.py [--repeats 20]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tandem.drafting.lattice import best_first_tree, best_first_trees, unpack_lattice

K, B, N = 16, 16, 32


def lattices(R: int, rng: np.random.Generator) -> np.ndarray:
    """[R, B, 3K + K*K] random lattice rows (candidates, log-probs, parent-conditioned log-probs)."""
    rows = np.zeros((R, B, 3 * K + K * K), dtype=np.float32)
    rows[:, :, :K] = rng.integers(0, 8000, (R, B, K))
    g = rng.normal(size=(R, B, K + K * K)) * 2
    rows[:, :, 2 * K:3 * K] = g[..., :K] - np.log(np.exp(g[..., :K]).sum(-1, keepdims=True) + 1)
    gg = g[..., K:].reshape(R, B, K, K)
    rows[:, :, 3 * K:] = (gg - np.log(np.exp(gg).sum(-1, keepdims=True) + 1)).reshape(R, B, K * K)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for R in (1, 2, 4, 8, 16, 32, 64):
        rows = lattices(R, rng)
        flat = torch.from_numpy(rows.reshape(R * B, -1))
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            for r in range(R):
                best_first_tree(unpack_lattice(flat[r * B:(r + 1) * B], K), r, N)
        heap = (time.perf_counter() - t0) / args.repeats
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            best_first_trees(torch.from_numpy(rows), [B] * R, list(range(R)), K, N)
        together = (time.perf_counter() - t0) / args.repeats
        print(f"R={R}: heap walks {heap * 1e3:.3f} ms, all together {together * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
