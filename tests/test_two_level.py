"""Two-level verification (TLV): the cycle's pieces on hand-built trees, its losslessness on random
trees against an oracle target with Q passes from perfect to adversarial, and on the bundled pair
(TLV's greedy output equals `ar`, with the W12 8-bit view as the Q pass)."""
from __future__ import annotations

import random

import pytest
import torch

from tandem.tree.draft_tree import DraftTree
from tandem.verify.two_level import (graft, model_argmax, model_proposer, q_chain, speculative_generate,
                                     two_level_verify, view8_copy)
from tandem.verify.verifier import greedy_accept

VOCAB = 4  # small: random drafts often match, so paths get long


def _tree(root: int, parents: list[int], tokens: list[int]) -> DraftTree:
    return DraftTree(tokens=[root, *tokens], parents=[-1, *parents], logp=[0.0] * (len(tokens) + 1))


def test_chain_and_graft_on_a_hand_built_tree():
    #        0(7)
    #      /     \
    #    1(1)    2(2)
    #    |       |
    #    3(3)    4(1)
    tree = _tree(7, [0, 0, 1, 2], [1, 2, 3, 1])
    q = [2, 0, 1, 0, 3]  # Q walks 0 -> 2 -> 4, then predicts 3 after node 4
    assert q_chain(tree, q) == [2, 1, 3]
    sub = _tree(3, [0, 0, 1], [5, 6, 8])  # rooted at C's last token
    v = graft(7, [2, 1, 3], sub, nodes=5)
    assert v.tokens == [7, 2, 1, 3, 5, 6] and v.parents == [-1, 0, 1, 2, 3, 3]
    v = graft(7, [2, 1, 3], sub, nodes=2)  # the budget trims the chain itself
    assert v.tokens == [7, 2, 1] and v.parents == [-1, 0, 1]
    with pytest.raises(ValueError, match="subtree's root"):
        graft(7, [2, 1, 4], sub, nodes=5)


def _oracle(seed: int):
    """An exact 'target': a fixed pseudo-random next token for every context."""
    def next_token(ctx: tuple[int, ...]) -> int:
        return random.Random(hash((seed, ctx))).randrange(VOCAB)

    def exact_pass(context: list[int], tree: DraftTree) -> list[int]:
        paths = [tuple(context)]
        for i in range(1, len(tree)):
            paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
        return [next_token(p) for p in paths]

    def greedy(context: list[int], n: int) -> list[int]:
        out = list(context)
        for _ in range(n):
            out.append(next_token(tuple(out)))
        return out[len(context):]

    return exact_pass, greedy


def _random_tree(rng: random.Random, root: int, nodes: int) -> DraftTree:
    n = rng.randint(0, nodes)
    return _tree(root, [rng.randrange(i + 1) for i in range(n)], [rng.randrange(VOCAB) for _ in range(n)])


@pytest.mark.parametrize("q_error", [0.0, 0.2, 1.0])
def test_tlv_commits_exact_greedy_tokens_on_random_trees(q_error):
    exact_pass, greedy = _oracle(seed=1)
    rng = random.Random(2)

    def q_pass(context, tree):  # the exact argmax, each one replaced by a random token with prob q_error
        return [t if rng.random() >= q_error else rng.randrange(VOCAB) for t in exact_pass(context, tree)]

    def propose(context, nodes):
        return _random_tree(rng, context[-1], nodes)

    more = 0
    for trial in range(300):
        context = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
        tree, nodes = _random_tree(rng, context[-1], 12), rng.randint(1, 12)
        step = two_level_verify(context, tree, q_pass, exact_pass, propose if trial % 2 else None, nodes)
        got = step.result.tokens
        assert got == greedy(context, len(got)) and len(got) >= 1  # the exact greedy continuation
        assert got == greedy_accept(step.verified, exact_pass(context, step.verified)).tokens
        assert len(step.verified) - 1 <= nodes and step.q_checked == len(step.chain) <= nodes
        plain = greedy_accept(tree, exact_pass(context, tree)).tokens
        if q_error == 0.0 and len(step.chain) < nodes:
            # a perfect Q pass: C is exact greedy's path in the tree and its bonus, all accepted, plus one more
            assert step.q_agree == step.q_checked and got[:len(plain)] == plain and len(got) > len(plain)
        more += len(got) > len(plain)
    if q_error == 0.0:
        assert more > 150
    # whole decodes: the same tokens as greedy decoding, whatever the Q pass says
    run = speculative_generate([0, 1], 40, propose, exact_pass, nodes=6, q_pass=q_pass)
    assert run.tokens == greedy([0, 1], 40) and run.q_passes == run.exact_passes
    assert (run.q_agreement == 1.0) == (q_error == 0.0)


@pytest.fixture(scope="module")
def bundled():
    from tandem.runtime.pair import load_pair

    pair = load_pair(dtype="float32")
    return pair, view8_copy(pair.target)


def test_view8_copy_reads_the_8bit_view(bundled):
    from tandem.quant.w12 import decode_w12_view8, encode_w12

    pair, q = bundled
    w = pair.target.model.layers[0].mlp.down_proj.weight
    qw = q.model.layers[0].mlp.down_proj.weight
    assert torch.equal(qw, decode_w12_view8(*encode_w12(w.to(torch.bfloat16))).float()) and not torch.equal(qw, w)
    assert q.lm_head.weight.data_ptr() != pair.target.lm_head.weight.data_ptr()


def test_tlv_greedy_output_equals_ar_on_the_bundled_pair(bundled):
    """TLV on the bundled pair (fp32, N = 8): the 8-bit-view Q pass, the exact pass through the full and
    through the certified head; its tokens equal the runtime's `ar`. Prints tau against plain tree
    verification at the same N and the Q pass's top-1 agreement."""
    from tandem.config import GenerationConfig
    from tandem.runtime.generate import Generator

    pair, q = bundled
    n_new, nodes = 24, 8
    propose = model_proposer(pair.draft, width=2)
    engine = Generator(pair.target, pair.draft, pair.tokenizer)
    for prompt in ("def fib(n):", "class Stack:\n    def __init__(self):"):
        ids = pair.tokenizer.encode(prompt).ids
        want = engine.generate(ids, "ar", gen=GenerationConfig(max_new_tokens=n_new, ignore_eos=True)).token_ids
        tree = speculative_generate(ids, n_new, propose, model_argmax(pair.target), nodes)
        tlv = speculative_generate(ids, n_new, propose, model_argmax(pair.target), nodes, q_pass=model_argmax(q))
        cert = speculative_generate(ids, n_new, propose, model_argmax(pair.target, "certified"), nodes,
                                    q_pass=model_argmax(q))
        assert tree.tokens == tlv.tokens == cert.tokens == want, prompt
        print(f"{prompt!r}: tau tree {tree.tau:.2f}, TLV {tlv.tau:.2f} tokens per exact pass "
              f"({tlv.tau / tree.tau:.2f}x), Q top-1 agreement {tlv.q_agreement:.3f}")
        assert tlv.q_agreement > 0.8  # the 8-bit view rarely disagrees (the paper: 98.7%)
        assert tlv.exact_passes <= tree.exact_passes
