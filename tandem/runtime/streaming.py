"""Streaming text out as tokens are committed, so that the streamed text equals the final text.

Two things can make a prefix of the decoded text premature: a multi-byte character split across
tokens (decoded as a trailing U+FFFD until its last byte arrives) and a stop string that is
still arriving (its first characters are already decoded). `StopStreamer` holds back both and,
once a stop string is complete, releases the text up to it and nothing after: the same cut as
`Emitter` (the earliest occurrence of any stop string), so what was streamed is always a prefix
of `GenerationResult`'s final text (the CLI's `--json` `text`), and `finish` returns the rest.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStreamer:
    """`push(tokens)` -> the text now safe to print; `finish(final_text)` -> what is left.

    `decode` turns the whole list of new token ids into text (a tokenizer's decode).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.decode, self.stop = decode, tuple(stop)
        self.ids: list[int] = []
        self.printed = ""  # everything returned so far, concatenated
        self.stopped = False

    def push(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        text = self.decode(self.ids)
        hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            safe = text[:hit]
        else:
            safe = text.rstrip("\ufffd")  # NOTE: a multi-byte character may be split across tokens
            safe = safe[: len(safe) - self._held(safe)]
        return self._release(safe)

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the result's text) after what was already released."""
        return self._release(final_text)

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that some stop string starts with."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held

    def _release(self, safe: str) -> str:
        # NOTE: decoding more tokens only appends to a byte-level BPE text, so `safe` extends what
        # was printed; if a tokenizer ever rewrote earlier text, nothing printed can be taken back
        if len(safe) <= len(self.printed):
            return ""
        out = safe[len(self.printed):]
        self.printed = safe
        return out
