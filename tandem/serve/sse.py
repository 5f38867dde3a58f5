"""Server-sent events: `data: JSON\\n\\n` frames, the common ones built from a template.

Most chunks of a stream differ only in their text (and, with continuous usage, two counts), so
`ChunkTemplate` splits `json.dumps` of the chunk, rendered once with placeholders, around them;
`fill` joins the pieces with the values encoded as json.dumps encodes them. The bytes equal
`frame(chunk)` exactly (tests/test_serve.py checks it), without walking the whole record each time.
"""
from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii  # json.dumps's own string encoder (ensure_ascii)

DONE = b"data: [DONE]\n\n"


def frame(obj) -> bytes:
    """One SSE event carrying `obj` as JSON (json.dumps's default separators, ASCII)."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class ChunkTemplate:
    """`frame(record)` for records that differ only in the values at `Slot`s.

    Build it from the record with a `Slot(name)` where each value goes; `fill(**values)` encodes
    each value (a str as a JSON string, an int as its digits) into its place."""

    def __init__(self, record):
        slots: list[str] = []

        def mark(v):
            if isinstance(v, Slot):
                slots.append(v.name)
                return f"\x00slot{len(slots) - 1}\x00"
            if isinstance(v, dict):
                return {k: mark(x) for k, x in v.items()}
            if isinstance(v, list):
                return [mark(x) for x in v]
            return v

        text = frame(mark(record)).decode()
        self.parts: list[str] = []
        self.slots = slots
        for i in range(len(slots)):
            head, sep, text = text.partition(encode_basestring_ascii(f"\x00slot{i}\x00"))
            if not sep:
                raise ValueError(f"slot {slots[i]!r} is not in the record once")
            self.parts.append(head)
        self.parts.append(text)

    def fill(self, **values) -> bytes:
        out = [self.parts[0]]
        for name, part in zip(self.slots, self.parts[1:]):
            v = values[name]
            out.append(encode_basestring_ascii(v) if isinstance(v, str) else str(int(v)))
            out.append(part)
        return "".join(out).encode()


class Slot:
    """Where a template's value goes."""

    def __init__(self, name: str):
        self.name = name
