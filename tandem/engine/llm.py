"""`tandem.LLM`: the offline Python API, in the shape vLLM users know.

    from tandem import LLM, SamplingParams
    llm = LLM()                                   # the bundled pair, method tree
    outs = llm.generate(["def fib(n):", "import os"], SamplingParams(max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].figures.ttft
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from tandem.config import ConfigError, SpecConfig
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import RequestOutput, SamplingParams


class LLM:
    """target / draft: checkpoint folders (default: the bundled pair). `method`: ar | chain | tree
    (default: tree with a draft, ar without one); `engine_config` overrides the engine's knobs."""

    def __init__(self, target: str | Path | None = None, draft: str | Path | None = None, device: str = "cpu",
                 dtype: str = "float32", method: str | None = None, spec: SpecConfig | None = None,
                 engine_config: EngineConfig | None = None):
        from tandem.runtime.pair import load_pair

        bundled = target is None
        if method is None:
            method = "tree" if draft is not None or bundled else "ar"
        pair = load_pair(target, draft, device, dtype, need_draft=method != "ar")
        cfg = engine_config or EngineConfig()
        cfg = replace(cfg, method=method, spec=spec or cfg.spec)
        self.tokenizer = pair.tokenizer
        self.engine = Engine(pair.target, pair.draft, pair.tokenizer, cfg)

    def generate(self, prompts: str | Sequence[str], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Decode every prompt together (continuous batching); outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; give one or one each")
        reqs = []
        try:
            for text, p in zip(prompts, plist):
                reqs.append(self.engine.add_request(self.tokenizer.encode(text).ids, p, prompt=text))
            by_id = {o.request_id: o for o in self.engine.run()}
        except BaseException:
            for r in reqs:  # leave the engine empty for the next call
                self.engine.abort(r.request_id)
            raise
        return [by_id[r.request_id] for r in reqs]
