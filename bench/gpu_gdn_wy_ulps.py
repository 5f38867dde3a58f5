"""How far the Triton GDN WY kernel's outputs and committed state sit from the path kernel's, in bf16 ulps of
the path kernel's values (SpecPilot s4.2 keeps its WY kernel within one), by pieces a product and by how the
piece products accumulate (SEP: each into a zero accumulator, summed in fp32; else chained through the tensor
cores' accumulator), beside the torch WY form (fp32 matmuls, TF32 off), at the GPU lane's inputs (32 heads of
128 x 128, a 32-node best-first-like tree). Also where the worst element is: its value and the output's scale.

    python bench/gpu_gdn_wy_ulps.py        (CUDA)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
from test_gpu_gdn_path import _inputs, _tree  # noqa: E402

from tandem.kernels.gdn import gdn_tree_wy, gdn_wy_commit  # noqa: E402
from tandem.kernels.gdn_path import gdn_path_commit, gdn_path_tree, root_paths  # noqa: E402
from tandem.kernels.gdn_wy import bf16_ulps, gdn_wy_commit_, gdn_wy_tree  # noqa: E402
from tandem.tree.draft_tree import ancestor_mask  # noqa: E402


def ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    u = bf16_ulps(a, b)
    i = int(u.argmax())
    return u.max().item(), b.flatten()[i].item(), b.abs().max().item()


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_grad_enabled(False)
    for n, seed in ((32, 7), (16, 3), (64, 5)):
        parents = _tree(n, seed)
        S0, q, k, v, decay, beta = _inputs(n, seed)
        paths, lens = (t.cuda() for t in root_paths(parents))
        o_path = gdn_path_tree(S0, q, k, v, decay, beta, paths, lens)
        S_path = gdn_path_commit(S0.clone(), k, v, decay, beta, paths, lens, n - 1)
        path = [int(x) for x in paths[n - 1, :int(lens[n - 1])]]
        on = torch.zeros(n, dtype=torch.bool, device="cuda")
        on[path] = True
        anc = ancestor_mask(parents, "cuda")
        o, U, G = gdn_tree_wy(S0, q, k, v, decay, beta, anc)
        S = gdn_wy_commit(S0, k, U, G, path)
        print(f"N={n} torch WY: outputs {ulps(o, o_path)}, state {ulps(S, S_path)}  (ulps, value there, max |value|)")
        for pieces in (3, 2):
            for sep in (True, False):
                o, U, G = gdn_wy_tree(S0, q, k, v, decay, beta, anc, pieces=pieces, sep=sep)
                S = gdn_wy_commit_(S0.clone(), k, U, G, on, n - 1, pieces=pieces, sep=sep)
                print(f"N={n} Triton WY pieces={pieces} sep={sep}: outputs {ulps(o, o_path)}, state {ulps(S, S_path)}",
                      flush=True)


if __name__ == "__main__":
    main()
