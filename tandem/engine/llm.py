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
        cfg = engine_config or EngineConfig()
        # the config's method where it names one (its default says nothing), else the pair's
        named = cfg.method if cfg.method != EngineConfig().method else None
        if method is not None and named is not None and method != named:
            raise ConfigError(f"method={method!r} and engine_config.method={named!r} differ; give the method once")
        method = method or named or ("tree" if draft is not None or bundled else "ar")
        pair = load_pair(target, draft, device, dtype, need_draft=method != "ar")
        cfg = replace(cfg, method=method, spec=spec or cfg.spec)
        self.tokenizer = pair.tokenizer
        self.engine = Engine(pair.target, pair.draft, pair.tokenizer, cfg)

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Decode every prompt together (continuous batching); outputs in prompt order. A prompt is
        text, or token ids (a list of ints; a list of such lists for several)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; give one or one each")
        reqs = []
        try:
            for prompt, p in zip(prompts, plist):
                ids, kw = self._ids(prompt)
                reqs.append(self.engine.add_request(ids, p, **kw))
            by_id = {o.request_id: o for o in self.engine.run()}
        except BaseException:
            for r in reqs:  # leave the engine empty for the next call
                self.engine.abort(r.request_id)
            raise
        return [by_id[r.request_id] for r in reqs]

    def _ids(self, prompt) -> tuple[list[int], dict]:
        """A prompt -> (its token ids, add_request's keywords); ConfigError for anything else."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids, {"prompt": prompt}
        if isinstance(prompt, (list, tuple)):
            return list(prompt), {}  # (add_request checks the ids: ints in the vocabulary)
        raise ConfigError(f"a prompt is text or a list of int token ids (got {type(prompt).__name__} {str(prompt)[:40]})")
