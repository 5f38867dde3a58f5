"""ModelRunner: one model + its KV cache, and the step every method uses.

A step feeds T rows (tokens at given positions) that attend to the verified prefix and to
tree-region rows picked by a [T, tree_len] mask, writes their K/V into the tree region and
returns their logits. On CUDA the step for a given T is captured once in a CUDA graph per
row bucket (padded rows write a scratch cache row and see only it), so a step costs one graph
launch instead of hundreds of kernel launches from a slow host CPU.
"""
from __future__ import annotations

import torch

from tandem.kv.cache import KVCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class ModelRunner:
    def __init__(self, model, capacity: int, use_graphs: bool | None = None, buckets=DEFAULT_BUCKETS):
        self.model = model
        self.device = model.device
        # +1: the last row is a scratch row that padded (bucket-filling) rows write to.
        self.cache = KVCache.for_model(model, capacity + 1)
        self.capacity = capacity
        self.scratch = capacity
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.buckets = tuple(sorted(buckets))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._pool = None
        self.passes = 0  # forward passes run (for stats)

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: list[int], positions: list[int], tree_mask: torch.Tensor) -> torch.Tensor:
        """Feed len(tokens) rows as new tree-region rows; return their logits [T, vocab].

        tree_mask: [T, tree_len_after] bool over the tree region *including* the new rows,
        which occupy its last T columns. The verified prefix is always visible.
        """
        T = len(tokens)
        slots = self.cache.reserve(T)  # [T]
        prefix, tree_len = self.cache.prefix_len, self.cache.tree_len
        assert tree_mask.shape == (T, tree_len), (tree_mask.shape, T, tree_len)
        self.passes += 1
        bucket = next((b for b in self.buckets if b >= T), None) if self.use_graphs else None
        if bucket is None:
            width = prefix + tree_len
            mask = torch.zeros(T, width, dtype=torch.bool, device=self.device)
            mask[:, :prefix] = True
            mask[:, prefix:] = tree_mask.to(self.device)
            ids = torch.tensor([tokens], device=self.device)
            pos = torch.tensor([positions], device=self.device)
            return self.model(ids, pos, self.cache, slots[None], mask[None, None])[0]
        return self._graph_step(bucket, tokens, positions, slots, prefix, tree_len, tree_mask)

    # ------------------------------------------------------------------------------------
    def _graph_step(self, bucket, tokens, positions, slots, prefix, tree_len, tree_mask):
        if bucket not in self._graphs:
            self._capture(bucket)
        graph, buf = self._graphs[bucket]
        T = len(tokens)
        # Host-built inputs travel in one pinned copy each; the mask is built on the device.
        host = torch.tensor([tokens + [0] * (bucket - T), positions + [0] * (bucket - T)], dtype=torch.long)
        dev = host.to(self.device, non_blocking=True)
        buf["ids"][0].copy_(dev[0])
        buf["pos"][0].copy_(dev[1])
        buf["slots"][0, :T].copy_(slots)
        buf["slots"][0, T:].fill_(self.scratch)
        m = buf["mask"][0, 0]  # [bucket, capacity + 1]
        m[:T].copy_(buf["cols"] < prefix)
        m[:T, prefix:prefix + tree_len] = tree_mask.to(self.device, non_blocking=True)
        graph.replay()
        return buf["logits"][0, :T]

    @torch.no_grad()
    def _capture(self, bucket: int) -> None:
        cap = self.capacity + 1
        dev = self.device
        buf = {
            "ids": torch.zeros(1, bucket, dtype=torch.long, device=dev),
            "pos": torch.zeros(1, bucket, dtype=torch.long, device=dev),
            "slots": torch.full((1, bucket), self.scratch, dtype=torch.long, device=dev),
            "mask": torch.zeros(1, 1, bucket, cap, dtype=torch.bool, device=dev),
            "cols": torch.arange(cap, device=dev),
        }
        # Padded rows see only the scratch row, so no row of the softmax is empty.
        buf["mask"][0, 0, :, self.scratch] = True
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up outside capture (cuBLAS handles, autotuning)
                self.model(buf["ids"], buf["pos"], self.cache, buf["slots"], buf["mask"])
        torch.cuda.current_stream().wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            buf["logits"] = self.model(buf["ids"], buf["pos"], self.cache, buf["slots"], buf["mask"])
        # Reset the padded-row pattern the warm-up may have seen, then keep it for replays.
        buf["mask"][0, 0].zero_()
        buf["mask"][0, 0, :, self.scratch] = True
        self._graphs[bucket] = (graph, buf)

    def warmup(self, sizes=(1,)) -> None:
        """Capture the graphs for these row counts ahead of time (no effect on CPU)."""
        if not self.use_graphs:
            return
        for T in sizes:
            b = next((b for b in self.buckets if b >= T), None)
            if b is not None and b not in self._graphs:
                self._capture(b)

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens: list[int], chunk: int = 512) -> torch.Tensor | None:
        """Append tokens to the verified prefix (causal); returns the last row's logits [vocab]."""
        logits = None
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            start = self.cache.prefix_len
            T = len(part)
            causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            out = self.step(part, list(range(start, start + T)), causal)
            self.cache.commit(list(range(T)))
            logits = out[-1]
        return logits
