"""Online load against a running `tandem serve`: fixed concurrency levels, bounded count and time.

    python -m tandem serve --port 8000 &            # or any OpenAI-compatible server
    python bench/serve_load.py --url http://127.0.0.1:8000 --concurrency 1,4,8 --requests 16 \
        --max-tokens 32 --methods ar,tree --json out.json

Per (method, concurrency): `requests` streamed completions (greedy, prompts cycled from a small
Python-source list), at most `concurrency` in flight, stopped after `--max-seconds`. Reports
requests/s, output tokens/s, TTFT and inter-token latency (between SSE chunks that carry text,
divided by the tokens they carry is not possible from text alone, so per chunk) and end-to-end
latency percentiles, and the errors (HTTP status or transport) counted, never raised.
Only loopback URLs are accepted unless --allow-remote is given.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from urllib.parse import urlparse

import httpx

PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(", "# sort a list\n", "def main():",
           "x = [", "while True:", "def read_file(path):", "from collections import"]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one(client: httpx.AsyncClient, prompt: str, args, method: str) -> dict:
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if method != "default":
        body["method"] = method
    t0 = time.perf_counter()
    first, marks, tokens = None, [], 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "usage" in ev and ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
                if ev.get("choices") and ev["choices"][0].get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    marks.append(now)
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "e2e": end - t0, "tokens": tokens,
            "itl": [b - a for a, b in zip(marks, marks[1:])]}


async def level(args, method: str, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    deadline = time.perf_counter() + args.max_seconds
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def guarded(i: int, client) -> dict:
        async with sem:
            if time.perf_counter() > deadline:
                return {"skipped": True}
            return await one(client, PROMPTS[i % len(PROMPTS)], args, method)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.max_seconds + 60) as client:
        results = await asyncio.gather(*(guarded(i, client) for i in range(args.requests)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "e2e" in r]
    errors: dict[str, int] = {}
    for r in results:
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    itl = [x for r in ok for x in r["itl"]]
    ms = lambda v: None if v is None else round(1000 * v, 2)  # noqa: E731
    return {"method": method, "concurrency": concurrency, "completed": len(ok), "errors": errors,
            "skipped": sum(1 for r in results if r.get("skipped")), "wall_s": round(wall, 3),
            "requests_per_s": round(len(ok) / wall, 3), "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "ttft_ms": {"p50": ms(pct([r["ttft"] for r in ok], 50)), "p99": ms(pct([r["ttft"] for r in ok], 99))},
            "itl_ms": {"p50": ms(pct(itl, 50)), "p99": ms(pct(itl, 99)),
                       "mean": ms(statistics.fmean(itl) if itl else None)},
            "e2e_ms": {"p50": ms(pct([r["e2e"] for r in ok], 50)), "p99": ms(pct([r["e2e"] for r in ok], 99))}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,4,8", help="comma list of levels")
    p.add_argument("--methods", default="default", help="comma list of ar | chain | tree (default: the server's)")
    p.add_argument("--requests", type=int, default=16, help="requests per level (bounded)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-seconds", type=float, default=120.0, help="per level; later requests are skipped")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--allow-remote", action="store_true")
    args = p.parse_args(argv)
    host = urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1") and not args.allow_remote:
        print(f"serve_load: error: {args.url} is not loopback; pass --allow-remote to load another host",
              file=sys.stderr)
        return 2
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        print(f"serve_load: error: --concurrency takes integers, e.g. 1,4,8 (got {args.concurrency!r})",
              file=sys.stderr)
        return 2
    if any(c < 1 for c in levels) or args.requests < 1 or args.max_tokens < 1:
        print("serve_load: error: concurrency, --requests and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    rows = [asyncio.run(level(args, m, c)) for m in args.methods.split(",") for c in levels]
    print(f"# serve_load {datetime.now(timezone.utc).isoformat(timespec='seconds')} {args.url} "
          f"requests={args.requests} max_tokens={args.max_tokens}")
    print("| method | conc | ok | errors | req/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | e2e p50/p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['concurrency']} | {r['completed']} | {sum(r['errors'].values())} | "
              f"{r['requests_per_s']} | {r['output_tokens_per_s']} | {r['ttft_ms']['p50']}/{r['ttft_ms']['p99']} | "
              f"{r['itl_ms']['p50']}/{r['itl_ms']['p99']} | {r['e2e_ms']['p50']}/{r['e2e_ms']['p99']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
