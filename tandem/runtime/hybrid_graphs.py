"""CUDA graphs of a hybrid (Qwen3.5) target's tree passes: one per node bucket, replayed.

An eager Qwen3.5 pass launches some 30 kernels a layer from the host; at the 4B shape on the
H100 that made a one-row pass 40-77 ms, where its weights take ~2.5 ms to read (bench/NOTES.md, 2026-12-06). A
pass of n nodes replays the graph of the smallest bucket b >= n instead:

    static inputs  tokens [1, b], positions [1, b], slots [b], mask [1, 1, b, capacity + 1],
                   conv windows [b, K], and the GDN kernel's tree: root paths [b, b] + lengths
                   (path kernel) or the ancestor mask [b, b] (WY, in torch or Triton)
    static outputs logits [b, vocab], the pass's TreeRecord (its GDN inputs, what commit reads)

The tree is padded to b nodes with roots that hang from the committed prefix, write their K/V
to a scratch row past the cache's capacity, see only that row, and are never committed: every
kernel treats nodes independently, so the real nodes' logits and records are what an eager
pass computes. The attention layers read every column under the mask (a static width), and the
GDN layers read the committed state in place, so the commit writes the state in place too
(HybridTarget.commit). Only the path and WY kernels (wy, wy_triton) are captured: the walk's sequence of
updates depends on the tree's shape. Prefills stay eager (one per request).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from tandem.kernels.gdn import conv_windows
from tandem.kernels.gdn_path import root_paths
from tandem.tree.draft_tree import ancestor_mask

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GRAPH_KERNELS = ("path", "wy", "wy_triton")


def graphs_apply(model) -> bool:
    """Whether a hybrid target's tree passes are captured: on CUDA, with a capturable GDN kernel
    (path, the CUDA default, wy or wy_triton), unless TANDEM_HYBRID_GRAPHS=0 or TANDEM_CUDA_GRAPHS=0. (The
    default since its GPU lane, tests/gpu/test_gpu_hybrid_graphs.py, passed on an H100, 2026-12-07;
    a random Qwen3.5-4B-shaped target's `ar` ran at 93.7 tok/s captured against 13.1 eager.)"""
    return (os.environ.get("TANDEM_HYBRID_GRAPHS", "1") != "0" and model.device.type == "cuda"
            and model.gdn_tree in GRAPH_KERNELS and os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0")


@dataclass
class _Bucket:
    n: int
    tokens: torch.Tensor  # [1, n] long
    positions: torch.Tensor  # [1, n] long
    slots: torch.Tensor  # [n] long
    mask: torch.Tensor  # [1, 1, n, capacity + 1] bool
    windows: torch.Tensor  # [n, K] long
    paths: torch.Tensor  # [n, n] int32 (path kernel)
    lens: torch.Tensor  # [n] int32
    anc: torch.Tensor  # [n, n] bool (WY)
    record: object = None  # the pass's TreeRecord: its layers' tensors are the graph's outputs
    logits: torch.Tensor | None = None  # [n, vocab]
    graph: object = None  # torch.cuda.CUDAGraph (None: emulated, the body runs eagerly)
    body: object = None


class HybridGraphs:
    """The captured tree passes of one HybridTarget (its model, committed state and KV cache;
    the cache has one row more than its plan, the scratch row). `emulate`: the same static
    buffers and padding, run eagerly (any device: the tests)."""

    def __init__(self, model, state, cache, emulate: bool = False):
        if model.gdn_tree not in GRAPH_KERNELS:
            raise ValueError(f"tree passes are captured with the path or a WY kernel, not {model.gdn_tree!r}")
        self.model, self.state, self.cache, self.emulate = model, state, cache, emulate
        self.scratch = cache.capacity - 1  # padding rows write (and see) this row only
        self.buckets: dict[int, _Bucket] = {}
        self._pool = None  # one memory pool for every bucket's graph
        self.disabled = False  # a capture failed: every pass eager
        self.replays = 0

    def run(self, tokens: list[int], parents: list[int]):
        """(logits [n, vocab], record) of one tree pass by replay, the rows reserved in the cache
        as an eager pass reserves them; None when no bucket takes it (the caller runs it eagerly)."""
        n, cache = len(tokens), self.cache
        b = next((x for x in BUCKETS if x >= n), None)
        if b is None or self.disabled or cache.length + n > self.scratch:
            return None
        bk = self.buckets.get(b)
        if bk is None:
            try:
                bk = self._capture(b)
            except RuntimeError as e:  # (a capture this build cannot take: eager passes from now on, same results)
                log.warning("hybrid tree passes run eagerly: capturing a %d-node pass failed (%s)", b, e)
                self.disabled = True
                return None
        start = cache.reserve_rows(n)
        prefix = cache.prefix_len
        padded = list(parents) + [-1] * (b - n)
        depth = [0] * b
        for i, q in enumerate(padded):
            depth[i] = 0 if q < 0 else depth[q] + 1
        anc = ancestor_mask(padded)  # [b, b] bool
        mask = torch.zeros(b, self.scratch + 1, dtype=torch.bool)
        mask[:n, :prefix] = True
        mask[:n, start:start + n] = anc[:n, :n]
        mask[n:, self.scratch] = True
        paths, lens = root_paths(padded)
        full = torch.full((b, b), -1, dtype=torch.int32)
        full[:, :paths.shape[1]] = paths
        bk.tokens.copy_(torch.tensor([list(tokens) + [0] * (b - n)]))
        bk.positions.copy_(torch.tensor([[prefix + d for d in depth]]))
        bk.slots.copy_(torch.tensor(list(range(start, start + n)) + [self.scratch] * (b - n)))
        bk.mask.copy_(mask[None, None])
        bk.windows.copy_(conv_windows(padded, self.model.config.linear_conv_kernel_dim))
        bk.paths.copy_(full)
        bk.lens.copy_(lens)
        bk.anc.copy_(anc)
        if bk.graph is None:
            bk.logits = bk.body()
        else:
            bk.graph.replay()
        self.replays += 1
        return bk.logits[:n], dataclasses.replace(bk.record, parents=padded)

    def _capture(self, b: int) -> _Bucket:
        from tandem.models.qwen3_5 import WY_KERNELS, TreeRecord, _Pass

        m, dev = self.model, self.model.device
        K = m.config.linear_conv_kernel_dim
        bk = _Bucket(b, torch.zeros(1, b, dtype=torch.long, device=dev), torch.zeros(1, b, dtype=torch.long, device=dev),
                     torch.full((b,), self.scratch, dtype=torch.long, device=dev),
                     torch.zeros(1, 1, b, self.scratch + 1, dtype=torch.bool, device=dev),
                     conv_windows([-1] * b, K).to(dev), torch.full((b, b), -1, dtype=torch.int32, device=dev),
                     torch.ones(b, dtype=torch.int32, device=dev), torch.eye(b, dtype=torch.bool, device=dev))
        bk.mask[..., self.scratch] = True  # (the capture's rows: roots at the scratch row, harmless)
        bk.paths[:, 0] = torch.arange(b, dtype=torch.int32, device=dev)
        kernel = m.gdn_tree
        rec = TreeRecord([-1] * b, bk.windows, kernel, bk.anc if kernel in WY_KERNELS else None,
                         (bk.paths, bk.lens) if kernel == "path" else None)
        bk.record = rec

        def body() -> torch.Tensor:
            rec.layers.clear()  # (each run's GDN records: the graph's outputs when captured)
            cos, sin = m._rope(bk.positions, m.dtype)
            p = _Pass(bk.positions, cos, sin, self.state, rec, self.cache, bk.slots, bk.mask)
            return m._run(bk.tokens, p)[0]  # [b, vocab]

        bk.body = body
        if not self.emulate:
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS workspaces
                body()
                body()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                bk.logits = body()
            self._pool = graph.pool()
            bk.graph = graph
        self.buckets[b] = bk
        return bk
