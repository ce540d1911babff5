"""Serving metrics computed as vLLM's `bench serve` does, from per-request timings.

- TTFT: send -> first chunk carrying content.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: the gap between consecutive content chunks, over all requests (a chunk may carry several tokens).
- E2EL: send -> last chunk.
- goodput: completed requests per second that met every given SLO (ttft, tpot, e2el, in ms).
Times are seconds internally and milliseconds in the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request's outcome; chunk_times are absolute (perf_counter) times of content chunks."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be positive")
        slos[name] = ms / 1000.0
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(values[name] <= limit for name, limit in slos.items())


def summarize(values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """mean, median, std and percentiles in milliseconds (all 0 when there are no values, as in vLLM)."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    stats = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    stats.update({f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})
    return stats


def compute_metrics(results: Sequence[RequestResult], duration_s: float, slos: dict[str, float] | None = None,
                    percentiles: Sequence[float] = PERCENTILES) -> dict:
    """The benchmark's summary: counts, throughputs, goodput and latency statistics (ms)."""
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    metrics = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if slos:
        metrics["request_goodput"] = sum(meets_slos(r, slos) for r in done) / duration_s
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name in LATENCY_METRICS:
        for stat, value in summarize(series[name], percentiles).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def output_tokens_over_time(results: Sequence[RequestResult], start: float, bin_s: float = 1.0) -> np.ndarray:
    """Output tokens completed in each bin_s window since start; a request's tokens are spread evenly over its
    content chunks, since a streamed chunk does not say how many tokens it carries."""
    times, weights = [], []
    for r in results:
        if r.success and r.chunk_times:
            times.extend(r.chunk_times)
            weights.extend([r.output_tokens / len(r.chunk_times)] * len(r.chunk_times))
    if not times:
        return np.zeros(0)
    offsets = np.asarray(times) - start
    bins = int(np.floor(offsets.max() / bin_s)) + 1
    return np.bincount(np.floor(offsets / bin_s).astype(np.int64), weights=weights, minlength=bins)
