"""PNG plots of a run: latency CDFs, output tokens/s over time, running/waiting requests over time.

matplotlib is the optional ``bench`` extra; without it the plots are skipped with a warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from nxdserve.bench.metrics import METRIC_TITLES, output_tokens_per_bucket, tpot_of
from nxdserve.bench.runner import BenchResult

logger = logging.getLogger(__name__)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def latency_series_ms(result: BenchResult) -> dict[str, list[float]]:
    ok = [(r, n) for r, n in zip(result.records, result.output_lens, strict=True) if r.success]
    tpots = [tpot_of(r, n) for r, n in ok]
    return {
        "ttft": [1000 * (r.ttft or 0.0) for r, _ in ok],
        "tpot": [1000 * t for t in tpots if t is not None],
        "itl": [1000 * g for r, _ in ok for g in r.itl],
        "e2el": [1000 * r.latency for r, _ in ok],
    }


def make_plots(result: BenchResult, plot_dir: str) -> list[str]:
    """Write the PNGs into ``plot_dir``; returns their paths (empty if matplotlib is missing)."""
    plt = _pyplot()
    if plt is None:
        logger.warning("matplotlib is not installed (pip install 'nxdserve[bench]'); skipping plots")
        return []
    os.makedirs(plot_dir, exist_ok=True)
    paths = [_plot_cdfs(plt, result, plot_dir), _plot_throughput(plt, result, plot_dir)]
    load = _plot_load(plt, result, plot_dir)
    if load:
        paths.append(load)
    return paths


def _plot_cdfs(plt: Any, result: BenchResult, plot_dir: str) -> str:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, values) in zip(axes.flat, latency_series_ms(result).items(), strict=True):
        ax.set_title(METRIC_TITLES[name])
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if values:
            xs = np.sort(values)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
            ax.axvline(float(np.median(xs)), color="gray", linestyle="--", linewidth=0.8, label="median")
            ax.legend(loc="lower right")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"Latency CDFs: {result.model}, {len(result.records)} requests")
    fig.tight_layout()
    path = os.path.join(plot_dir, "latency_cdf.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_throughput(plt: Any, result: BenchResult, plot_dir: str) -> str:
    bucket = 1.0 if result.duration_s > 10 else 0.25
    # Spread each request's token count over its chunks, so a chunk of several tokens counts them all.
    weights = [
        n / len(r.chunk_times) if r.chunk_times else 0.0
        for r, n in zip(result.records, result.output_lens, strict=True)
    ]
    counts = output_tokens_per_bucket(result.records, result.start_time, bucket, weights) / bucket
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(np.arange(len(counts)) * bucket, counts, drawstyle="steps-post")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Output throughput over time ({bucket:g} s buckets)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(plot_dir, "tokens_per_second.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_load(plt: Any, result: BenchResult, plot_dir: str) -> str | None:
    samples = result.load_samples
    if not samples:
        logger.info("no /metrics samples; skipping the running/waiting plot (%s)", result.load_note or "none")
        return None
    ts = [s.time - result.start_time for s in samples]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(
        ts, [s.running if s.running is not None else np.nan for s in samples], label="running", drawstyle="steps-post"
    )
    ax.plot(
        ts, [s.waiting if s.waiting is not None else np.nan for s in samples], label="waiting", drawstyle="steps-post"
    )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests")
    ax.set_title("Server queue (from /metrics)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(plot_dir, "server_load.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
