"""`tandem.LLM`: the offline Python API, in the shape vLLM users know.

    from tandem import LLM, SamplingParams
    llm = LLM()                                   # the bundled pair (method tree on a GPU, ar on the CPU)
    outs = llm.generate(["def fib(n):", "import os"], SamplingParams(max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].figures.ttft
    outs[0].outputs[0].text                       # vLLM's shape too
"""
from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from tandem.config import ConfigError, SpecConfig
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import RequestOutput, SamplingParams

log = logging.getLogger("tandem")

# dtype names vLLM and Hugging Face users write -> Tandem's
DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "half": "float16", "fp16": "float16"}


def dtype_name(dtype: str, device: str) -> str:
    """dtype as vLLM takes it ("auto": bfloat16 on a GPU, float32 on the CPU) -> Tandem's name."""
    if dtype == "auto":
        return "bfloat16" if str(device).startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


class LLM:
    """target / draft: checkpoint folders (default: the bundled pair; `model` is vLLM's name for
    target). `method`: ar | chain | tree (default: tree with a draft; the bundled pair: tree on a
    GPU, ar on the CPU; ar without a draft);
    `engine_config` overrides the engine's knobs."""

    def __init__(self, target: str | Path | None = None, draft: str | Path | None = None, device: str = "cpu",
                 dtype: str = "float32", method: str | None = None, spec: SpecConfig | None = None,
                 engine_config: EngineConfig | None = None, *, model: str | Path | None = None):
        from tandem.runtime.pair import load_pair

        if model is not None:
            if target is not None:
                raise ConfigError("model and target name the same checkpoint; give one")
            target = model
        bundled = target is None
        cfg = engine_config or EngineConfig()
        # the config's method where it names one (its default says nothing), else the pair's
        named = cfg.method if cfg.method != EngineConfig().method else None
        if method is not None and named is not None and method != named:
            raise ConfigError(f"method={method!r} and engine_config.method={named!r} differ; give the method once")
        # (tree with a draft given; the bundled pair: tree on a GPU, ar on the CPU, where the engine's
        # tree lost to ar at every concurrency: tandem.serve.config.default_methods)
        method = method or named or ("tree" if draft is not None or (bundled and str(device).startswith("cuda"))
                                     else "ar")
        pair = load_pair(target, draft, device, dtype_name(dtype, device), need_draft=method != "ar")
        cfg = replace(cfg, method=method, spec=spec or cfg.spec)
        self.tokenizer = pair.tokenizer
        self.engine = Engine(pair.target, pair.draft, pair.tokenizer, cfg)

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Decode every prompt together (continuous batching); outputs in prompt order. A prompt is
        text, token ids (a list of ints), or vLLM's {"prompt": text} / {"prompt_token_ids": ids};
        several prompts come as a list of those. A prompt's SamplingParams.n > 1 runs n requests (seeds
        seed, seed + 1, ... when one is given); its output holds them as outputs[0..n-1] (`samples`).
        use_tqdm: a progress bar on stderr (requests done)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; give one or one each")
        if any(p.n > 1 and p.temperature == 0 for p in plist):  # (a pass@k harness that left temperature unset)
            log.warning("n > 1 with temperature 0 gives n equal greedy completions; set temperature > 0 to sample "
                        "(SamplingParams' default is greedy, vLLM's is 1.0)")
        reqs, groups = [], []  # groups: each prompt's requests (n of them)
        try:
            for prompt, p in zip(prompts, plist):
                ids, kw = self._ids(prompt)
                group = [self.engine.add_request(ids, replace(p, n=1, seed=None if p.seed is None else p.seed + i),
                                                 **kw) for i in range(p.n)]
                reqs += group
                groups.append(group)
            short = [r for r in reqs if r.params.max_tokens is not None and r.max_new < r.params.max_tokens]
            if short:  # (as `tandem generate` notes it: the output ends at the context window)
                log.warning("max_tokens lowered for %d prompt(s) to what the context window (%d tokens) leaves "
                            "after each prompt (%s)", len(short), self.engine.context_window,
                            ", ".join(f"{r.params.max_tokens} -> {r.max_new}" for r in short[:3])
                            + (", ..." if len(short) > 3 else ""))
            by_id = {o.request_id: o for o in self._run(len(reqs), use_tqdm)}
        except BaseException:
            for r in reqs:  # leave the engine empty for the next call
                self.engine.abort(r.request_id)
            raise
        return [replace(by_id[g[0].request_id], samples=tuple(by_id[r.request_id] for r in g[1:])) for g in groups]

    def _run(self, n: int, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        with tqdm(total=n, desc="Processed requests", unit="req", file=sys.stderr, disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            return self.engine.run(on_step=lambda done: bar.update(len(done)) if done else None)

    def _ids(self, prompt) -> tuple[list[int], dict]:
        """A prompt -> (its token ids, add_request's keywords); ConfigError for anything else."""
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1 or set(prompt) - keys:
                raise ConfigError('a prompt dict holds one key, "prompt" (text) or "prompt_token_ids" '
                                  f"(got keys {sorted(prompt)})")
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
            if isinstance(prompt, str) != ("prompt" in keys):
                raise ConfigError('"prompt" takes text and "prompt_token_ids" a list of ints')
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids, {"prompt": prompt}
        if isinstance(prompt, (list, tuple)):
            return list(prompt), {}  # (add_request checks the ids: ints in the vocabulary)
        raise ConfigError(f"a prompt is text, a list of int token ids, or a dict with 'prompt' or "
                          f"'prompt_token_ids' (got {type(prompt).__name__} {str(prompt)[:40]})")
