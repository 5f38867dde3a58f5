"""The batched engine: many requests decoded together, one target pass per step.

    request.py        SamplingParams, Request (state, output, per-request figures)
    config.py         EngineConfig (frozen): method, pool size, token budget
    scheduler.py      waiting / running queues -> one StepPlan per step (chunked prefill, preemption)
    batched_model.py  one target forward over every scheduled request's rows, over paged KV
    invariant.py      batch-invariant arithmetic for deterministic mode (fixed-shape products, per-row attention)
    engine.py         Engine.add_request / step / abort: draft, verify, commit, emit; counters
    batch_manager.py  batch parallelism (MineDraft): two batches, one verified while the other drafts
    row_selection.py  batch-aware row selection (SpecPilot): one node budget per step, a row cost model
    draft_gate.py     whether a step drafts at all: drafting cost against the tokens it returns
    batched_draft.py  a draft model's chains and trees drafted for every request at once (its own paged
                      pool); the level tree captured whole per request bucket on a GPU
    batched_features.py  the same for feature drafters: an EAGLE-3 head's level trees, a block drafter's lattices
    draft_length.py   a per-request draft length, from the request's calibrated draft confidence
    llm.py            tandem.LLM(...).generate(prompts, SamplingParams(...)), the offline API

The paged KV pool itself is tandem.kv.paged.
"""


from tandem.config import lazy_exports

__all__ = ["Engine", "EngineConfig", "LLM", "SamplingParams"]
# lazy: `from tandem.engine import Engine` without importing every engine module for one submodule
__getattr__ = lazy_exports(__name__, {"Engine": "tandem.engine.engine", "EngineConfig": "tandem.engine.config",
                                      "LLM": "tandem.engine.llm", "SamplingParams": "tandem.engine.request"})
