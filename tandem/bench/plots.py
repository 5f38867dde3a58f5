"""PNG plots of benchmark and profile results (matplotlib, Agg backend, imported lazily)."""
from __future__ import annotations

import sys
from pathlib import Path


def available() -> bool:
    """Whether matplotlib imports; if not, says on stderr that the PNGs are skipped (the results
    files are written all the same)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("tandem: note: PNG plots skipped: matplotlib is not installed (pip install matplotlib; "
              "--no-plots skips them)", file=sys.stderr)
        return False
    return True


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tokens_per_s_cdf(per_method: dict[str, list[float]], path: Path) -> Path:
    """Empirical CDF of per-request decode tokens/s, one line per method."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, vals in per_method.items():
        v = sorted(x for x in vals if x is not None and x > 0)
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=name)
    ax.set_xlabel("decode tokens/s per request")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Per-request decode speed (CDF)")
    return _save(fig, path)


def accept_length_hist(per_method: dict[str, list[int]], path: Path) -> Path:
    """Histogram of accepted draft tokens per target pass (bonus excluded), one bar group per method."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    methods = [m for m, v in per_method.items() if v]
    top = max((max(v) for v in per_method.values() if v), default=0)
    width = 0.8 / max(1, len(methods))
    for j, name in enumerate(methods):
        v = per_method[name]
        counts = [v.count(k) / len(v) for k in range(top + 1)]
        ax.bar([k - 0.4 + width * (j + 0.5) for k in range(top + 1)], counts, width=width, label=name)
    ax.set_xlabel("accepted draft tokens per target pass")
    ax.set_ylabel("fraction of passes")
    ax.grid(alpha=0.3, axis="y")
    if methods:
        ax.legend(fontsize=8)
    ax.set_title("Acceptance length")
    return _save(fig, path)


def tau_vs_nodes(tau: dict[int, float], path: Path) -> Path:
    """tau (tokens per target pass) against the node budget N."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ns = sorted(tau)
    ax.plot(ns, [tau[n] for n in ns], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("node budget N")
    ax.set_ylabel("tau (tokens per target pass)")
    ax.grid(alpha=0.3)
    ax.set_title("tau vs node budget")
    return _save(fig, path)


def cost_model(nodes: list[int], c: list[float], speedup: list[float | None] | None, path: Path) -> Path:
    """c(N) = T_step(N) / T_AR, and the predicted speedup when a tau table was given."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(nodes, c, marker="o", label="c(N) = T_step(N) / T_AR")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows verified per pass N")
    ax.set_ylabel("relative step cost c(N)")
    ax.grid(alpha=0.3)
    if speedup and any(s is not None for s in speedup):
        ax2 = ax.twinx()
        pts = [(n, s) for n, s in zip(nodes, speedup) if s is not None]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", color="tab:red", label="predicted speedup")
        ax2.set_ylabel("predicted speedup vs AR", color="tab:red")
        ax2.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Cost model")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def online_levels(levels: list[dict], path: Path) -> Path:
    """`bench --online`: output tokens/s and p50/p99 inter-token latency against concurrency, per method."""
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for method in dict.fromkeys(r["method"] for r in levels):
        rows = [r for r in levels if r["method"] == method]
        conc = [r["concurrency"] for r in rows]
        ax.plot(conc, [r["output_tokens_per_s"] for r in rows], marker="o", label=method)
        for q, style in (("p50", "-"), ("p99", "--")):
            ax2.plot(conc, [r["itl_ms"][q] for r in rows], style, marker="o", label=f"{method} {q}")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("inter-token latency (ms)")
    ax2.set_title("Inter-token latency")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    return _save(fig, path)
