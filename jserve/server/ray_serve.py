"""jserve on Ray Serve: replicas of the OpenAI-compatible server behind Ray's HTTP proxy (`pip install jserve[ray]`).

    serve run jserve.server.ray_serve:build_app model=/path/to/checkpoint num_replicas=2 max_model_len=2048

`build_app(args)` is a Ray Serve application builder: every argument is a `key=value` of `serve run` (or an `args`
entry of a Serve config file). Nothing of JAX crosses a process: the deployment is given plain settings (an
EngineConfig and ServerSettings) and each replica builds its own Starlette app and engine in its constructor
(`__serve_build_asgi_app__`); the replica reports ready once its model is loaded. Ray's `check_health` asks the
server's own health (what GET /health answers), so a replica whose engine died for good is replaced. Replicas
scale on Ray's count of ongoing requests (`target_ongoing_requests`: by default the engine's running batch, so
requests beyond it mean a queue), and scale-down drains a replica for `graceful_shutdown_timeout_s` (the server's
--shutdown-timeout) before its remaining requests are aborted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import typing
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jserve.config import EngineConfig
from jserve.server.settings import ServerSettings

DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds, as `jserve serve --shutdown-timeout`


@dataclass
class RayOptions:
    """How Ray runs the replicas (the `serve run` arguments that are not engine or server settings)."""

    num_replicas: int | str = 1  # or "auto": autoscaling between min_replicas and max_replicas
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float | None = None  # None: the engine's max_num_seqs
    max_ongoing_requests: int | None = None  # None: what the engine admits (max_num_seqs + max_queued_requests)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # e.g. {"TPU": 4}
    graceful_shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT
    health_check_period_s: float = 10.0
    name: str = "jserve"


def _convert(value: Any, kind: Any) -> Any:
    """A `serve run` argument (always a string there; typed in a config file) as the field's type."""
    if not isinstance(value, str):
        return value
    text = str(kind)
    if "dict" in text:
        return json.loads(value)
    if value.lower() == "none" and "None" in text:
        return None
    if kind is bool or text == "bool":
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    if "int" in text and not (value == "auto" and "str" in text):
        return int(value)
    if "float" in text:
        return float(value)
    return value


def parse_args(args: dict[str, Any]) -> tuple[EngineConfig, ServerSettings, RayOptions]:
    """Split `serve run`'s arguments into the engine's, the server's and Ray's; unknown names are an error."""
    parts: list[tuple[type, dict]] = [(EngineConfig, {}), (ServerSettings, {}), (RayOptions, {})]
    # Names are read with `_` for `-` (`max-model-len=...` is `max_model_len=...`), shutdown_timeout included.
    args = {k.replace("-", "_"): v for k, v in args.items()}
    shutdown = args.pop("shutdown_timeout", None)
    for name, value in args.items():
        for cls, values in parts:
            hints = typing.get_type_hints(cls)
            if name in hints:
                try:
                    values[name] = _convert(value, hints[name])
                except ValueError as e:
                    raise ValueError(f"{name}={value!r}: {e}") from None
                break
        else:
            raise ValueError(f"unknown argument {name!r}: expected an EngineConfig field (model, dtype, "
                             "max_model_len, ...), a server setting (served_model_name, api_key, "
                             "max_queued_requests, ...) or a Ray option (" +
                             ", ".join(f.name for f in dataclasses.fields(RayOptions)) + ")")
    if shutdown is not None:  # `jserve serve`'s name for the drain
        parts[2][1].setdefault("graceful_shutdown_timeout_s", float(shutdown))
    (_, engine), (_, server), (_, ray_options) = parts
    return EngineConfig(**engine), ServerSettings(**server), RayOptions(**ray_options)


def deployment_options(config: EngineConfig, settings: ServerSettings, options: RayOptions) -> dict[str, Any]:
    """The `serve.deployment` options: replica resources, autoscaling on ongoing requests, health and drain."""
    capacity = config.max_num_seqs * config.data_parallel_size + settings.max_queued_requests
    max_ongoing = options.max_ongoing_requests or capacity
    # Replicas import jserve from where this process does (a checkout is not necessarily installed).
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    actor: dict[str, Any] = {"num_cpus": options.num_cpus, "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
    if options.num_gpus:
        actor["num_gpus"] = options.num_gpus
    if options.resources:
        actor["resources"] = dict(options.resources)
    out: dict[str, Any] = {
        "name": options.name, "ray_actor_options": actor, "max_ongoing_requests": max_ongoing,
        "graceful_shutdown_timeout_s": options.graceful_shutdown_timeout_s,
        "health_check_period_s": options.health_check_period_s,
    }
    if options.num_replicas == "auto":
        out["autoscaling_config"] = {
            "min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
            "target_ongoing_requests": options.target_ongoing_requests or config.max_num_seqs}
    else:
        out["num_replicas"] = int(options.num_replicas)
    return out


class JServeReplica:
    """One replica: the server's app and engine, built inside the replica's process from plain settings."""

    def __init__(self, config: EngineConfig, settings: ServerSettings):
        self._config = config
        self._settings = settings
        self._state = None

    async def __serve_build_asgi_app__(self):
        from jserve.server.app import build_app

        app = build_app(self._config, self._settings)
        self._state = state = app.state.server
        started = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def until_loaded(app) -> AsyncIterator[None]:
            # Ray runs the lifespan as the replica starts: holding it until the model is loaded keeps requests
            # off a replica that would answer 503, and a model that cannot load fails the replica's start.
            async with started(app):
                await state.wait_loaded()
                if state.load_error is not None:
                    raise RuntimeError(f"the model failed to load: {state.load_error}")
                yield

        app.router.lifespan_context = until_loaded
        return app

    def check_health(self) -> None:
        """Ray's health check: what GET /health answers. Raising makes Ray replace the replica."""
        if self._state is None:
            return
        status, reason = self._state.health()
        if status == "dead":
            raise RuntimeError(reason)


def build_app(args: dict[str, Any]):
    """The Ray Serve application of `serve run jserve.server.ray_serve:build_app key=value ...`."""
    from ray import serve

    config, settings, options = parse_args(args)
    replica = serve.deployment(**deployment_options(config, settings, options))(serve.ingress()(JServeReplica))
    return replica.bind(config, settings)
