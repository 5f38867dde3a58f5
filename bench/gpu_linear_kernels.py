"""Which kernels (and device copies) one F.linear launches at one and at 33 rows, for the bundled target's
o_proj / down_proj and the Llama-3-8B o_proj (torch profiler, eager). Written to find the source of the
"Memcpy DtoD" lines in the resident loop's profiles: F.linear makes none (one H100, 2026-12-06: one cuBLAS
kernel, plus a split-K reduce at 4096 x 4096); they were bench/gpu_profile_resident.py's own state restores.
    python bench/gpu_linear_kernels.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

torch.set_grad_enabled(False)
for rows, n, k in ((1, 384, 384), (33, 384, 1024), (1, 4096, 4096)):
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        F.linear(x, w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            F.linear(x, w)
        F.linear(x[None], w)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"F.linear [{rows}, {k}] x [{n}, {k}] (4 calls 2-D, 1 call 3-D):", {nm[:60]: names.count(nm) for nm in set(names)})
