"""The Emitter's stop strings: it looks for them in the text of the output's tail only (the
whole output decoded every pass made a long request's steps grow with its length), and must
cut exactly where `ar` cuts (decoding the whole output after every token), multi-byte characters
and stop strings that span passes included: a pass of several tokens keeps none past the one that
completed the stop string, in its output and in what it streams."""
from __future__ import annotations

import random
import time

import pytest

from tandem.config import GenerationConfig
from tandem.models.loader import load_tokenizer
from tandem.runtime.emit import Emitter
from tandem.runtime.pair import BUNDLED_TARGET
from tandem.tree.draft_tree import DraftTree
from tandem.verify.verifier import VerifyResult

TEXT = ("def f(x):\n    return x * 2  # doppelt: größer als ü, café naïve — “quoted” 東京 🙂 end\n"
        "for i in range(10):\n    print(f(i), 'ok')\n") * 3


def whole_text_cut(tok, ids: list[int], passes: list[int], stop: tuple[str, ...]) -> tuple[list[int], str | None]:
    """The reference: after each pass, decode everything and look for the stops."""
    out: list[int] = []
    at = 0
    for n in passes:
        out += ids[at:at + n]
        at += n
        text = tok.decode(out)
        hit = min((text.find(s) for s in stop if s in text), default=-1)
        if hit >= 0:
            return out, text[:hit]
    return out, None


@pytest.mark.skipif(not (BUNDLED_TARGET / "config.json").is_file(), reason="no bundled target")
def test_stop_strings_found_in_the_tail_cut_where_the_whole_text_cuts():
    tok = load_tokenizer(BUNDLED_TARGET)
    ids = tok.encode(TEXT).ids
    text = tok.decode(ids)
    rng = random.Random(0)
    cuts = past = 0
    for trial in range(300):
        a = rng.randrange(len(text) - 12)
        stop = (text[a:a + rng.randint(1, 12)],) + (("never there",) if trial % 3 == 0 else ())
        passes, left = [], len(ids)
        while left > 0:  # passes of 1-9 tokens (a tree step's accepted path and bonus)
            passes.append(min(left, rng.randint(1, 9)))
            left -= passes[-1]
        streamed: list[int] = []
        em = Emitter(10 ** 6, set(), GenerationConfig(max_new_tokens=10 ** 6, stop=stop), tok, streamed.extend,
                     time.perf_counter())
        at, done = 0, False
        for n in passes:
            chunk = ids[at:at + n]
            at += n
            done = em.emit_pass(chunk, n - 1, range(1, n))
            if done:
                break
        want_out, want_text = whole_text_cut(tok, ids, [1] * len(ids), stop)  # ar: a check after every token
        assert (em.out, em.stop_text, em.finish == "stop") == (want_out, want_text, want_text is not None), stop
        assert streamed == em.out
        cuts += done
        past += len(whole_text_cut(tok, ids, passes, stop)[0]) > len(want_out)
    assert cuts > 250  # (the stops are taken from the text: nearly all are found)
    assert past > 100  # (most stops were completed before their pass's last token: those passes were cut)


def test_without_a_tokenizer_stop_strings_are_not_looked_for():
    em = Emitter(4, set(), GenerationConfig(max_new_tokens=4, stop=("x",)), None, None, time.perf_counter())
    assert not em.emit(DraftTree.root(5), VerifyResult([0], [7, 8], 1))
    assert em.emit(DraftTree.root(5), VerifyResult([0], [9, 10, 11], 2)) and em.out == [7, 8, 9, 10]
    assert em.finish == "length"


def test_accepted_drafts_are_counted_within_the_tokens_kept():
    """A pass cut short by max_new_tokens (or EOS, or a stop) counts only the drafts it kept, so a
    request never reports more accepted draft tokens than tokens."""
    em = Emitter(3, {99}, GenerationConfig(max_new_tokens=3), None, None, time.perf_counter())
    assert not em.emit_pass([1, 2], 1, range(1, 3))  # one draft accepted, then the bonus: both kept
    assert em.emit_pass([3, 4, 5, 6], 3, range(1, 4))  # three accepted, but only one token fits
    assert em.out == [1, 2, 3] and em.accept_lengths == [1, 1] and em.finish == "length"
    assert sorted(em.per_depth.items()) == [(1, [2, 2]), (2, [2, 1]), (3, [1, 1])]  # the verifier's accepts, uncut
    eos = Emitter(10, {99}, GenerationConfig(max_new_tokens=10), None, None, time.perf_counter())
    assert eos.emit_pass([7, 99, 8], 2, range(1, 3)) and eos.out == [7, 99] and eos.accept_lengths == [2]
