"""tandem.kernels.tree_verify on the CPU: accepted_rows (the accepts as the rows an EAGLE-3
head runs next, built on the device before the host reads them) says what the host reads from
the same accepts (device_verify.read): for every request its path's tree positions, its accepted
tokens then the bonus, and the path's length, over random trees and argmaxes."""
from __future__ import annotations

import random

import pytest
import torch

from tandem.engine import device_verify
from tandem.engine.batched_draft import tree_depth_bits
from tandem.kernels import tree_verify


def _trees(R: int, n: int, depth: int, seed: int) -> torch.Tensor:
    """[6, R, n]: random trees of at most `depth` levels, distinct sibling tokens (few: paths accept)."""
    rng = random.Random(seed)
    out = torch.zeros(6, R, n, dtype=torch.long)
    for r in range(R):
        d, children = [0], {0: set()}
        for q in range(1, n + 1):
            p = rng.choice([j for j in range(q) if d[j] < depth])
            d.append(d[p] + 1)
            t = rng.choice([x for x in range(4) if x not in children[p]] or [99 + q])
            children[p].add(t)
            children[q] = set()
            out[0, r, q - 1], out[1, r, q - 1] = t, p
    dd, b = tree_depth_bits(out[1], depth)
    out[4], out[5] = dd[:, 1:], b[:, 1:]
    return out


@pytest.mark.parametrize("R,n,depth", [(1, 5, 5), (4, 16, 4), (6, 63, 8), (3, 1, 1)])
def test_accepted_rows_equal_what_the_host_reads(R, n, depth):
    tree = _trees(R, n, depth, seed=R * 7 + n)
    W, K = n + 1, depth + 1
    g = torch.Generator().manual_seed(n)
    lengths = set()
    for trial in range(12):
        am = torch.randint(0, 4, (R * W,), generator=g)
        if trial % 3:  # follow the trees' tokens along random paths: long accepts
            am_rows = am.view(R, W)
            for r in range(R):
                for q in range(n):
                    if random.Random(trial * 100 + r * 10 + q).random() < 0.8:
                        am_rows[r, tree[1, r, q]] = tree[0, r, q]
        acc = tree_verify.accept_paths_ref(am, tree)  # [R, 3 + n]
        given, _, _ = device_verify.read(device_verify.Launched(acc, acc, None, torch.empty(0), n))
        toks, pos, count = tree_verify.accepted_rows(acc, K)
        assert toks.shape == pos.shape == (R, K)
        for r, (result, _) in enumerate(given):
            c = len(result.path)
            lengths.add(c)
            assert int(count[r]) == c
            assert pos[r, :c].tolist() == result.path  # the rows read these positions' features
            assert toks[r, :c].tolist() == result.tokens  # the accepted tokens, then the bonus
            assert pos[r, c:].tolist() == [0] * (K - c) and toks[r, c:].tolist() == [0] * (K - c)
    assert max(lengths) > min(lengths) and (max(lengths) > 2 or depth == 1)  # (short and long paths seen)
