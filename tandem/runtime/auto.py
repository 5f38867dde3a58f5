"""`--method auto`: pick the fastest method for this engine, plain `ar` included.

The cost model of SpecPilot: a speculative method's rate is tau / (t_draft + t_verify(N)) and
`ar`'s is 1 / t_ar; speculation pays only when the ratio is above 1. Both depend on the pair,
the device and the workload, so they are measured rather than assumed: on the first `auto`
request the engine runs a short trial of every candidate on that request's prompt (decode
rate after the first token, best of two interleaved runs, graph capture excluded by a warm-up
run on CUDA), keeps the fastest, and prints the choice. Later requests update the chosen method's measured rate; when
it falls below `ar`'s (a workload the drafter does not know), the next request runs `ar`, and
every `retrial_every` requests the trial runs again. `--method` overrides all of it.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from tandem.config import GenerationConfig, SamplingConfig, SpecConfig


@dataclass
class AutoChoice:
    method: str
    rates: dict[str, float]  # decode tokens/s measured per candidate in the last trial
    reason: str


@dataclass
class AutoSelector:
    trial_tokens: int = 24
    retrial_every: int = 32
    ema: float = 0.5  # weight of the newest request in the chosen method's running rate
    choice: AutoChoice | None = None
    requests: int = 0
    rates: dict[str, float] = field(default_factory=dict)  # running decode rate per method
    verbose: bool = True

    def candidates(self, has_draft: bool) -> list[str]:
        return ["ar", "chain", "tree"] if has_draft else ["ar"]

    def choose(self, generator, prompt_ids: list[int], spec: SpecConfig, sampling: SamplingConfig) -> str:
        self.requests += 1
        if self.choice is None or self.requests % self.retrial_every == 0:
            self.choice = self._trial(generator, prompt_ids, spec, sampling)
            if self.verbose:
                print(f"tandem: auto: {self.choice.reason}", file=sys.stderr)
            return self.choice.method
        m = self.choice.method
        if m != "ar" and self.rates.get(m, 0.0) < self.rates.get("ar", 0.0):
            return "ar"  # the drafter stopped paying on this workload: plain decoding until the next trial
        return m

    def update(self, method: str, decode_tokens_per_s: float) -> None:
        if decode_tokens_per_s <= 0:
            return
        old = self.rates.get(method)
        self.rates[method] = decode_tokens_per_s if old is None else (
            self.ema * decode_tokens_per_s + (1 - self.ema) * old)

    def _trial(self, generator, prompt_ids, spec, sampling) -> AutoChoice:
        cands = self.candidates(generator.draft_model is not None)
        if len(cands) == 1:
            return AutoChoice("ar", {}, "ar (no draft model)")
        # a prompt shorter than the window minus the trial's tokens, so each candidate decodes them all
        room = generator.context_window - self.trial_tokens - 1
        ids = prompt_ids[-room:] if room > 0 else prompt_ids[-1:]
        cuda = generator.target_model.device.type == "cuda"
        # on a GPU a trial costs milliseconds: twice the tokens make the rates steadier
        gen = GenerationConfig(max_new_tokens=self.trial_tokens * (2 if cuda else 1), ignore_eos=True)
        greedy = dataclasses.replace(sampling, temperature=0.0)  # the trial's tokens are thrown away
        if cuda:  # first runs capture graphs
            for m in cands:
                generator.generate(ids, m, spec, greedy, gen)
        # two rounds, interleaved, best of two: one slow run (a host hiccup) does not decide
        rates = {m: 0.0 for m in cands}
        for _ in range(2):
            for m in cands:
                rates[m] = max(rates[m], generator.generate(ids, m, spec, greedy, gen).decode_tokens_per_s)
        self.rates = dict(rates)
        best = max(rates, key=rates.get)
        ar = rates["ar"] or 1e-9
        detail = ", ".join(f"{m} {r:.0f} tok/s ({r / ar:.2f}x)" for m, r in rates.items())
        return AutoChoice(best, rates, f"{best} (trial on the first request, best of 2 x {gen.max_new_tokens} "
                                       f"tokens each: {detail}; --method overrides)")
