"""LogprobEngine: the batched engine, also recording the target's log-probabilities of each new
token; LogprobFormat: those in OpenAI's two shapes.

Every committed token has a target distribution in the verify pass that committed it, whatever
the method: with `path` the accepted nodes (root first) of a tree whose rows produced `logits`,
new token j (the accepted draft tokens, then the bonus) was drawn against row `path[j]`. So
logprobs come for ar, chain and tree alike, from the target's raw distribution (log-softmax of
its logits, before temperature and top_p: vLLM's default "raw" logprobs), never the draft's.

NOTE: the engine hooks used are overriding `Engine._accept` (either of its signatures, the
result passed through unchanged) and `Engine._reads_accepts`: a step where no request asked for
logprobs verifies its greedy trees on the device as a plain engine's does (tandem.engine.
device_verify), without the per-request `_accept`; nothing in tandem/engine/ changes.
"""
from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass

import torch

from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.tree.draft_tree import DraftTree
from tandem.verify.verifier import VerifyResult


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k most likely tokens and their logprobs, best first


class LogprobEngine(Engine):
    def __init__(self, *args, **kwargs):
        # (before the engine starts: its warm-up request's steps already ask _reads_accepts)
        self.logprob_topk: dict[str, int] = {}  # request id -> alternatives wanted (0: the token's own only)
        self.logprobs: dict[str, list[TokenLogprob]] = {}  # request id -> per committed token (may run past a cut)
        super().__init__(*args, **kwargs)

    def want_logprobs(self, request_id: str, top: int) -> None:
        self.logprob_topk[request_id] = top
        self.logprobs[request_id] = []

    def forget(self, request_id: str) -> None:
        self.logprob_topk.pop(request_id, None)
        self.logprobs.pop(request_id, None)

    def _reads_accepts(self, requests) -> bool:
        wanted = self.logprob_topk
        return bool(wanted) and any(r.request_id in wanted for r in requests)

    def _accept(self, req: Request, tree: DraftTree, logits: torch.Tensor, *rest) -> VerifyResult:
        """rest: (argmax) with logits [the tree's rows, vocab], or (lo, argmax) with logits of the
        whole pass, the tree's rows from lo (Engine._accept's newer signature)."""
        result = super()._accept(req, tree, logits, *rest)
        k = self.logprob_topk.get(req.request_id)
        if k is not None:
            if len(rest) == 2:
                logits = logits[rest[0]:rest[0] + len(tree.tokens)]  # [the tree's rows, vocab]
            lp = torch.log_softmax(logits[result.path].float(), dim=-1)  # [len(path), vocab]
            tokens = torch.tensor(result.tokens, device=lp.device)  # [len(path)]
            own = lp.gather(1, tokens[:, None])[:, 0].tolist()
            if k > 0:
                vals, idx = lp.topk(k, dim=-1)  # [len(path), k]
                tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
            else:
                tops = [()] * len(own)
            self.logprobs[req.request_id] += [TokenLogprob(t, o, top) for t, o, top in zip(result.tokens, own, tops)]
        return result


# ---- OpenAI's shapes ------------------------------------------------------------------------------
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class TokenText:
    """A token's own bytes and the string OpenAI shows for it. Decoding one token alone gives
    U+FFFD for a byte of a multi-byte character (the bundled tokenizer splits "é" in two), so a
    byte-level BPE token's bytes come from its alphabet and a byte-fallback token's from its
    <0xNN> name; a token whose bytes are not UTF-8 on their own shows as "bytes:\\xc3" (OpenAI's
    legacy form), so no two tokens share a string."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        spec = json.loads(tokenizer.to_str())
        self.byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        self.alphabet = _byte_level_chars() if self.byte_level else {}
        self.special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self.cache: dict[int, tuple[bytes, str]] = {}

    def __call__(self, token: int) -> tuple[bytes, str]:
        got = self.cache.get(token)
        if got is None:
            got = self.cache[token] = self._text(token)
        return got

    def _text(self, token: int) -> tuple[bytes, str]:
        name = self.tok.id_to_token(token)
        if name is None:
            return b"", ""
        if token in self.special:  # (decode skips it; its name is what a client can match)
            return name.encode("utf-8"), name
        if self.byte_level and all(c in self.alphabet for c in name):
            raw = bytes(self.alphabet[c] for c in name)
        elif _BYTE_TOKEN.fullmatch(name):
            raw = bytes([int(name[3:5], 16)])
        elif "\u2581" in name:  # SentencePiece's space
            raw = name.replace("\u2581", " ").encode("utf-8")
        else:
            raw = self.tok.decode([token]).encode("utf-8")
        try:
            return raw, raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw, "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Each token's character offset in the output text, token by token (a stream keeps one across
    its chunks): the text's characters are the tokens' bytes decoded as one UTF-8 stream, so a
    token inside a multi-byte character starts where that character does."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0

    def next(self, raw: bytes) -> int:
        at = self.chars
        self.chars += len(self.decoder.decode(raw))
        return at


class LogprobFormat:
    """The target's logprobs in the two OpenAI shapes (completions' legacy lists, chat's `content`)."""

    def __init__(self, tokenizer):
        self.text = TokenText(tokenizer)

    def completion(self, lps: list[TokenLogprob], offsets: TextOffsets | None = None) -> dict:
        offsets = offsets or TextOffsets()
        tokens, where = [], []
        for t in lps:
            raw, s = self.text(t.token)
            tokens.append(s)
            where.append(offsets.next(b"" if t.token in self.text.special else raw))  # (no text: the decode skips it)
        # (the sampled token is always among its top_logprobs, as OpenAI's legacy API gives up to
        # logprobs + 1 entries: a harness reads top_logprobs[i][tokens[i]])
        tops = [{**{self.text(i)[1]: v for i, v in t.top}, s: t.logprob} for t, s in zip(lps, tokens)]
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps], "top_logprobs": tops,
                "text_offset": where}

    def chat(self, lps: list[TokenLogprob]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            raw, s = self.text(token)
            return {"token": s, "logprob": logprob, "bytes": list(raw)}

        return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                            for t in lps]}
