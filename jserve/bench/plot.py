"""The `bench serve --plot` PNG: latency CDFs and output throughput over time. Needs matplotlib (jserve[bench])."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jserve.bench.metrics import RequestResult, output_tokens_over_time


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'jserve[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    return plt


def latency_series(results: Sequence[RequestResult]) -> dict[str, np.ndarray]:
    done = [r for r in results if r.success]
    return {"TTFT": np.array([r.ttft for r in done]) * 1000,
            "TPOT": np.array([r.tpot for r in done if r.tpot is not None]) * 1000,
            "ITL": np.array([gap for r in done for gap in r.itl]) * 1000,
            "E2EL": np.array([r.latency for r in done]) * 1000}


def _bin_width(results: Sequence[RequestResult], start: float) -> float:
    """About 40 bars over the run, in round steps of 0.1 s to 10 s."""
    ends = [r.chunk_times[-1] for r in results if r.chunk_times]
    span = max(ends) - start if ends else 1.0
    steps = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
    return next((s for s in steps if span / s <= 40), steps[-1])


def plot_serve(results: Sequence[RequestResult], start: float, path: Path, title: str = "") -> None:
    plt = _pyplot()
    fig, (cdf, rate) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in latency_series(results).items():
        values = np.sort(values[values > 0])  # a log axis cannot show 0 (e.g. ITL of a multi-token chunk)
        if values.size:
            cdf.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=name)
    cdf.set_xscale("log")
    cdf.xaxis.set_minor_formatter(plt.NullFormatter())  # labelled minor ticks overlap on short ranges
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of requests (ITL: of chunks)")
    cdf.set_title("latency CDFs")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend()
    bin_s = _bin_width(results, start)
    tokens = output_tokens_over_time(results, start, bin_s)
    rate.bar(np.arange(tokens.size) * bin_s, tokens / bin_s, width=bin_s, align="edge")
    rate.set_xlabel("time since the first request (s)")
    rate.set_ylabel("output tokens/s")
    rate.set_title(f"output throughput over time ({bin_s:g} s bins)")
    rate.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
