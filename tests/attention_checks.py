"""Checks of the cached-attention kernel (tandem.kernels.attention), shared by tests/test_attention_kernel.py.

They run the kernel on the CPU through Triton's interpreter (in a process of its own:
`TRITON_INTERPRET=1 python tests/attention_checks.py`), in fp32, against SDPA (`cached_attention_ref`):
one kernel over all columns, and the columns split across programs then merged (flash-decoding), with
GQA groups, tree masks, rows that see no column of a split, and widths that are not a multiple of a block.
"""
from __future__ import annotations

import torch

from tandem.kernels import attention as att


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-5, (name, err)


def check_splits() -> None:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for B, T, H, Hkv, D, W in ((1, 1, 4, 1, 32, 300), (1, 5, 6, 2, 64, 257), (2, 3, 4, 4, 32, 130),
                               (1, 17, 8, 2, 32, 520)):
        q = torch.randn(B, T, H, D, generator=g)
        k, v = torch.randn(B, Hkv, W, D, generator=g), torch.randn(B, Hkv, W, D, generator=g)
        prefix = W - T - 7
        mask = torch.zeros(B, 1, T, W, dtype=torch.bool)
        mask[..., :prefix] = True  # the prefix, then a random tree over the last rows (each sees itself)
        for t in range(T):
            mask[..., t, prefix + t] = True
            mask[..., t, prefix:prefix + t] = torch.rand(t, generator=g) < 0.5
        want = att.cached_attention_ref(q, k, v, mask)
        for splits in (1, 2, 3, None):  # None: splits_for's choice
            for bn in (32, 64):
                got = att.launch_cached_attention(q, k, v, mask, block_n=bn, splits=splits)
                _close(f"B{B} T{T} H{H}/{Hkv} W{W} splits {splits} block {bn}", got, want)
                cases += 1
    assert att.splits_for(8, 13) > 1 and att.splits_for(2, 4) == 1  # the 8B shape splits; a short cache does not
    print(f"attention splits ({cases} cases): ok")


if __name__ == "__main__":
    check_splits()
