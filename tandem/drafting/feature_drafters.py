"""The drafter over a feature drafter (an EAGLE-3 head or a block drafter), on a runner sized
for it: one construction for the single-request loop, the batched engine and hybrid targets."""
from __future__ import annotations

from typing import Callable

from tandem.config import SpecConfig
from tandem.runtime.runner import ModelRunner


def feature_drafter(draft_model, spec: SpecConfig, chain: bool, target_rows: int,
                    runner: Callable[[object, int], ModelRunner]):
    """An EagleDrafter over an Eagle3Head or a LatticeDrafter over a BlockDrafter (None for any
    other draft); `runner(model, rows)` makes (or reuses) the runner, `target_rows` being the
    target cache's rows, which the drafter's own rows follow."""
    from tandem.drafting.eagle_drafter import EagleDrafter
    from tandem.drafting.lattice_drafter import LatticeDrafter
    from tandem.models.block_drafter import BlockDrafter
    from tandem.models.eagle3 import Eagle3Head

    if isinstance(draft_model, Eagle3Head):
        return EagleDrafter(runner(draft_model, target_rows + EagleDrafter.rows_needed(spec)), spec, chain)
    if isinstance(draft_model, BlockDrafter):
        rows = target_rows + 2 * draft_model.bconfig.block_size + spec.nodes + spec.k
        return LatticeDrafter(runner(draft_model.lattice_model(), rows), spec, chain)
    return None
