"""Host-to-device copies that do not wait for the device.

A plain copy from pageable host memory (`torch.tensor(values, device="cuda")`, `t.to("cuda")`)
synchronizes its stream: the host stalls until every kernel queued before it has run. An engine
step that queues the next step's drafting and then keeps books on the host (EngineConfig.draft_ahead)
loses the overlap at the first such copy. Here the values go through pinned memory and an
asynchronous copy; PyTorch's pinned-memory allocator holds the host block until the copy has run,
so the caller may drop it at once.
"""
from __future__ import annotations

import numpy as np
import torch


def download(t: torch.Tensor) -> "tuple[torch.Tensor, torch.cuda.Event | None]":
    """A copy of `t` on the host, queued behind the stream's work -> (the copy, an event after
    it: read the copy once the event is done; None off CUDA, where the copy is made at once).
    The host keeps working meanwhile; later work may overwrite `t`."""
    if t.device.type != "cuda":
        return t.clone(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def upload(values: "list[int] | np.ndarray", device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """values on `device` as `dtype`, queued behind the stream's work rather than waiting for it."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    host = torch.as_tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True)
