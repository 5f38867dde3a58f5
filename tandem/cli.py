"""`tandem generate | bench | audit | profile | train-pair` (also `python -m tandem`).

Every subcommand reads its defaults from the config dataclasses; user mistakes become one
line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from tandem.config import ConfigError, GenerationConfig, SamplingConfig, SpecConfig

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "bench": ("tandem.bench.harness", "benchmark methods on a workload, paired and checked against ar"),
    "audit": ("tandem.bench.audit", "token-forcing audit that a method's output is lossless"),
    "profile": ("tandem.bench.profile", "cost model: verify/draft step times and predicted speedup"),
    "train-pair": ("tandem.train", "train the bundled draft/target pair from Python source"),
    "train-drafters": ("tandem.train.drafters", "train feature drafters (block drafter, EAGLE-3 head) for a target"),
}


def add_model_arguments(p: argparse.ArgumentParser, dtype_default: str = "float32") -> None:
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the bundled pair)")
    p.add_argument("--draft", default=None, help="draft checkpoint dir (default: the bundled pair's draft)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")
    p.add_argument("--dtype", default=dtype_default, choices=["float32", "bfloat16", "float16"])


def add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    s, g = SpecConfig(), GenerationConfig()
    p.add_argument("--k", type=int, default=s.k, help="draft tokens per step for chain")
    p.add_argument("--nodes", type=int, default=s.nodes, help="node budget N for tree and async")
    p.add_argument("--width", type=int, default=s.width, help="leaves expanded per round (w) for tree and async")
    p.add_argument("--depth", type=int, default=s.depth,
                   help="tree: expansion rounds per tree (default from N/w); async: rounds run while the target "
                        "verifies (default: self-tuned at start-up)")
    p.add_argument("--max-new-tokens", type=int, default=g.max_new_tokens)
    p.add_argument("--temperature", type=float, default=SamplingConfig().temperature)
    p.add_argument("--top-p", type=float, default=SamplingConfig().top_p)
    p.add_argument("--seed", type=int, default=SamplingConfig().seed)
    p.add_argument("--ignore-eos", action="store_true")


def configs_from_args(args) -> tuple[SpecConfig, SamplingConfig, GenerationConfig]:
    spec = SpecConfig(method=getattr(args, "method", "tree"), k=args.k, nodes=args.nodes, width=args.width,
                      depth=args.depth)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                           stop=tuple(getattr(args, "stop", None) or ()))
    for c in (spec, sampling, gen):
        c.validate()
    return spec, sampling, gen


def _generate(args) -> int:
    from tandem.runtime.generate import Generator
    from tandem.runtime.pair import load_pair

    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read --prompt-file {args.prompt_file!r}: {e.strerror}") from None
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise ConfigError("no prompt: give PROMPT or --prompt-file F")
    spec, sampling, gen = configs_from_args(args)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=args.method != "ar")
    engine = Generator(pair.target, pair.draft, pair.tokenizer)
    ids = pair.tokenizer.encode(prompt).ids
    streamed: list[int] = []
    printed = [0]

    def stream(new: list[int]) -> None:
        streamed.extend(new)
        text = pair.tokenizer.decode(streamed)
        # NOTE: hold back a trailing U+FFFD: a multi-byte character may be split across tokens.
        safe = text.rstrip("\ufffd")
        sys.stdout.write(safe[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(safe)

    res = engine.generate(ids, args.method, spec, sampling, gen, on_tokens=None if args.json else stream,
                          transport=args.transport, tensor_parallel_size=args.tensor_parallel_size,
                          draft_tensor_parallel_size=args.draft_tensor_parallel_size, split_search=args.split_search)
    text = res.stop_trimmed_text if res.stop_trimmed_text is not None else pair.tokenizer.decode(res.token_ids)
    if args.json:
        print(json.dumps({
            "text": text, "token_ids": res.token_ids, "prompt_tokens": res.prompt_tokens,
            "new_tokens": res.new_tokens, "method": res.method, "tau": round(res.tau, 4),
            "target_passes": res.target_passes, "draft_steps": res.draft_steps,
            "accept_lengths": res.accept_lengths, "finish_reason": res.finish_reason,
            "seconds": round(res.seconds, 4), "ttft": round(res.ttft, 4),
            "tokens_per_s": round(res.tokens_per_s, 2), "device": str(pair.target.device),
            "dtype": args.dtype,
        }))
    else:
        if res.stop_trimmed_text is None:
            sys.stdout.write(text[printed[0]:])
        sys.stdout.write("\n")
        print(f"[{res.method}: {res.new_tokens} tokens in {res.seconds:.2f}s, {res.tokens_per_s:.1f} tok/s, "
              f"tau {res.tau:.2f}, {res.target_passes} target passes]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Lossless speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--method", default="tree", choices=["ar", "chain", "tree", "async"])
    g.add_argument("--transport", default="auto", choices=["auto", "inline", "streams", "gloo", "nccl"],
                   help="async only: how draft and target workers talk (auto: streams on CUDA, inline on CPU)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="async with --transport gloo|nccl: shard the target over this many processes (GPUs with "
                        "nccl: the target on GPUs 0..n-1 from its device, the draft on the next)")
    g.add_argument("--draft-tensor-parallel-size", type=int, default=1,
                   help="async with --transport gloo|nccl: shard the draft over this many processes (with nccl "
                        "the GPUs after the target's: SwiftSpec's x : k-x split)")
    g.add_argument("--split-search", type=int, default=None, metavar="K",
                   help="async with --transport gloo|nccl: try every x : K-x split of K workers on a short trial "
                        "and use the fastest (instead of the two tensor-parallel sizes)")
    add_model_arguments(g)
    add_decoding_arguments(g)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=_generate)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # an optional dependency (e.g. matplotlib) is missing
            sp.set_defaults(func=lambda a, e=e, n=name: _missing(n, e))
            continue
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.run)
    return parser


def _missing(name: str, e: ImportError) -> int:
    raise ConfigError(f"`tandem {name}` needs {e.name or 'an optional package'}; install with pip install 'tandem[bench]'")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
