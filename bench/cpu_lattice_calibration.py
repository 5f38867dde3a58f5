"""How well the block drafter's lattice scores predict acceptance, and what a re-scored tree would accept
(bundled pair + block drafter, fp32, greedy, on the CPU: acceptance does not depend on the device).

Records every draft step's lattice (the top-K tokens [B, K] and parent-conditioned log-probs [B, K, K]) of
`tree` runs together with the greedy continuation it should have predicted (`tree`'s output is `ar`'s), then:
- calibration: per lattice position, the mean exp(score) of the path's best child against how often it is the
  target's token, given the parent was;
- trees: for each recorded lattice, the best-first tree of N nodes under a scoring rule (the raw
  log-probs, or a per-position temperature / offset fitted on the first half of the prompts) and the tokens
  it accepts: mean accepted + 1 over the lattices of the second half (the lattices are those of the raw
  rule's run, so this ranks rules; `tandem bench` measures the winner).
    python bench/cpu_lattice_calibration.py --workload mbpp --num-prompts 20 [--nodes 32]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

import tandem.runtime.resident as rl
from tandem.bench.workloads import load_workload
from tandem.config import GenerationConfig, SpecConfig
from tandem.kernels.resident import beam_levels_ref, select_tree_ref
from tandem.runtime.generate import Generator
from tandem.runtime.pair import load_pair


def record(pair, prompts, nodes: int, max_new: int):
    """[(tok [B, K], cond [B, K, K], truth [B] (-1 past the output's end))] of every draft step."""
    steps = []
    real_draft = rl.ResidentLoop._draft_block
    seen = {}

    def draft(self, width):
        real_draft(self, width)
        seen["prefix"] = int(self.prefix)
        seen["root"] = int(self.ctx_tok[self.pmax - 1])

    real_tree = rl.best_first_tree_device

    def tree(tok, cond, root, n, out):
        seen["lattice"] = (tok.clone(), cond.clone())
        return real_tree(tok, cond, root, n, out)

    rl.ResidentLoop._draft_block, rl.best_first_tree_device = draft, tree
    gen = Generator(pair.target, pair.draft, pair.tokenizer, resident=True)
    g = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    real_verify = rl.ResidentLoop._verify_body
    per_prompt = []
    try:
        for ids in prompts:
            lat = []

            def verify(self, width, lat=lat):
                lat.append((seen["prefix"], seen["root"]) + seen["lattice"])
                real_verify(self, width)
            rl.ResidentLoop._verify_body = verify
            r = gen.generate(ids, "tree", SpecConfig(nodes=nodes), gen=g)
            seq = list(ids) + list(r.token_ids)
            rows = []
            for prefix, root, tok, cond in lat:
                if prefix >= len(seq) - 1:
                    continue  # a step queued past the request's end
                assert seq[prefix] == root, (prefix, root)  # the root is the token at the target's prefix
                B = tok.shape[0]
                truth = torch.tensor([seq[prefix + 1 + j] if prefix + 1 + j < len(seq) else -1 for j in range(B)])
                rows.append((tok, cond, truth))
            per_prompt.append(rows)
    finally:
        rl.ResidentLoop._draft_block, rl.best_first_tree_device = real_draft, real_tree
        rl.ResidentLoop._verify_body = real_verify
    return per_prompt


def accepted(tok, cond, truth, nodes: int, width: int) -> int:
    """Tokens the best-first tree over (tok, cond) accepts against the greedy continuation `truth`."""
    root = torch.tensor([0])
    t, p, d, _ = select_tree_ref(tok, root, *beam_levels_ref(cond, width, nodes), nodes)
    best = 0
    ok = [True] + [False] * (len(t) - 1)
    for i in range(1, len(t)):  # topological order: a parent before its children
        depth = int(d[i])
        ok[i] = ok[int(p[i])] and int(truth[depth - 1]) == int(t[i])
        if ok[i]:
            best = max(best, depth)
    return best


def calibration(rows_list):
    """Per position j: (count, mean predicted p of the greedy path's child, hit rate) given the path so far hit."""
    B = rows_list[0][0].shape[0]
    n, pred, hit = [0] * B, [0.0] * B, [0] * B
    for tok, cond, truth in rows_list:
        parent = 0  # the root's slot: level 0 reads row 0 of cond[0]
        for j in range(B):
            if truth[j] < 0:
                break
            c = int(cond[j, parent].argmax())
            n[j] += 1
            pred[j] += math.exp(float(cond[j, parent, c]))
            if int(tok[j, c]) != int(truth[j]):
                break
            hit[j] += 1
            parent = c
    return [(n[j], pred[j] / max(n[j], 1), hit[j] / max(n[j], 1)) for j in range(B)]


def rescored(cond, temp, offset):
    """cond with position j's log-probs scaled by temp[j] and shifted by offset[j], at most 0 (a child never
    outscores its parent: the tree stays prefix-closed and the beams' early stop exact)."""
    return (cond * temp[:, None, None] + offset[:, None, None]).clamp(max=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mbpp")
    ap.add_argument("--data-dir", default="../shared/datasets")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    pair = load_pair(None, "block", "cpu", "float32")
    prompts = [pair.tokenizer.encode(p.text).ids[-384:] for p in load_workload(a.workload, a.num_prompts, a.data_dir)]
    per_prompt = record(pair, prompts, a.nodes, a.max_new_tokens)
    half = len(per_prompt) // 2
    fit = [r for rows in per_prompt[:half] for r in rows]
    test = [r for rows in per_prompt[half:] for r in rows]
    cal = calibration(fit)
    print("position | paths | mean p | hit rate")
    for j, (n, p, h) in enumerate(cal):
        print(f"{j:8d} | {n:5d} | {p:.3f} | {h:.3f}")
    B = fit[0][0].shape[0]
    W = a.nodes
    # the offsets that make each position's greedy child's mean log p equal log(hit rate): a calibrated prior
    off = torch.tensor([math.log(max(h, 1e-3)) - math.log(max(p, 1e-3)) if n else 0.0 for n, p, h in cal])
    rules = {"raw": (torch.ones(B), torch.zeros(B)), "offset": (torch.ones(B), off)}
    # (one temperature for every position ranks paths as the raw scores do: only per-position changes count)
    for lam in (-0.4, -0.2, -0.1, 0.1, 0.2, 0.4):
        rules[f"level {lam:+}"] = (torch.ones(B), torch.full((B,), lam))
    for g in (0.7, 0.8, 0.85, 0.9, 0.95, 1.05):
        rules[f"temp {g}^j"] = (torch.tensor([g ** j for j in range(B)]), torch.zeros(B))
    results = {}
    for name, (temp, offset) in rules.items():
        acc = [accepted(tok, rescored(cond, temp, offset), truth, a.nodes, W) for tok, cond, truth in test]
        results[name] = sum(acc) / len(acc) + 1
        print(f"{name:10s}: tokens a step {results[name]:.3f} over {len(acc)} lattices")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"calibration": cal, "tau": results, "offsets": off.tolist()}, f, indent=1)


if __name__ == "__main__":
    main()
