"""Quality of a trained pair on held-out Python source.

- bits per byte of the target: sum of next-token losses (nats) / ln 2 / UTF-8 bytes of the text.
  Each held-out file is `<|endoftext|>` + its tokens, cut into non-overlapping windows of ctx.
- top-1 agreement of draft with target (argmax equal) over the same positions.
- greedy completions of function headers: the fraction that `ast.parse` accepts after trimming
  to the last complete line.
"""
from __future__ import annotations

import ast
import math

import torch
import torch.nn.functional as F

from tandem.train.trainer import autocast_ctx


def make_windows(docs_ids: list[list[int]], eot: int, ctx: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for ids in docs_ids:
        seq = [eot] + list(ids)
        for s in range(0, len(seq) - 1, ctx):
            inp = seq[s:s + ctx]
            tgt = seq[s + 1:s + ctx + 1]
            out.append((inp[:len(tgt)], tgt))
    return out


@torch.no_grad()
def score_pair(target, draft, docs_ids: list[list[int]], n_bytes: int, eot: int, ctx: int,
               device: torch.device, batch_size: int = 32) -> dict:
    """Target and draft losses / accuracy, and draft-target top-1 agreement, on held-out windows."""
    wins = make_windows(docs_ids, eot, ctx)
    wins.sort(key=lambda w: -len(w[0]))  # similar lengths together, less padding
    nats = {"target": 0.0, "draft": 0.0}
    correct = {"target": 0, "draft": 0}
    agree = 0
    n_tok = 0
    for i in range(0, len(wins), batch_size):
        chunk = wins[i:i + batch_size]
        T = len(chunk[0][0])
        x = torch.zeros(len(chunk), T, dtype=torch.long)
        y = torch.full((len(chunk), T), -100, dtype=torch.long)
        for r, (inp, tgt) in enumerate(chunk):
            x[r, :len(inp)] = torch.tensor(inp)
            y[r, :len(tgt)] = torch.tensor(tgt)
        x, y = x.to(device), y.to(device)
        valid = y != -100
        argmax = {}
        for name, model in (("target", target), ("draft", draft)):
            if model is None:
                continue
            with autocast_ctx(device):
                logits = model(x)
            logits = logits.float()
            nats[name] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                          ignore_index=-100, reduction="sum").item()
            argmax[name] = logits.argmax(-1)
            correct[name] += int(((argmax[name] == y) & valid).sum())
        if len(argmax) == 2:
            agree += int(((argmax["target"] == argmax["draft"]) & valid).sum())
        n_tok += int(valid.sum())
    ln2 = math.log(2)
    out = {
        "heldout_tokens": n_tok,
        "heldout_bytes": n_bytes,
        "bytes_per_token": n_bytes / max(1, n_tok),
        "target_loss_nats_per_token": nats["target"] / max(1, n_tok),
        "target_bits_per_byte": nats["target"] / ln2 / max(1, n_bytes),
        "target_top1_accuracy": correct["target"] / max(1, n_tok),
    }
    if draft is not None:
        out.update({
            "draft_loss_nats_per_token": nats["draft"] / max(1, n_tok),
            "draft_bits_per_byte": nats["draft"] / ln2 / max(1, n_bytes),
            "draft_top1_accuracy": correct["draft"] / max(1, n_tok),
            "draft_target_top1_agreement": agree / max(1, n_tok),
        })
    return out


def function_header_prompts(texts: list[str], limit: int) -> list[str]:
    """Headers of top-level functions (decorators dropped, signature possibly multi-line).

    One per file, in file order, until `limit`; the header is the text from `def` up to the ':'
    that ends the signature.
    """
    out = []
    for text in texts:
        if len(out) >= limit:
            break
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.split("\n")
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            first, body = node.lineno - 1, node.body[0].lineno - 1
            if body <= first:
                continue  # one-liner
            header = lines[first:body]
            while header and not header[-1].strip():
                header.pop()
            if not header or not header[-1].rstrip().endswith(":") or any("#" in h for h in header):
                continue
            if not header[0].lstrip().startswith(("def ", "async def ")):
                continue
            # NOTE: the prompt stops at the ':' - no newline: byte-level BPE merges "\n" with the
            # next line's indentation, so a prompt ending in a bare "\n" is a token split the
            # model never saw in training.
            out.append("\n".join(header).rstrip())
            break
    return out


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new: int, eot: int, device: torch.device,
                    batch_size: int = 32) -> list[list[int]]:
    """Plain greedy decoding: a cache-less full causal forward each step, batched exactly.

    Rows are right-padded: under causal attention a row's real tokens never see the padding
    after them, so each row's next token is the argmax at its own last real position.
    """
    outs: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        seqs = [list(p) for p in prompts[i:i + batch_size]]
        done = [False] * len(seqs)
        gen: list[list[int]] = [[] for _ in seqs]
        for _ in range(max_new):
            L = max(len(s) for s in seqs)
            x = torch.full((len(seqs), L), eot, dtype=torch.long)
            for r, s in enumerate(seqs):
                x[r, :len(s)] = torch.tensor(s)
            last = torch.tensor([len(s) - 1 for s in seqs], device=device)
            with autocast_ctx(device):
                logits = model(x.to(device))
            nxt = logits[torch.arange(len(seqs), device=device), last].float().argmax(-1).tolist()
            for r, t in enumerate(nxt):
                if done[r]:
                    continue
                if t == eot:
                    done[r] = True
                    continue
                gen[r].append(t)
                seqs[r].append(t)
            if all(done):
                break
        outs.extend(gen)
    return outs


def trim_to_complete_lines(text: str) -> str:
    cut = text.rfind("\n")
    return text[:cut + 1] if cut >= 0 else ""


def parses(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


def ast_parse_eval(model, tok, texts: list[str], n_prompts: int, max_new: int, eot: int, ctx: int,
                   device: torch.device) -> dict:
    prompts = function_header_prompts(texts, n_prompts * 2)
    enc = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    pairs = [(p, e) for p, e in zip(prompts, enc) if len(e) + max_new <= ctx][:n_prompts]
    if not pairs:
        return {"ast_prompts": 0, "ast_parse_fraction": float("nan")}
    gens = greedy_generate(model, [e for _, e in pairs], max_new, eot, device)
    ok = 0
    samples = []
    for (p, _), g in zip(pairs, gens):
        completion = p + tok.decode(g, skip_special_tokens=False)
        trimmed = trim_to_complete_lines(completion)
        # a completion that never finished a line past the header has nothing to parse: a failure
        good = len(trimmed) > len(p) + 1 and parses(trimmed)
        ok += good
        if len(samples) < 3:
            samples.append({"prompt": p, "completion": completion, "parses": good})
    return {"ast_prompts": len(pairs), "ast_new_tokens": max_new, "ast_parse_fraction": ok / len(pairs),
            "ast_samples": samples}
