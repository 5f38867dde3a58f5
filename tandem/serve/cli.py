"""`tandem serve`: load the pair, build one engine per served method, run uvicorn on loopback."""
from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from tandem.config import ConfigError, SpecConfig
from tandem.engine.config import EngineConfig
from tandem.serve.config import LOOPBACK, ServerConfig, default_methods, engine_config_for


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.cli import add_model_arguments

    s, e, spec = ServerConfig(), EngineConfig(), SpecConfig()
    add_model_arguments(p)
    p.add_argument("--host", default=s.host, help=f"bind address (default {LOOPBACK}: this machine only)")
    p.add_argument("--port", type=int, default=s.port, help="0 picks a free port (printed at start)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="required as 'Authorization: Bearer KEY' on every /v1 route (default: $TANDEM_API_KEY)")
    p.add_argument("--served-model-name", default=s.served_model_name, help="the `model` name requests use")
    p.add_argument("--methods", default=None,
                   help="comma list of ar | chain | tree served; the first is the default (default: tree,ar with "
                        "--draft; the bundled pair: tree,ar on cuda, ar,tree on cpu; ar with --target alone)")
    p.add_argument("--chat-template", default=None, help="jinja2 file overriding the checkpoint's chat template")
    p.add_argument("--max-pending", type=int, default=s.max_pending,
                   help="requests in flight at most; more get 503 with Retry-After")
    p.add_argument("--max-tokens-limit", type=int, default=s.max_tokens_limit, help="largest max_tokens accepted")
    p.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="requests decoded together at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens,
                   help="rows of one target pass")
    p.add_argument("--long-prefill-token-threshold", type=int, default=e.long_prefill_token_threshold,
                   help="a prompt's prefill chunk per step at most this many tokens, so long prompts do not stretch "
                        "the steps of decoding requests (the inter-token tail); 0: off")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per engine (default: max-num-seqs "
                   "full context windows)")
    p.add_argument("--block-size", type=int, default=e.block_size)
    p.add_argument("--k", type=int, default=spec.k, help="draft tokens per step for chain")
    p.add_argument("--nodes", type=int, default=spec.nodes, help="node budget N for tree")
    p.add_argument("--width", type=int, default=spec.width, help="leaves expanded per round for tree")
    p.add_argument("--depth", type=int, default=spec.depth, help="expansion rounds for tree (default from N/w)")
    p.add_argument("--batch-parallel", action="store_true",
                   help="MineDraft: verify one half of the running requests while the other half drafts")
    p.add_argument("--row-selection", action="store_true",
                   help="SpecPilot: one node budget per step shared by all requests (a request may get none)")
    p.add_argument("--draft-gate", action=argparse.BooleanOptionalAction, default=None,
                   help="skip drafting in steps where its cost is not repaid (default: on with --row-selection "
                        "and on a GPU); "
                        "--no-draft-gate turns it off")
    p.add_argument("--adaptive-draft", action="store_true",
                   help="a per-request draft length: each request's draft confidence calibrated by its recent "
                        "acceptance decides how many drafted nodes it verifies")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant arithmetic: a request's greedy output does not depend on the requests "
                        "batched with it, nor on speculation (slower)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="`ar` with greedy requests: queue each step's pass before reading the last step's tokens, "
                        "so the host's bookkeeping overlaps the GPU (default: on a GPU)")
    p.add_argument("--inject-faults", action="store_true",
                   help="testing only (the reliability harness): a request with user 'tandem-fault' fails inside "
                        "the engine, one with user 'tandem-kill' stops the engine loop")
    p.add_argument("--max-chunk-rate", type=float, default=s.max_chunk_rate,
                   help="chunks a second sent over all open streams together (0: one a step); each stream joins "
                        "the steps between its chunks, so the server keeps up at many streams")
    p.add_argument("--shutdown-grace", type=float, default=s.shutdown_grace_s,
                   help="seconds in-flight requests may run after SIGTERM; then each gets 503")
    p.add_argument("--engine-process", action="store_true",
                   help="run the engines in a process of their own: the engine loop then shares no interpreter "
                        "lock with the HTTP side (streams that fall behind get several steps' tokens a chunk)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build(args, check_address: bool = False) -> tuple[object, ServerConfig]:
    """Args -> (the FastAPI app, its ServerConfig); ConfigError on bad input (with check_address,
    also when --host / --port cannot be listened on: before the models load)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"`tandem serve` needs {e.name}; install with pip install 'tandem[serve]'") from None
    from tandem.runtime.pair import load_pair
    from tandem.serve.app import Server, create_app
    from tandem.serve.chat_template import ChatTemplate
    from tandem.serve.driver import spare_main_thread

    methods = (tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods is not None
               else default_methods(args.target, args.draft, args.device))
    cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
                       methods=methods, max_pending=args.max_pending, max_tokens_limit=args.max_tokens_limit,
                       max_chunk_rate=args.max_chunk_rate, shutdown_grace_s=args.shutdown_grace,
                       inject_faults=args.inject_faults)
    cfg.validate()
    spec = SpecConfig(k=args.k, nodes=args.nodes, width=args.width, depth=args.depth)
    ecfg = EngineConfig(spec=spec, block_size=args.block_size, num_blocks=args.num_blocks,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        batch_parallel=args.batch_parallel, row_selection=args.row_selection,
                        draft_gate=args.draft_gate, adaptive_draft=args.adaptive_draft,
                        deterministic=args.deterministic, async_scheduling=args.async_scheduling)
    if (args.batch_parallel or args.row_selection or args.adaptive_draft) and methods == ("ar",):
        raise ConfigError("--batch-parallel / --row-selection / --adaptive-draft need a speculative method in "
                          "--methods (chain or tree)")
    for m in methods:
        engine_config_for(ecfg, m).validate()
    if check_address:
        check_bind(cfg.host, cfg.port)
    if args.engine_process:  # this process keeps the tokenizer and the template; the engine process the models
        server = process_server(args, cfg, ecfg)
    else:
        # on the CPU the engine thread gets torch's intra-op threads and the main thread (HTTP) one
        threads = spare_main_thread(args.device)
        pair = load_pair(args.target, args.draft, args.device, args.dtype, need_draft=any(m != "ar" for m in methods))
        template = ChatTemplate.for_checkpoint(pair.target_dir, args.chat_template)
        server = Server(pair.target, pair.draft, pair.tokenizer, cfg, ecfg, template, engine_threads=threads)
    return create_app(server), cfg


def process_server(args, cfg: ServerConfig, ecfg: EngineConfig):
    """A Server whose engines run in a process of their own (tandem.serve.engine_process)."""
    from tandem.runtime.pair import target_tokenizer
    from tandem.serve.app import Server
    from tandem.serve.chat_template import ChatTemplate
    from tandem.serve.engine_process import EngineSpec

    target_dir, tokenizer = target_tokenizer(args.target)  # (the engine process loads the models)
    template = ChatTemplate.for_checkpoint(target_dir, getattr(args, "chat_template", None))
    spec = EngineSpec(args.target, args.draft, args.device, args.dtype, cfg.methods, ecfg, cfg.inject_faults)
    return Server(None, None, tokenizer, cfg, ecfg, template, engine_process=spec)


def check_bind(host: str, port: int) -> None:
    """ConfigError in one line when the server could not listen on host:port (a name that does not
    resolve, a port in use or not ours to take), checked before the models load; uvicorn would
    otherwise log its error and exit with status 3 after the load."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} does not resolve ({e.strerror}); give an IP address such as "
                          f"127.0.0.1, or a name this machine resolves") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is in use; pick another with --port (0 picks a free "
                                  f"one)") from None
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror})") from None


def run(args) -> int:
    app, cfg = build(args, check_address=True)
    from tandem.serve.runner import make_server

    if cfg.host not in (LOOPBACK, "localhost", "::1"):
        print(f"tandem: note: binding {cfg.host}: reachable from other machines"
              + ("" if cfg.api_key else " WITHOUT an API key"), file=sys.stderr)
    # NOTE: uvicorn handles SIGINT / SIGTERM: stop accepting, let in-flight requests finish for
    # --shutdown-grace seconds, then each one left gets 503 server_shutting_down (runner.py)
    make_server(app, app.state.server, cfg.host, cfg.port, args.log_level).run()
    return 0
