"""Emitter: committed tokens cut at EOS / stop string / max_new_tokens, streamed, with the
per-pass figures; the serial loop, the async workers, the hybrid loop and the engine emit through it."""
from __future__ import annotations

import time

from tandem.config import GenerationConfig
from tandem.runtime.result import GenerationResult
from tandem.tree.draft_tree import DraftTree
from tandem.verify.verifier import VerifyResult


class Emitter:
    """Cuts committed tokens at EOS / stop string / max_new_tokens, streams them and records the
    per-pass figures; the serial loop and the async workers both emit through it."""

    def __init__(self, max_new: int, eos: set[int], gen: GenerationConfig, tokenizer, on_tokens, t0: float):
        self.max_new, self.eos, self.gen, self.tokenizer, self.on_tokens, self.t0 = \
            max_new, eos, gen, tokenizer, on_tokens, t0
        self.out: list[int] = []
        self.accept_lengths: list[int] = []
        self.per_depth: dict[int, list[int]] = {}  # depth -> [passes offering it, passes accepting it]
        self.ttft = 0.0
        self.finish = "length"
        self.stop_text: str | None = None
        self.stop_string: str | None = None  # the stop string that ended the output (the first found)

    def emit(self, tree: DraftTree, result: VerifyResult, deepest: int | None = None) -> bool:
        """Record one pass; returns True when generation is over. deepest: the depth of the
        tree's deepest node, when the caller has it (the engine's packing computes every node's
        depth); a tree is prefix-closed, so it offers every depth 1 .. deepest."""
        if deepest is None:
            deepest = max(tree.depth) if len(tree.tokens) > 1 else 0  # (the root alone: no depth offered)
        return self.emit_pass(result.tokens, result.accepted, range(1, deepest + 1))

    def emit_pass(self, tokens: list[int], accepted: int, depths: set[int] | range) -> bool:
        """Record one pass that committed `tokens` (accepted drafts, then the bonus) from a tree
        offering nodes at `depths`; returns True when generation is over."""
        for k in depths:  # per depth: offered, and accepted that deep (the verifier's view: before any cut)
            rec = self.per_depth.setdefault(k, [0, 0])
            rec[0] += 1
            rec[1] += int(accepted >= k)
        new = tokens[: self.max_new - len(self.out)]
        for i, t in enumerate(new):
            if t in self.eos:
                new, self.finish = new[: i + 1], "eos"
                break
        start = len(self.out)
        self.out += new
        if not self.ttft:
            self.ttft = time.perf_counter() - self.t0
        # a stop string before the EOS ends it there, as in `ar`; a stop cuts self.out back before streaming
        done = self._stopped(len(new)) or self.finish == "eos"
        # the drafts among the tokens kept (max_tokens, EOS or a stop may cut the pass short): so accepted
        # tokens never exceed the tokens a request reports
        self.accept_lengths.append(min(accepted, len(self.out) - start))
        if self.on_tokens is not None:
            self.on_tokens(self.out[start:])
        return done or len(self.out) >= self.max_new

    def emit_token(self, t: int) -> bool:
        """emit_pass([t], 0, ()) of a pass that committed one token and offered no draft (the
        engine's plain steps: at 64 requests the general path's per-request calls were a tenth
        of a step's host time)."""
        self.accept_lengths.append(0)
        out = self.out
        if len(out) >= self.max_new:
            return True
        out.append(t)
        if not self.ttft:
            self.ttft = time.perf_counter() - self.t0
        if self.on_tokens is not None:
            self.on_tokens([t])
        if t in self.eos:
            self.finish = "eos"
            return True
        if self.gen.stop and self._stopped(1):
            return True
        return len(out) >= self.max_new

    def _stopped(self, new: int) -> bool:
        """Whether the output, `new` tokens longer than at the last check, now holds a stop
        string. Then the output keeps the tokens up to the one that completed the stop string, as
        `ar` (one token a check) keeps them, and stop_text is its text cut before the string: a
        pass that committed several tokens past the stop would otherwise report them (token ids,
        usage, logprobs) while its text was cut. The list is cut in place: the engine's request
        shares it."""
        if not (self.gen.stop and self.tokenizer is not None and new) or not self._stop_in_tail(new):
            return False
        out, stops = self.out, self.gen.stop
        text = self.tokenizer.decode(out)
        if not any(s in text for s in stops):
            return False
        # the first of the new tokens whose prefix holds a stop string (the earlier checks found none)
        for end in range(max(1, len(out) - new + 1), len(out)):
            head = self.tokenizer.decode(out[:end])
            if any(s in head for s in stops):
                del out[end:]
                text = head
                break
        # (the earliest in the text; at one place, the first listed)
        at, _, self.stop_string = min((text.find(s), i, s) for i, s in enumerate(stops) if s in text)
        self.finish, self.stop_text = "stop", text[:at]
        return True

    def _stop_in_tail(self, new: int) -> bool:
        """Whether a stop string may have appeared with the last `new` tokens: one in the text of
        the output's tail, the new tokens and enough before them for the longest stop string (a
        character is at most 4 byte-level tokens) plus a margin where a tail decoded alone may
        differ from the whole text (a character cut in two, a leading space). Decoding the whole
        output every pass made a long request's steps grow with its length; the whole text is
        decoded only when the tail shows a hit (to cut it exactly as before)."""
        tail = self.tokenizer.decode(self.out[-(new + 4 * max(map(len, self.gen.stop)) + 8):])
        return any(s in tail for s in self.gen.stop)

    def result(self, cls: type[GenerationResult], method: str, prompt_len: int, seconds: float, draft_steps: int,
               **extra) -> GenerationResult:
        return cls(token_ids=self.out, prompt_tokens=prompt_len, method=method,
                   target_passes=len(self.accept_lengths), draft_steps=draft_steps,
                   accept_lengths=self.accept_lengths, seconds=seconds, ttft=self.ttft, finish_reason=self.finish,
                   stop_trimmed_text=self.stop_text,
                   per_depth=[(v[0], v[1]) for _, v in sorted(self.per_depth.items())], **extra)
