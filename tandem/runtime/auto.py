"""`--method auto`: pick the fastest method and shape for this engine, plain `ar` included.

The cost model of SpecPilot: a speculative method's rate is tau / (t_draft + t_verify(N)) and
`ar`'s is 1 / t_ar; speculation pays only when the ratio is above 1. Both depend on the pair,
the device and the workload, so they are measured rather than assumed. On the first `auto`
request (and a few after it) the engine runs a short trial on that request's prompt:

1. **Measured.** `ar`, `chain` (k) and `tree` (N, w, d) as given: decode rate after the first
   token, best of two interleaved runs, graph capture excluded by a warm-up run on CUDA, with
   the request's sampling settings (a sampled draft is accepted less deeply than a greedy one). Each
   run also records its accepted count per pass and its draft and verify time per pass.
2. **Predicted.** A drafter that grows its tree level by level (a small draft model, an EAGLE-3
   head) pays one draft pass per level, so a shallower tree or a shorter chain costs less and
   accepts less. From the measured run of each kind the model predicts every shallower shape
   (`shallower`): tau(d) = 1 + mean(min(accepted, deepest(d))), a lower bound, since a
   shallower tree keeps every node of depth <= d that the deeper one selected (the levels above
   d grow the same way and fewer deep nodes compete for the N), and t_draft(d) = fixed + per
   level x d, the line through the chain's and the tree's measured draft times (`level_costs`;
   in proportion to the levels where they pin no such line). The measured rate, scaled by the
   two ratios, is the prediction.
3. **Confirmed.** The predicted shapes that would beat every measured rate are measured too
   (at most `confirm` of them, best first), and so are the ones confirmed in earlier trials.

Trials run on requests 1, 2 and 4, then every `retrial_every`, each on its own request's prompt;
the best score over the last `window` trials wins (`AutoSelector.scores`).

The choice is printed with the measured and predicted rates. Later requests run their own spec
cut to the chosen depth or length, and update the chosen candidate's running rate; when it
falls below `fallback` x `ar`'s (a workload the drafter does not know), the next request runs
`ar` until the next trial. `--method` overrides all of it; `--k`,
`--nodes`, `--width` and `--depth` bound the shapes it tries.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from tandem.config import GenerationConfig, SamplingConfig, SpecConfig


@dataclass(frozen=True)
class Candidate:
    """A method and the shape it runs with."""

    method: str  # ar | chain | tree
    spec: SpecConfig
    label: str  # "ar", "chain", "tree" for the shapes as given; "chain k=2", "tree d=3" for shallower ones


@dataclass
class TrialRun:
    """One candidate's trial: what was measured, and what the cost model reads."""

    rate: float  # decode tokens/s, best of the runs
    accepts: list[int] = field(default_factory=list)  # accepted drafts per pass, every run
    draft_per_pass: float | None = None  # seconds (device time on the GPU)
    verify_per_pass: float | None = None
    deepest: int = 0  # the deepest depth any of its trees offered


@dataclass
class AutoChoice:
    method: str
    rates: dict[str, float]  # decode tokens/s measured per candidate label in the last trial
    reason: str
    spec: SpecConfig | None = None  # the chosen shape (None: the spec the request came with)
    label: str = ""  # the chosen candidate's label ("" : the method's name)
    predicted: dict[str, float] = field(default_factory=dict)  # the cost model's rates, per label

    def __post_init__(self):
        self.label = self.label or self.method


def cut(method: str, spec: SpecConfig, levels: int) -> Candidate:
    """`spec`'s chain cut to length `levels` ("chain k=2") or its tree to depth `levels` ("tree d=3")."""
    if method == "chain":
        return Candidate("chain", dataclasses.replace(spec, k=levels), f"chain k={levels}")
    return Candidate("tree", dataclasses.replace(spec, depth=levels), f"tree d={levels}")


