"""Serial best-first trees (method `tree`) through the evolving tree cache.

Each pass: grow the tree until depth x width nodes are fed (the draft's work per tree; on the
device path that is one host sync, see tandem.drafting.device_rounds), send the N most probable
nodes, then re-root at the target's answer. A fed subtree under the answer survives the
re-root with its K/V, so the next tree starts part grown. Method `async` runs the same tree and
adds expansion rounds while the target verifies (tandem.runtime.async_decode).
"""
from __future__ import annotations

from tandem.config import SpecConfig
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree
from tandem.drafting.evolving import EvolvingTree
from tandem.verify.verifier import VerifyResult


def tree_rows(spec: SpecConfig) -> int:
    """Tree-region rows a serial tree needs: the fed nodes, plus a round of slack."""
    return spec.resolved_depth() * spec.width + 2 * spec.width


class TreeDrafter:
    def __init__(self, runner: ModelRunner, spec: SpecConfig):
        self.tree = EvolvingTree(runner, spec.width, max_rows=tree_rows(spec))
        self.nodes, self.fed = spec.nodes, spec.resolved_depth() * spec.width

    @property
    def steps(self) -> int:
        return self.tree.steps

    def start(self, prompt: list[int]) -> None:
        self.tree.start(prompt)

    def propose(self) -> DraftTree:
        self.tree.grow(self.nodes, self.fed)
        return self.tree.select(self.nodes)

    def observe(self, result: VerifyResult, tree: DraftTree) -> None:
        self.tree.reroot(result.tokens)
