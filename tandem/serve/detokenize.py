"""Incremental detokenization: a stream's text without decoding its whole output every step.

StopStreamer (tandem.runtime.streaming) asks `decode(ids)` for the whole output so far at each
push; with a tokenizer's decode that costs O(tokens so far) per chunk, O(n^2) per request (19% of
the server process at 64 streams on the CPU, profiled with py-spy). `IncrementalDecode` answers
the same question for a list that only grows, decoding only a short window at its end (vLLM's
prefix / read offsets):

    ids:   [ .......... stable .......... | prefix window | new tokens ]
                                          ^prefix         ^read
    text = stable text (decoded once) + decode(ids[prefix:])[len(decode(ids[prefix:read])):]

The window is decoded with one committed chunk of context before the new tokens, so a decoder
that treats a text's first token specially (a stripped leading space) or a character whose bytes
straddle two tokens comes out as in the whole decode. The offsets move only when the new text
does not end in U+FFFD (a multi-byte character still arriving), so the stable text always ends on
a whole character. NOTE: a decoder whose window text does not start with the context's own text
gets the whole decode for that call (correct, just not incremental).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalDecode:
    """`decode(ids)` for a list that only grows between calls (StopStreamer's `decode`)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.stable = ""  # decode(ids[:read]), ending on a whole character
        self.prefix = self.read = 0  # ids[prefix:read]: the context window decoded again with the new tokens
        self.context = ""  # decode(ids[prefix:read]) on its own

    def __call__(self, ids: Sequence[int]) -> str:
        n = len(ids)
        if n < self.read:  # not the growing list it was: start over
            self.__init__(self.decode)
        window = self.decode(list(ids[self.prefix:]))
        if not window.startswith(self.context):
            return self.decode(list(ids))
        new = window[len(self.context):]
        text = self.stable + new
        if new and not new.endswith("\ufffd") and n > self.read:
            self.stable = text
            self.context = self.decode(list(ids[self.read:]))
            self.prefix, self.read = self.read, n
        return text