def cut_to(spec: SpecConfig, c: Candidate) -> SpecConfig:
    """`spec` cut to the depth or length of `c` where `c` is a shallower shape ("tree d=3",
    "chain k=2"); `spec` itself for the shapes as given."""
    if c.label == c.method:
        return spec
    return cut(c.method, spec, c.spec.k if c.method == "chain" else c.spec.depth).spec


def levels_of(draft_model) -> bool:
    """Whether this drafter pays one draft pass per tree level (a small draft model, an EAGLE-3
    head), so that its tree depth and chain length trade tau for draft time. A block drafter
    proposes every depth in one pass: a shallower shape only accepts less."""
    return draft_model is not None and not hasattr(draft_model, "bconfig")


def level_costs(chain: TrialRun, tree: TrialRun, spec: SpecConfig) -> tuple[float, float] | None:
    """(fixed, per level) seconds of a level drafter's draft per pass, from the chain (k levels)
    and the tree (d levels) measured in one trial: t = fixed + per_level x levels, the width of a
    level being nearly free where passes are launch- or weight-bound. None when the two runs do
    not pin a line with both parts >= 0 (then the draft time is taken in proportion)."""
    k, d = spec.k, spec.resolved_depth()
    if k == d or not chain.draft_per_pass or not tree.draft_per_pass:
        return None
    per = (tree.draft_per_pass - chain.draft_per_pass) / (d - k)
    fixed = chain.draft_per_pass - per * k
    return (fixed, per) if per > 0 and fixed >= 0 else None


def shallower(base: Candidate, run: TrialRun, costs: tuple[float, float] | None = None) -> list[tuple[Candidate, float]]:
    """The chains shorter and the trees shallower than `base` that a level drafter can run, each
    with its predicted decode rate (see the module doc); `costs` (level_costs) replaces the draft
    time in proportion to the levels. Empty when the run lacks the figures."""
    if base.method not in ("chain", "tree") or not run.accepts or run.rate <= 0 or not run.draft_per_pass \
            or run.verify_per_pass is None or run.deepest < 2:
        return []
    spec = base.spec
    levels = spec.k if base.method == "chain" else spec.resolved_depth()
    t_base = run.draft_per_pass + run.verify_per_pass
    tau_base = 1 + sum(min(a, run.deepest) for a in run.accepts) / len(run.accepts)
    out = []
    for d in range(1, levels):
        deepest = max(1, round(run.deepest * d / levels))  # the deepest node a shape of d levels offers
        tau = 1 + sum(min(a, deepest) for a in run.accepts) / len(run.accepts)
        draft = run.draft_per_pass * d / levels if costs is None else \
            run.draft_per_pass + costs[1] * (d - levels)  # the measured pass less the levels not run
        t = draft + run.verify_per_pass
        out.append((cut(base.method, spec, d), run.rate * (tau / tau_base) * (t_base / t)))
    return out


