"""A random-weight Qwen3.5 (hybrid) target on one device: greedy `tree` over random trees that
contain the target's own greedy continuation must equal `ar`; prints passes, tau and per-pass
times. The GDN tree kernel comes from TANDEM_GDN_TREE (walk, wy, path: tandem.models.qwen3_5);
no CUDA graphs for hybrid passes yet, so the times are eager ones.

    python bench/gpu_hybrid_check.py --device cuda --dtype float32
    python bench/gpu_hybrid_check.py --device cuda --dtype bfloat16 --hidden 1024 --layers 16

Exit status 1 when an output differs from `ar` (in bf16 a near-tie may legitimately flip an
argmax between a 1-row and an N-row pass; fp32 is the equality check).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from tandem.config import GenerationConfig, SpecConfig
from tandem.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen35Config
from tandem.runtime.hybrid import generate_hybrid
from tandem.tree.draft_tree import DraftTree


class OracleTrees:
    """Random trees whose spine follows `reference` (the ar output) for a random length."""

    def __init__(self, reference: list[int], nodes: int, vocab: int, seed: int):
        self.ref, self.nodes, self.vocab, self.rng = reference, nodes, vocab, random.Random(seed)
        self.steps, self.done, self.root = 0, 0, 0

    def start(self, prompt: list[int]) -> None:
        self.root = prompt[-1]

    def propose(self) -> DraftTree:
        rng, spine_len = self.rng, self.rng.randrange(0, 9)
        tokens, parents, spine = [self.root], [-1], [0]
        while len(tokens) <= self.nodes:
            if len(spine) <= spine_len and rng.random() < 0.5:
                j = self.done + len(spine) - 1
                tokens.append(self.ref[j] if j < len(self.ref) else rng.randrange(self.vocab))
                parents.append(spine[-1])
                spine.append(len(tokens) - 1)
            else:
                tokens.append(rng.randrange(self.vocab))
                parents.append(rng.randrange(len(tokens) - 1))
        return DraftTree(tokens, parents, [0.0] * len(tokens))

    def observe(self, result, tree) -> None:
        self.done += len(result.tokens)
        self.root = result.bonus


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--engine", type=int, nargs="*", default=[],
                    help="also the batched engine (ar, and tree over a small random attention draft) at these "
                         "concurrencies: every request's output must equal its solo ar")
    args = ap.parse_args()
    model, cfg = random_target(args.hidden, args.layers, args.device, args.dtype)
    prompt = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    gen = GenerationConfig(max_new_tokens=args.new, ignore_eos=True)
    ar = generate_hybrid(model, prompt, "ar", gen=gen)
    rows, ok = [{"method": "ar", "passes": ar.target_passes, "seconds": round(ar.seconds, 3),
                 "ms_per_pass": round(1e3 * (ar.seconds - ar.ttft) / max(1, ar.target_passes - 1), 2)}], True
    for n in args.nodes:
        t0 = time.perf_counter()
        res = generate_hybrid(model, prompt, "tree", spec=SpecConfig(nodes=n), gen=gen,
                              drafter=OracleTrees(ar.token_ids, n, cfg.vocab_size, seed=n))
        same = res.token_ids == ar.token_ids
        ok &= same
        rows.append({"method": f"tree N={n}", "equal_ar": same, "passes": res.target_passes, "tau": round(res.tau, 2),
                     "seconds": round(time.perf_counter() - t0, 3),
                     "ms_per_pass": round(1e3 * (res.seconds - res.ttft) / max(1, res.target_passes - 1), 2)})
    for c in args.engine:
        for row in engine_rows(model, cfg, c, args.new, gen):
            ok &= row["equal_solo_ar"]
            rows.append(row)
    print(json.dumps({"device": args.device, "dtype": args.dtype, "hidden": args.hidden, "layers": args.layers,
                      "rows": rows}, indent=1))
    return 0 if ok else 1


def engine_rows(model, cfg, concurrency: int, new: int, gen: GenerationConfig) -> list[dict]:
    """The batched engine over `concurrency` prompts at once, `ar` and `tree` (a random 2-layer
    attention draft of the same vocabulary: low acceptance, but every step verifies a tree)."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.engine.request import SamplingParams
    from tandem.models.transformer import ModelConfig, Transformer

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (int(torch.randint(8, 96, (), generator=g)),), generator=g).tolist()
               for _ in range(concurrency)]
    refs = [generate_hybrid(model, p, "ar", gen=gen).token_ids for p in prompts]
    dcfg = ModelConfig(family="llama", vocab_size=cfg.vocab_size, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=cfg.max_position_embeddings)
    torch.manual_seed(3)
    draft = Transformer(dcfg).to(model.device, model.dtype).eval().requires_grad_(False)
    rows = []
    for method in ("ar", "tree"):
        engine = Engine(model, draft if method == "tree" else None,
                        config=EngineConfig(method=method, spec=SpecConfig(nodes=16, width=2), max_num_seqs=concurrency,
                                            debug_check=True))
        reqs = [engine.add_request(p, SamplingParams(max_tokens=new, ignore_eos=True)) for p in prompts]
        t0 = time.perf_counter()
        done = {o.request_id: o for o in engine.run()}
        secs = time.perf_counter() - t0
        outs = [done[r.request_id].token_ids for r in reqs]
        same = sum(o == r for o, r in zip(outs, refs))
        rows.append({"method": f"engine {method} C={concurrency}", "equal_solo_ar": same == len(refs),
                     "equal": f"{same}/{len(refs)}", "steps": engine.counters.steps,
                     "tok_s": round(concurrency * new / secs, 1), "pool_check": engine.pool.check()})
    return rows


def random_target(h: int, layers: int, device: str, dtype: str):
    """A random-weight Qwen3.5 model, 3 GDN layers to 1 attention layer (its head sharpened)."""
    cfg = Qwen35Config(vocab_size=4096, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=h // 8,
                       layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                         for i in range(layers)),
                       linear_key_head_dim=h // 8, linear_value_head_dim=h // 8, linear_num_key_heads=4,
                       linear_num_value_heads=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        model.lm_head.weight.mul_(3.0)
    return model.to(device, getattr(torch, dtype)).eval().requires_grad_(False), cfg


if __name__ == "__main__":
    sys.exit(main())
