"""PNG plots of a run: latency CDFs (TTFT, end to end) and, for a concurrency sweep,
throughput and p99 TTFT against concurrency. matplotlib with the Agg backend."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str) -> None:
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def _concurrency_axis(ax, cs: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.minorticks_off()
    ax.set_xlabel("max concurrency")


def plot_all(plot_dir: str | Path, name: str, runs: list[dict]) -> list[Path]:
    """Write ``<name>_latency_cdf.png`` and, with more than one run, ``<name>_sweep_throughput.png``
    and ``<name>_sweep_ttft_p99.png``; return the paths."""
    plt = _plt()
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        label = f"concurrency {run['max_concurrency']}" if len(runs) > 1 else name
        ok = [r for r in run["records"] if r["ok"]]
        _cdf(axes[0], [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None], label)
        _cdf(axes[1], [r["e2e_ms"] for r in ok if r["e2e_ms"] is not None], label)
    for ax, what in zip(axes, ("Time to first token", "End-to-end latency"), strict=True):
        ax.set_title(f"{what}: {name}")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.ticklabel_format(axis="x", style="plain", useOffset=False)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    paths.append(out / f"{name}_latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if len(runs) > 1:
        cs = [run["max_concurrency"] for run in runs]
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        ax.plot(cs, [run["figures"]["output_token_throughput"] for run in runs], "o-", label="output tok/s")
        ax.plot(cs, [run["figures"]["total_token_throughput"] for run in runs], "s-", label="total tok/s")
        ax2 = ax.twinx()
        ax2.plot(cs, [run["figures"]["request_throughput"] for run in runs], "^--", color="gray", label="req/s")
        ax2.set_ylabel("requests / s")
        _concurrency_axis(ax, cs)
        ax.set_ylabel("tokens / s")
        ax.set_title(f"Throughput vs concurrency: {name}")
        ax.grid(alpha=0.3)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize="small")
        fig.tight_layout()
        paths.append(out / f"{name}_sweep_throughput.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        ttft = [(run["figures"]["ttft_ms"] or {}).get("p99") for run in runs]
        ax.plot(cs, ttft, "o-", color="tab:red")
        _concurrency_axis(ax, cs)
        ax.set_ylabel("p99 TTFT (ms)")
        ax.set_title(f"p99 time to first token vs concurrency: {name}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / f"{name}_sweep_ttft_p99.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
