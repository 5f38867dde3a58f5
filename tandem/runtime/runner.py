"""ModelRunner: one model + its KV cache, and the step every method uses.

A step feeds T rows (tokens at given positions) that attend to the verified prefix and to
tree-region rows picked by a [T, tree_len] mask, writes their K/V into the tree region and
returns their logits. On CUDA the step for a given T is captured once in a CUDA graph per
row bucket (padded rows write a scratch cache row and see only it), so a step costs one graph
launch instead of hundreds of kernel launches from a slow host CPU.
"""
from __future__ import annotations

import os

import torch

from tandem.kv.cache import KVCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class ModelRunner:
    """`use_graphs`: None = CUDA graphs on CUDA; "emulate" = the same bucketed, padded, width-
    bucketed path on any device with an eager call in place of the replay (tests the graph path's
    bookkeeping on the CPU)."""

    def __init__(self, model, capacity: int, use_graphs: bool | str | None = None, buckets=DEFAULT_BUCKETS):
        self.model = model
        self.device = model.device
        if hasattr(model, "fuse_projections"):
            # One q/k/v and one gate/up product per layer (idempotent): at batch 1 a step is
            # dominated by per-call overhead on the CPU and by launches on the GPU.
            model.fuse_projections()
        # +1: the last row is a scratch row that padded (bucket-filling) rows write to.
        self.cache = KVCache.for_model(model, capacity + 1)
        self.cache.capacity = capacity  # the scratch row is never handed out
        self.capacity = capacity
        self.scratch = capacity
        if use_graphs is None:  # TANDEM_CUDA_GRAPHS=0 turns capture off (debugging, A/B timing)
            use_graphs = self.device.type == "cuda" and os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0"
        self.emulate = use_graphs == "emulate"
        self.use_graphs = bool(use_graphs)
        self.buckets = tuple(sorted(buckets))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._pool = None
        # NOTE: each runner captures on its own stream. cuBLAS keys its workspace by (handle,
        # stream), and a graph keeps the workspace of the stream it was captured on; with torch's
        # shared default capture stream, the target's and the draft's graphs used one workspace
        # and corrupted each other's GEMMs when replayed concurrently on two streams (async on
        # the H200 diverged from ar until this).
        self._capture_stream = None
        # state that lives as long as this runner's cache and graphs (e.g. the device rounds of
        # tandem.drafting.device_rounds, keyed by their shape)
        self.attached: dict = {}
        # target features of the rows of the last step [T, F] (a view into a buffer the next
        # step overwrites), when the model keeps them (Transformer.enable_features); else None
        self.last_features: torch.Tensor | None = None
        # [T] argmax of each row's output after a graph step (None after an eager step)
        self.last_argmax: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: list[int], positions: list[int], tree_mask: torch.Tensor) -> torch.Tensor:
        """Feed len(tokens) rows as new tree-region rows; return their logits [T, vocab].

        tree_mask: [T, tree_len_after] bool over the tree region *including* the new rows,
        which occupy its last T columns. The verified prefix is always visible.
        """
        T = len(tokens)
        start = self.cache.reserve_rows(T)
        prefix, tree_len = self.cache.prefix_len, self.cache.tree_len
        assert tree_mask.shape == (T, tree_len), (tree_mask.shape, T, tree_len)
        bucket = None
        if self.use_graphs and tree_len <= 2 * self.buckets[-1] + 2:
            bucket = next((b for b in self.buckets if b >= T), None)
        if bucket is None:
            width = prefix + tree_len
            mask = torch.zeros(T, width, dtype=torch.bool, device=self.device)
            mask[:, :prefix] = True
            mask[:, prefix:] = tree_mask.to(self.device)
            ids = torch.tensor([tokens], device=self.device)
            pos = torch.tensor([positions], device=self.device)
            slots = torch.arange(start, start + T, device=self.device)[None]
            logits = self.model(ids, pos, self.cache, slots, mask[None, None])[0]
            self.last_features = self._features_out()
            self.last_argmax = None
            return logits
        width = self.width_for(prefix + tree_len)
        return self._graph_step(bucket, width, tokens, positions, start, prefix, tree_len, tree_mask)

    def width_for(self, rows: int) -> int:
        """Attention reads the cache up to a width bucket (powers of two from 256), not the whole
        capacity: the bucket that covers `rows` used rows."""
        return min(self.capacity + 1, max(256, 1 << (rows - 1).bit_length()))

    def widths(self) -> list[int]:
        """Every attention width `width_for` can return for this runner's capacity."""
        return sorted({self.width_for(rows) for rows in range(1, self.capacity + 1)})

    def capture_stream(self) -> torch.cuda.Stream:
        """This runner's capture stream (see the NOTE in __init__); other graphs that use this
        runner's model and cache (tandem.drafting.device_rounds) capture on it too."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device=self.device)
        return self._capture_stream

    def graph_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    # ------------------------------------------------------------------------------------
    def _features_out(self) -> torch.Tensor | None:
        feats = getattr(self.model, "last_features", None) if getattr(self.model, "feature_layers", None) else None
        return None if feats is None else feats[0]  # [T, F]

    def _graph_step(self, bucket, width, tokens, positions, start, prefix, tree_len, tree_mask):
        # NOTE: graphs are keyed by whether the model keeps features too: a graph captured before
        # a feature drafter turned them on would not write them
        key = (bucket, width, bool(getattr(self.model, "feature_layers", None)))
        if key not in self._graphs:
            self._capture(bucket, width)
        graph, buf = self._graphs[key]
        T = len(tokens)
        # The inputs travel in one pinned copy (ids, positions, slots, the counters and the tree
        # mask, written through numpy views: a few microseconds of host time); the mask over the
        # cache is assembled inside the graph (`_body`).
        # NOTE: the copy is asynchronous, so before the host buffer is rewritten the previous
        # copy out of it must have run (callers may queue several steps without a sync).
        if buf["staged"] is not None:
            buf["staged"].synchronize()
        ints, hmask = buf["np_ints"], buf["np_mask"]
        ints[0, :T] = tokens
        ints[1, :T] = positions
        ints[2, :T] = range(start, start + T)
        ints[2, T:bucket] = self.scratch
        ints[3, :3] = prefix, tree_len, T
        hmask[:T, :tree_len] = tree_mask.cpu().numpy()  # [T, tree_len] (a host tensor: no copy)
        pin = not self.emulate
        buf["dev"].copy_(buf["host"], non_blocking=pin)
        if pin:
            buf["staged"] = torch.cuda.Event()
            buf["staged"].record()
        if graph is None:  # emulation: the captured body, run eagerly on the same static buffers
            self._body(buf)
        else:
            graph.replay()
        self.last_features = None if buf["features"] is None else buf["features"][:T]
        self.last_argmax = buf["argmax"][:T]
        return buf["logits"][0, :T]

    def _body(self, buf: dict) -> None:
        """What a step's graph runs: the attention mask from the copied counters and tree mask,
        the model, and the argmax of every row (greedy verification reads only that)."""
        ints, dmask, cols = buf["dev_ints"], buf["dev_mask"], buf["cols"]  # [4, b], [b, MAXT], [width]
        prefix, tree_len, T = ints[3, 0], ints[3, 1], ints[3, 2]
        tcol = cols - prefix  # [width] tree-region column, < 0 in the prefix
        in_tree = (tcol >= 0) & (tcol < tree_len)
        bucket, maxt = dmask.shape
        tree = dmask.gather(1, tcol.clamp(0, maxt - 1).expand(bucket, -1)) & in_tree  # [b, width]
        m = (cols < prefix) | tree
        # padded rows (writing the scratch row) see column 0 only: no empty softmax row
        m = torch.where(buf["rows"][:, None] < T, m, cols == 0)  # [b, width]
        b = slice(0, bucket)
        buf["logits"] = self.model(ints[0:1, b], ints[1:2, b], self.cache, ints[2:3, b], m[None, None])
        buf["features"] = self._features_out()
        buf["argmax"] = buf["logits"][0].argmax(-1)  # [b]

    @torch.no_grad()
    def _capture(self, bucket: int, width: int) -> None:
        dev = self.device
        maxt = self.buckets[-1] * 2 + 2  # tree-region columns a graph step can see
        cols = max(bucket, 3)  # row 3 holds the three counters even in a 1-row bucket
        n_int = 4 * cols * 8  # bytes of the [4, cols] int64 block
        host = torch.zeros(n_int + bucket * maxt, dtype=torch.uint8)
        if not self.emulate:
            host = host.pin_memory()
        dev_u8 = torch.zeros_like(host, device=dev)
        buf = {
            "host": host,
            "dev": dev_u8,
            # views: [4, bucket] int64 (ids, positions, slots; prefix, tree_len, T) and the mask
            "np_ints": host[:n_int].view(torch.int64).view(4, cols).numpy(),
            "np_mask": host[n_int:].view(torch.bool).view(bucket, maxt).numpy(),
            "dev_ints": dev_u8[:n_int].view(torch.int64).view(4, cols),
            "dev_mask": dev_u8[n_int:].view(torch.bool).view(bucket, maxt),
            "cols": torch.arange(width, device=dev),
            "rows": torch.arange(bucket, device=dev),
            "staged": None,  # event recorded after the last host-to-device copy of the inputs
            "features": None,  # [bucket, F] target features written by the graph, if the model keeps them
        }
        key = (bucket, width, bool(getattr(self.model, "feature_layers", None)))
        buf["np_ints"][2, :bucket] = self.scratch
        buf["dev"].copy_(buf["host"])
        if self.emulate:
            self._graphs[key] = (None, buf)
            return
        s = self.capture_stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up outside capture (cuBLAS handles, Triton compilation)
                self._body(buf)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool(), stream=s):
            self._body(buf)
        self._graphs[key] = (graph, buf)

    def warmup(self, sizes=(1,), widths: tuple[int, ...] = ()) -> None:
        """Capture the graphs for these row counts ahead of time (no effect on CPU)."""
        if not self.use_graphs:
            return
        for T in sizes:
            b = next((b for b in self.buckets if b >= T), None)
            for w in widths or (self.capacity + 1,):
                if b is not None and (b, w, bool(getattr(self.model, "feature_layers", None))) not in self._graphs:
                    self._capture(b, w)

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens: list[int], chunk: int = 512) -> torch.Tensor | None:
        """Append tokens to the verified prefix (causal); returns the last row's logits [vocab].
        When the model keeps target features, `last_features` holds all the tokens' [T, F]."""
        logits = None
        feats = []
        self.last_features = None
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            start = self.cache.prefix_len
            T = len(part)
            causal = torch.ones(T, T, dtype=torch.bool).tril()  # host-built, like every step's mask
            out = self.step(part, list(range(start, start + T)), causal)
            self.cache.commit(list(range(T)))
            logits = out[-1]
            if self.last_features is not None:
                feats.append(self.last_features.clone())  # the buffer is reused by the next chunk
        if feats:
            self.last_features = torch.cat(feats)  # [len(tokens), F]
        return logits


def runner_for(runners: dict | None, key: str, model, rows: int, use_graphs: bool | None) -> ModelRunner:
    """The runner kept under `key` in a caller's `runners` dict (its cache and CUDA graphs outlive
    requests), replaced when it serves another model or holds fewer than `rows` rows; its cache
    is emptied for the new request."""
    r = None if runners is None else runners.get(key)
    if r is None or r.model is not model or r.capacity < rows:
        r = ModelRunner(model, rows, use_graphs=use_graphs)
        if runners is not None:
            runners[key] = r
    r.cache.truncate(0)
    return r
