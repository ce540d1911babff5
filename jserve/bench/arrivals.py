"""When each request is sent: all at once (rate inf), a Poisson process, or gamma-distributed gaps.

As in vLLM, the gap between requests is Gamma(shape=burstiness, scale=1 / (rate * burstiness)): its mean is
always 1 / rate; burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps(rng: np.random.Generator, n: int, request_rate: float, burstiness: float = 1.0) -> np.ndarray:
    """n gaps in seconds; gap i is the wait after sending request i."""
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def arrival_offsets(rng: np.random.Generator, n: int, request_rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Send times relative to the start: the first request goes at once, each later one after its gap."""
    gaps = arrival_gaps(rng, n, request_rate, burstiness)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
