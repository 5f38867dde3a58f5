"""GPU lane: deterministic mode's CUDA kernels (tandem.kernels.invariant_gemm, invariant_attention)
and the engine that runs them in CUDA graphs, in bf16 where the fast kernels' results move with
the batch.

- the invariant GEMM: a row's output bitwise the same for M = 1, 7, 64 and 300 rows, at the
  bundled target's and Llama-3-8B's projection shapes;
- the invariant attention: a tree node's output bitwise the AR row's with the same visible
  sequence (1- and 2-word masks), and a row's the same alone and among other requests' rows;
- a deterministic BatchedModel through its graph buckets (tests/invariant_checks.py);
- the engine (bundled pair, bf16, CUDA graphs): one greedy output for a request alone and in a
  batch of 16, with `ar` and with `tree`.

tests/test_invariant_kernels.py runs the same kernel checks in fp32 on the CPU (Triton interpreter).
"""
from __future__ import annotations

import pytest
import torch

from gpu_lane import NEEDS_CUDA, no_grad, bundled_pair, preset_model
from invariant_checks import check_attention, check_gemm, model_rows_alone_and_among
from tandem.bench.presets import PRESETS
from tandem.config import SpecConfig
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.kernels import invariant_attention as ia
from tandem.kernels import invariant_gemm as ig
from tandem.models.loader import read_config
from tandem.runtime.pair import BUNDLED_TARGET

pytestmark = [pytest.mark.cuda, NEEDS_CUDA, pytest.mark.usefixtures(no_grad.__name__)]

CONFIGS = {"bundled-target": read_config(BUNDLED_TARGET), "llama3-8b": PRESETS["llama3-8b"]}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]




@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CONFIGS)
def test_invariant_gemm_gives_a_row_the_same_bits_for_any_number_of_rows(shape, dtype):
    c = CONFIGS[shape]
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    # (N, K, bias) of qkv (with a bias, as Qwen2's), o_proj, gate_up, down_proj and the LM head
    shapes = ((q + 2 * kv, h, True), (h, q, False), (2 * c.intermediate_size, h, False),
              (h, c.intermediate_size, False), (c.vocab_size, h, False))
    x = torch.empty(1, h, device="cuda", dtype=dtype)
    assert ig.applies(x, torch.empty(8, h, device="cuda", dtype=dtype))
    check_gemm(shapes, rows=(1, 7, 64, 300), device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CONFIGS)
def test_invariant_attention_gives_a_tree_node_its_ar_step_bits(shape, dtype):
    c = CONFIGS[shape]
    H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    assert ia.applies(torch.empty(1, H, D, device="cuda", dtype=dtype),
                      torch.empty(8, Hkv, D, device="cuda", dtype=dtype))
    check_attention("cuda", dtype, H, Hkv, D)


@pytest.mark.parametrize("name", ["bundled-target", "llama3-8b"])
def test_deterministic_graph_passes_give_a_row_the_same_logits_alone_among_rows_and_as_a_tree_node(name):
    """A prefill chunk alone (eager) and between two other requests' chunks (a graph bucket of 32
    rows), a tree alone and beside another request's decode row, each tree node and its AR step:
    the same bits in bf16."""
    model = bundled_pair("cuda", "bfloat16")[0] if name == "bundled-target" else \
        preset_model(name, 2, "cuda", "bfloat16")
    pairs, graphed = model_rows_alone_and_among(model, use_graphs=True)
    assert graphed  # the kernels were captured and replayed
    for i, (alone, among) in enumerate(pairs):
        assert torch.equal(alone, among), i


def test_deterministic_engine_gives_one_output_alone_in_a_batch_of_16_and_with_speculation():
    """Bundled pair, bf16, CUDA graphs on: a request's greedy output is bit-identical decoded
    alone or among 15 other prompts, by `ar` or by `tree` (whose drafts are accepted)."""
    target, draft, prompts = bundled_pair("cuda", "bfloat16")
    prompt = prompts[0]
    others = [p[:max(1, len(p) * k // 5)] for p in prompts for k in range(1, 6)][:15]
    outs, taus = {}, []
    for method in ("ar", "tree"):
        for n in (1, 16):
            cfg = EngineConfig(method=method, spec=SpecConfig(nodes=16, width=4), block_size=16, max_num_seqs=16,
                               max_num_batched_tokens=512, deterministic=True, debug_check=True,
                               draft_gate=False)
            engine = Engine(target, draft if method == "tree" else None, config=cfg)
            assert engine.model.use_graphs and engine.model._graphs, "deterministic passes should be CUDA graphs"
            req = engine.add_request(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
            for o in others[:n - 1]:
                engine.add_request(o, SamplingParams(max_tokens=48, ignore_eos=True))
            done = {o.request_id: o for o in engine.run()}
            outs[(method, n)] = done[req.request_id].token_ids
            if method == "tree":
                taus.append(done[req.request_id].tau)
            assert engine.pool.check() == []
    assert len(set(map(tuple, outs.values()))) == 1, outs
    assert min(taus) > 1.2  # speculation really ran: tree nodes were accepted