@dataclass
class AutoSelector:
    """The trials' record and the choice. A trial is paired (every candidate on one prompt), so
    each candidate's figure is its rate over `ar`'s in that trial; the choice is the best score
    (`scores`: mean ratios, paired differences for cut shapes) over the last `window` trials. One
    prompt can mislead (its acceptance may be far from the workload's), so trials run on
    requests 1, 2 and 4, then every `retrial_every`."""

    trial_tokens: int = 24
    retrial_every: int = 32
    early_trials: tuple[int, ...] = (1, 2, 4)
    window: int = 8  # trials whose ratios are averaged
    ema: float = 0.5  # weight of the newest request in the running rates
    fallback: float = 0.9  # run ar when the chosen candidate's running rate drops below this x ar's
    confirm: int = 2  # predicted shapes measured at most per trial
    choice: AutoChoice | None = None
    requests: int = 0
    rates: dict[str, float] = field(default_factory=dict)  # running decode rate per candidate label
    trials: list[dict[str, float]] = field(default_factory=list)  # per trial: label -> rate / ar's rate
    shapes: dict[str, Candidate] = field(default_factory=dict)  # every candidate measured so far
    verbose: bool = True

    @property
    def ratios(self) -> dict[str, list[float]]:
        """label -> its ratio to ar in each of the kept trials that measured it."""
        out: dict[str, list[float]] = {}
        for t in self.trials:
            for label, r in t.items():
                out.setdefault(label, []).append(r)
        return out

    def scores(self) -> dict[str, float]:
        """Each candidate's expected ratio to ar. `ar`, `chain` and `tree` run in every trial: their
        mean. A cut shape joins later (once predicted and confirmed), so it may have missed the
        prompts where drafting did badly: its score is its method's mean plus its mean difference
        from its method on the trials that measured both (a paired difference, not a mean over
        easier prompts)."""
        ratios = self.ratios
        out = {label: sum(v) / len(v) for label, v in ratios.items() if label == self.shapes[label].method}
        for label, v in ratios.items():
            base = self.shapes[label].method
            if label != base:
                diffs = [t[label] - t[base] for t in self.trials if label in t and base in t]
                out[label] = out[base] + sum(diffs) / len(diffs)
        return out

    def candidates(self, has_draft: bool, spec: SpecConfig) -> list[Candidate]:
        base = [Candidate("ar", spec, "ar")]
        return base + [Candidate("chain", spec, "chain"), Candidate("tree", spec, "tree")] if has_draft else base

    def choose(self, generator, prompt_ids: list[int], spec: SpecConfig, sampling: SamplingConfig) -> Candidate:
        self.requests += 1
        if self.choice is None or self.requests in self.early_trials or self.requests % self.retrial_every == 0:
            self.choice = self._trial(generator, prompt_ids, spec, sampling)
            if self.verbose:
                print(f"tandem: auto: {self.choice.reason}", file=sys.stderr)
        c = self.choice
        # the request's own spec, cut to the chosen depth or length when a shallower shape won
        shaped = spec if c.spec is None else cut_to(spec, Candidate(c.method, c.spec, c.label))
        chosen = Candidate(c.method, shaped, c.label)
        if chosen.method != "ar" and self.rates.get(chosen.label, 0.0) < self.fallback * self.rates.get("ar", 0.0):
            # the drafter stopped paying on this workload: plain decoding until the next trial
            return Candidate("ar", chosen.spec, "ar")
        return chosen

    def reset(self) -> None:
        """Forget the trials, the choice and the running rates (not which shapes exist): the next
        request runs trial 1. `tandem bench` calls it after its warm-up, so that auto's trials run
        on the workload's requests, as a server's first requests would, rather than on the
        warm-up's longest prompts."""
        self.choice, self.requests, self.rates, self.trials = None, 0, {}, []

    def update(self, label: str, decode_tokens_per_s: float) -> None:
        if decode_tokens_per_s <= 0:
            return
        old = self.rates.get(label)
        self.rates[label] = decode_tokens_per_s if old is None else (
            self.ema * decode_tokens_per_s + (1 - self.ema) * old)

    def _trial(self, generator, prompt_ids, spec, sampling) -> AutoChoice:
        cands = self.candidates(generator.draft_model is not None, spec)
        if len(cands) == 1:
            return AutoChoice("ar", {}, "ar (no draft model)", spec)
        # shallower shapes an earlier trial confirmed are measured again (on the current spec)
        cands += [Candidate(c.method, cut_to(spec, c), label) for label, c in self.shapes.items()
                  if label != c.method]
        # a prompt shorter than the window minus the trial's tokens, so each candidate decodes them all
        room = generator.context_window - self.trial_tokens - 1
        ids = prompt_ids[-room:] if room > 0 else prompt_ids[-1:]
        cuda = generator.target_model.device.type == "cuda"
        # on a GPU a trial costs milliseconds: twice the tokens make the rates steadier
        gen = GenerationConfig(max_new_tokens=self.trial_tokens * (2 if cuda else 1), ignore_eos=True)
        # the request's sampling (drafts are accepted less deeply when sampled), its own seed;
        # the trial's tokens are thrown away
        trial = dataclasses.replace(sampling, seed=0)
        def warm(cs: list[Candidate]) -> set[str]:
            # on CUDA a candidate's first run captures its graphs: a warm-up run, in its first trial only
            return {c.label for c in cs if c.label not in self.shapes} if cuda else set()

        runs = self._measure(generator, ids, cands, trial, gen, warm(cands))
        # the cost model's shallower shapes (level drafters; a hybrid target's passes cost by path rows)
        predicted: dict[str, tuple[Candidate, float]] = {}
        if levels_of(generator.draft_model) and not getattr(generator.target_model, "is_hybrid", False):
            costs = level_costs(runs["chain"], runs["tree"], spec)
            for c in cands[:3]:
                for v, r in shallower(c, runs[c.label], costs):
                    if v.label not in runs:
                        predicted[v.label] = (v, r)
        best_measured = max(r.rate for r in runs.values())
        confirm = sorted((p for p in predicted.values() if p[1] > best_measured), key=lambda p: -p[1])[:self.confirm]
        if confirm:
            confirmed = [c for c, _ in confirm]
            runs.update(self._measure(generator, ids, confirmed, trial, gen, warm(confirmed)))
        self.shapes |= {c.label: c for c in cands} | {c.label: c for c, _ in confirm}
        rates = {label: r.rate for label, r in runs.items()}
        ar = rates["ar"] or 1e-9
        # this trial's pairs, the last `window` trials kept
        self.trials = (self.trials + [{label: r / ar for label, r in rates.items()}])[-self.window:]
        mean = self.scores()
        best = self.shapes[max(mean, key=mean.get)]
        # running rates start from the trials', on one scale: ar's rate now times each score
        self.rates = {label: ar * m for label, m in mean.items()}
        detail = ", ".join(f"{m} {r:.0f} tok/s ({r / ar:.2f}x)" for m, r in rates.items())
        extra = ""
        if predicted:
            top = sorted(predicted.items(), key=lambda p: -p[1][1])[:3]
            extra = "; predicted " + ", ".join(f"{m} {r:.0f}" for m, (_, r) in top)
        trials = len(self.trials)
        if trials > 1:
            extra += f"; over {trials} trials: " + ", ".join(f"{m} {v:.2f}x" for m, v in mean.items())
        return AutoChoice(best.method, rates, f"{best.label} (trial {trials}, on request {self.requests}: best of 2 x "
                                              f"{gen.max_new_tokens} tokens each: {detail}{extra}; --method "
                                              f"overrides)", best.spec, best.label,
                          {m: r for m, (_, r) in predicted.items()})

    @staticmethod
    def _measure(generator, ids, cands: list[Candidate], sampling, gen, warm: set[str]) -> dict[str, TrialRun]:
        for c in cands:  # the candidates in `warm` run once unmeasured (their graphs are captured)
            if c.label in warm:
                generator.generate(ids, c.method, c.spec, sampling, gen)
        # two rounds, interleaved, best of two: one slow run (a host hiccup) does not decide
        runs = {c.label: TrialRun(0.0) for c in cands}
        draft = {c.label: [0.0, 0.0, 0] for c in cands}  # draft s, verify s, passes
        for _ in range(2):
            for c in cands:
                res = generator.generate(ids, c.method, c.spec, sampling, gen)
                run = runs[c.label]
                run.rate = max(run.rate, res.decode_tokens_per_s)
                run.accepts += res.accept_lengths
                run.deepest = max(run.deepest, len(res.per_depth))  # (a tree offers every depth 1 .. its deepest)
                if res.draft_seconds is not None and res.verify_seconds is not None and res.target_passes:
                    d = draft[c.label]
                    d[0] += res.draft_seconds
                    d[1] += res.verify_seconds
                    d[2] += res.target_passes
        for label, (ds, vs, n) in draft.items():
            if n:
                runs[label].draft_per_pass, runs[label].verify_per_pass = ds / n, vs / n
        return runs

