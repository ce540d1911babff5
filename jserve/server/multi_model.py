"""Several models on one server: what each is called, how the KV-cache memory is split between them, and one
Prometheus page with every model's series.

Each model has its own engine (AsyncEngine and engine thread), tokenizer, metrics (labelled `model_name`) and
queue limits; the server routes a request by its `model` field (jserve/server/state.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from jserve.config import EngineConfig

logger = logging.getLogger(__name__)

# A fallback response names the model the client asked for in this header (its `model` field names the one that
# served it).
FALLBACK_HEADER = "x-jserve-fallback"


@dataclass(frozen=True)
class ServedModel:
    """One model of a server: the name clients use in `model`, and its engine settings."""

    name: str
    config: EngineConfig


def default_name(model: str) -> str:
    """The name a model is served under on a several-model server: its directory's (or file's) name."""
    return Path(model.rstrip("/")).name or model


def check_names(models: Sequence[ServedModel], fallback: str | None) -> None:
    names = [m.name for m in models]
    if not models:
        raise ValueError("a server needs at least one model")
    for name in names:
        if not name or names.count(name) > 1:
            raise ValueError(f"several models are served as {name!r}: give each its own --served-model-name")
    if fallback is not None and fallback not in names:
        raise ValueError(f"the fallback model {fallback!r} is not one of the served models {names}")


# ----- the KV-cache split -----

def available_memory() -> tuple[int | None, int]:
    """(free memory of the first device where it reports it, else None; the memory KV caches may take in all): on a
    CPU the host's MemAvailable."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        free = int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        return free, free
    return None, _host_available()


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budgets(requested: Sequence[int | None], device_free: int | None, available: int, fraction: float,
               default_budget: int) -> list[int]:
    """Each model's KV-cache bytes. Budgets a model sets are kept; the rest share evenly what the server's default
    budget (`fraction` of the device's free memory, else `default_budget`) leaves. Raises ValueError when nothing is
    left for them, or when the budgets together exceed `available`."""
    total = int(device_free * fraction) if device_free is not None else default_budget
    unset = [i for i, b in enumerate(requested) if b is None]
    budgets = list(requested)
    if unset:
        left = total - sum(b for b in requested if b is not None)
        share = left // len(unset)
        if share <= 0:
            raise ValueError(f"the models with their own KV budget take {total - left} bytes, leaving nothing of the "
                             f"default budget of {total} bytes for the other {len(unset)}; give each its own "
                             "--kv-cache-memory-bytes")
        for i in unset:
            budgets[i] = share
        logger.info("KV cache: the default budget of %d bytes is split evenly: %d bytes for each of %d models",
                    left, share, len(unset))
    if sum(budgets) > available:
        raise ValueError(f"the models' KV caches need {sum(budgets)} bytes together ({' + '.join(map(str, budgets))})"
                         f" but only {available} bytes are available; lower --kv-cache-memory-bytes")
    return budgets


def plan_kv_budgets(models: Sequence[ServedModel]) -> list[ServedModel]:
    """The models with every KV budget set explicitly (so no engine sizes its cache from the memory the engines
    loaded before it left), checked against the memory available now."""
    from jserve.engine.engine import DEFAULT_KV_CACHE_BYTES

    device_free, available = available_memory()
    budgets = kv_budgets([m.config.kv_cache_memory_bytes for m in models], device_free, available,
                         models[0].config.kv_cache_fraction, DEFAULT_KV_CACHE_BYTES)
    for m, budget in zip(models, budgets, strict=True):
        logger.info("KV cache of %s: %d bytes", m.name, budget)
    return [ServedModel(m.name, m.config.replace(kv_cache_memory_bytes=b)) for m, b in zip(models, budgets,
                                                                                          strict=True)]


# ----- metrics -----

class _Merged(Collector):
    """Every family of several registries once, with the samples of all (each labelled by its model_name): the text
    format allows one HELP/TYPE per family."""

    def __init__(self, registries: Sequence[CollectorRegistry]):
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self._registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(family.samples)
        yield from families.values()


def render_merged(registries: Sequence[CollectorRegistry]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(registries))
    return generate_latest(registry)
