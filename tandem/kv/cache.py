"""Tree-aware KV cache: per sequence the rows are `[verified prefix | tree region | free]`.

SwiftSpec's invariant: the verified prefix is contiguous from row 0; the tree region right
after it holds the K/V of draft-tree nodes (in node order) whose fate is not decided yet.
`commit(path, keep)` moves the accepted path's rows to the end of the prefix and the kept
subtree's rows right after them, by index gather: nothing is recomputed.

The storage is a static buffer per layer (so CUDA graphs can capture reads and writes at
fixed addresses); a paged pool can back the same interface later by mapping rows to pages.
"""
from __future__ import annotations

import torch

from tandem.kernels.fused import rope_store_kv


class CacheFullError(RuntimeError):
    pass


class KVCache:
    """Static K/V buffers [layers, batch, kv_heads, capacity, head_dim] with a tree region.

    Batch 1 is what the single-request runtime uses; the batch axis exists so a batched engine
    can reuse the layout.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, batch: int = 1):
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        # K and V in one tensor, so a commit moves both with one gather and one copy
        self.kv = torch.zeros((2, *shape), dtype=dtype, device=device)  # [2, layers, batch, kv_heads, capacity, D]
        self.k, self.v = self.kv[0], self.kv[1]
        self.capacity = capacity
        self.prefix_len = 0  # verified rows
        self.tree_len = 0  # rows in the tree region

    @classmethod
    def for_model(cls, model, capacity: int, batch: int = 1) -> "KVCache":
        c = model.config
        return cls(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity, model.dtype, model.device, batch)

    @property
    def length(self) -> int:
        """Rows in use: prefix + tree region."""
        return self.prefix_len + self.tree_len

    # ---- used by the attention layers ---------------------------------------------------
    def store(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, n_q: int,
              slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE the new rows' q (in place) and k, store k/v at `slots`; return K/V columns [0, width).

        qkv: [B, T, n_q + 2 n_kv, D]; positions, slots: [B, T]. Returns two [B, Hkv, width, D] views.
        """
        n_kv = self.k.shape[2]
        rope_store_kv(qkv, positions, inv_freq, n_q, n_kv, self.k[layer], self.v[layer], slots)
        return self.k[layer, :, :, :width], self.v[layer, :, :, :width]

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V buffers [batch, kv_heads, capacity, D] (the fused layer kernels write them)."""
        return self.k[layer], self.v[layer]

    # ---- bookkeeping ----------------------------------------------------------------------
    def reserve_rows(self, n: int) -> int:
        """Append n rows to the tree region (counted in tree_len); returns the first row's index."""
        start = self.length
        if start + n > self.capacity:
            raise CacheFullError(f"KV cache full: {start} + {n} rows > capacity {self.capacity}")
        self.tree_len += n
        return start

    def commit(self, path: list[int], keep: list[int] | None = None) -> None:
        """Move tree rows `path` (tree-relative indices, root first) into the prefix.

        `keep` (tree-relative) are rows that stay in the tree region, in the given order, right
        after the new prefix end; every other tree row is dropped.
        """
        keep = list(keep or [])
        src_rel = list(path) + keep
        if src_rel != list(range(len(src_rel))):  # rows already in place need no copy
            p0 = self.prefix_len
            src = torch.tensor([p0 + r for r in src_rel], dtype=torch.long, device=self.kv.device)
            # NOTE: index_select copies first, then we write, so overlapping src/dst is safe.
            self.kv[:, :, :, :, p0:p0 + len(src_rel)] = self.kv.index_select(4, src)
        self.prefix_len += len(path)
        self.tree_len = len(keep)

    def drop_tree(self) -> None:
        self.tree_len = 0

    def truncate(self, n: int) -> None:
        """Keep only the first n prefix rows (and no tree region)."""
        if n > self.prefix_len:
            raise ValueError(f"truncate({n}) beyond prefix of {self.prefix_len}")
        self.prefix_len, self.tree_len = n, 0
