"""`tandem generate | bench | audit | profile | serve | train-pair` (also `python -m tandem`).

Every subcommand reads its defaults from the config dataclasses; user mistakes become one
line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import secrets
import sys
from pathlib import Path

from tandem.config import MAX_DRAFT_TOKENS, MAX_WIDTH, ConfigError, GenerationConfig, SamplingConfig, SpecConfig

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "bench": ("tandem.bench.command", "benchmark methods on a workload, paired and checked against ar"),
    "audit": ("tandem.bench.audit", "token-forcing audit that a method's output is lossless"),
    "profile": ("tandem.bench.profile", "cost model: verify/draft step times and predicted speedup"),
    "train-pair": ("tandem.train", "train the bundled draft/target pair from Python source"),
    "train-drafters": ("tandem.train.drafters", "train feature drafters (block drafter, EAGLE-3 head) for a target"),
    "convert": ("tandem.quant.convert", "write a lossless W12 (12-bit) copy of a bf16 checkpoint"),
    "serve": ("tandem.serve.cli", "OpenAI-compatible HTTP server over the batched engine (needs tandem[serve])"),
}


def add_model_arguments(p: argparse.ArgumentParser, dtype_default: str = "float32") -> None:
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the bundled pair)")
    p.add_argument("--draft", default=None,
                   help="draft checkpoint dir, or a bundled drafter: draft, eagle3, block (default without --target: "
                        "the bundled draft model; `generate` on cuda with auto, chain or tree: the bundled eagle3 "
                        "head; with --target, every method but ar needs --draft)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")
    p.add_argument("--dtype", default=dtype_default, choices=["float32", "bfloat16", "float16"])


def add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    s, g = SpecConfig(), GenerationConfig()
    cap = f"at most min({MAX_DRAFT_TOKENS}, context window - 1)"
    p.add_argument("--k", type=int, default=s.k, help=f"draft tokens per step for chain ({cap})")
    p.add_argument("--nodes", type=int, default=s.nodes, help=f"node budget N for tree and async ({cap})")
    p.add_argument("--width", type=int, default=s.width,
                   help=f"leaves expanded per round (w) for tree and async (at most {MAX_WIDTH})")
    p.add_argument("--depth", type=int, default=s.depth,
                   help="tree: expansion rounds per tree (default from N/w); async: rounds run while the target "
                        "verifies (default: self-tuned at start-up); at most N's cap / w")
    p.add_argument("--max-new-tokens", type=int, default=g.max_new_tokens,
                   help="at most the context window minus the prompt")
    p.add_argument("--temperature", type=float, default=SamplingConfig().temperature)
    p.add_argument("--top-p", type=float, default=SamplingConfig().top_p)
    p.add_argument("--seed", type=int, default=SamplingConfig().seed,
                   help="any integer (taken modulo 2**64; generate's default: a random one, printed when sampling)")
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


MAX_PROCESSES = max(8, os.cpu_count() or 1)  # async's process transports: target + draft shards


def notice(message: str) -> None:
    """A one-line notice on stderr: a value was capped or an option has no effect."""
    print(f"tandem: note: {message}", file=sys.stderr)


def read_prompt_file(path: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read --prompt-file {path!r}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompt-file {path!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start}); give a text file") from None
    if "\x00" in text:
        raise ConfigError(f"--prompt-file {path!r} holds NUL bytes (a binary file?); give a text file")
    return text


# the draft-shape flags each method reads (auto reads them all: its trials run chain and tree)
SHAPE_FLAGS = {"auto": {"k", "nodes", "width", "depth"}, "ar": set(), "chain": {"k"}, "tree": {"nodes", "width", "depth"},
               "async": {"nodes", "width", "depth"}, "tlv": {"nodes", "width"}}


def _check_generate_args(args) -> None:
    """Flags that only some methods or transports read: refused where they would be ignored."""
    if args.prompt_file and args.prompt is not None:
        raise ConfigError("give PROMPT or --prompt-file F, not both")
    if args.split_search is not None and args.split_search < 2:
        raise ConfigError(f"--split-search K needs K >= 2 workers, one per model (got {args.split_search})")
    tp, dp = args.tensor_parallel_size, args.draft_tensor_parallel_size
    if tp < 1 or dp < 1:
        raise ConfigError(f"--tensor-parallel-size and --draft-tensor-parallel-size must be >= 1 (got {tp}, {dp})")
    workers = args.split_search if args.split_search is not None else tp + dp
    if workers > MAX_PROCESSES:
        # NOTE: every process holds its own copy of its model's shard; nccl also checks the GPU count
        raise ConfigError(f"{workers} worker processes asked for (tensor-parallel sizes or --split-search); "
                          f"at most {MAX_PROCESSES} on this machine")
    # NOTE: named serial methods, so a future method that may run async (auto) is not refused
    if args.method in ("auto", "ar", "chain", "tree", "tlv") and args.transport != "auto":
        raise ConfigError(f"--transport works with --method async, not {args.method!r}")
    reads = SHAPE_FLAGS[args.method]
    for name in ("k", "nodes", "width", "depth"):
        if getattr(args, name) is not None and name not in reads:
            used = ", ".join(f"--{f}" for f in ("k", "nodes", "width", "depth") if f in reads)
            raise ConfigError(f"--{name} is not read by --method {args.method}"
                              + (f" (it reads {used}); drop it" if used else "; drop it"))
        if getattr(args, name) is None:  # (None: not given; the default then)
            setattr(args, name, getattr(SpecConfig(), name))
    if args.method == "ar" and args.draft is not None:
        # a note, not an error: a pair is kept while the method changes (scripts, comparisons)
        notice(f"--draft {args.draft} is not used by --method ar (plain decoding drafts nothing); not loaded")
        args.draft = None


def _generate(args) -> int:
    from tandem.runtime.generate import Generator
    from tandem.runtime.pair import default_drafter, load_pair
    from tandem.runtime.streaming import StopStreamer

    _check_generate_args(args)
    if args.prompt_file:
        prompt = read_prompt_file(args.prompt_file)
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise ConfigError("no prompt: give PROMPT or --prompt-file F")
    drawn = args.seed is None
    if drawn:
        args.seed = secrets.randbits(63)
    spec, sampling, gen = configs_from_args(args)
    if args.target is None and args.draft is None:
        args.draft = default_drafter(args.method, args.device, args.certified_head)
        if args.draft is not None:
            notice("drafter: the bundled EAGLE-3 head, the fastest on a GPU (--draft draft: the small draft model)")
    pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=args.method != "ar",
                     method=args.method)
    engine = Generator(pair.target, pair.draft, pair.tokenizer, certified_head=args.certified_head)
    ids = pair.tokenizer.encode(prompt).ids
    ctx = engine.context_window
    reads = SHAPE_FLAGS[args.method]
    for note in spec.capped(ctx)[1]:
        if note.split()[0].lstrip("-") in reads:  # (not a flag this method never reads)
            notice(note)
    if 0 < ctx - len(ids) < gen.max_new_tokens:
        notice(f"--max-new-tokens {gen.max_new_tokens} capped to {ctx - len(ids)}: the context window is {ctx} "
               f"tokens and the prompt takes {len(ids)}")
    streamer = StopStreamer(pair.tokenizer.decode, gen.stop)

    def stream(new: list[int]) -> None:
        sys.stdout.write(streamer.push(new))
        sys.stdout.flush()

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
            **({"q_agreement": round(res.q_agreement, 4)} if hasattr(res, "q_agreement") else {}),
            **({"auto_pick": res.auto_pick} if res.auto_pick else {}),  # --method auto: the shape it ran
            **({"seed": args.seed} if not sampling.greedy else {}),  # (drawn or given: what repeats it)
        }))
    else:
        sys.stdout.write(streamer.finish(text) + "\n")
        seed = f", seed {args.seed} (--seed {args.seed} repeats it)" if drawn and not sampling.greedy else ""
        print(f"[{res.auto_pick or res.method}: {res.new_tokens} tokens in {res.seconds:.2f}s, {res.tokens_per_s:.1f} tok/s, "
              f"tau {res.tau:.2f}, {res.target_passes} target passes{seed}]", file=sys.stderr)
    return 0


def package_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:  # a checkout run without installing it
        import tandem

        return tandem.__version__


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (an unknown choice, a value that is not a number), as
    every other input error: not the usage block first. Subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"tandem: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tandem", description="Lossless speculative decoding engine")
    parser.add_argument("--version", action="version", version=f"tandem {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--method", default="auto", choices=["auto", "ar", "chain", "tree", "async", "tlv"],
                   help="auto (default): the fastest of ar / chain / tree, measured on a short trial and printed; "
                        "tlv: two-level verification (greedy)")
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
    g.set_defaults(k=None, nodes=None, width=None, depth=None)  # given or not: _check_generate_args
    # a sampled run without --seed differs from run to run (vLLM's and transformers' habit); its
    # seed is printed so it can be repeated. (bench and audit keep seed 0: reproducible figures)
    g.set_defaults(seed=None)
    g.add_argument("--certified-head", action="store_true",
                   help="greedy ar/chain/tree: verify through the certified INT8 LM head (same tokens; the "
                        "target runs without CUDA graphs); refused with sampling")
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
    except RuntimeError as e:  # a worker process that failed or stalled: its one line, not a traceback
        from tandem.runtime.workers import WorkerError

        if not isinstance(e, WorkerError):
            raise
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        return 141  # 128 + SIGPIPE, the status a shell reports for a tool stopped by a closed pipe
    except OSError as e:  # a path the user gave that cannot be written or read, a full disk
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
