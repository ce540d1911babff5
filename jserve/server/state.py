"""What one server holds: its settings and its models, each with its engine (loaded in the background so /health
can say 503 while it loads), front-end tokenizer, metrics and queue limits. A request is routed to a model by its
`model` field (jserve/server/multi_model.py: names, the KV-cache split, the merged metrics)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence

from checkpoints import DEFAULT_MODEL_NAME, default_model
from jserve.config import EngineConfig
from jserve.lora import LoRAError, LoRARequest
from jserve.server.async_engine import AsyncEngine
from jserve.server.auth import ApiKey
from jserve.server.limits import Limits
from jserve.server.lora_modules import assign_adapters
from jserve.server.metrics import ServerMetrics
from jserve.server.multi_model import ServedModel, check_names, plan_kv_budgets, render_merged
from jserve.server.protocol import APIError
from jserve.server.settings import DEMO_MODEL_NAME, ServerSettings
from jserve.server.tokenizer_worker import TokenizerWorker

logger = logging.getLogger(__name__)


class ModelState:
    """One served model: its engine and tokenizer once loaded, its metrics and its queue limits."""

    def __init__(self, model: ServedModel):
        self.name = model.name
        self.config = model.config
        self.engine: AsyncEngine | None = None
        self.tokenizer: TokenizerWorker | None = None
        self.metrics = ServerMetrics(self.name, lambda: self.engine.snapshot if self.engine else None)
        self.limits: Limits | None = None  # set by ServerState.make_limits (build_app)
        self.loras: dict[str, LoRARequest] = {}  # the adapters served on this model, by name (--lora-modules)

    async def load(self, settings: ServerSettings, on_fatal: Callable[[BaseException], None]) -> None:
        from jserve.engine.data_parallel import create_engine
        from jserve.tokenizer import load_tokenizer

        engine = await asyncio.to_thread(create_engine, self.config)
        if self.loras:  # read (and check) every adapter now: a bad one fails start-up, not the first request
            await asyncio.to_thread(_register_adapters, engine, list(self.loras.values()))
        tokenizer = await asyncio.to_thread(load_tokenizer, str(self.config.tokenizer or engine.model_dir))
        vocab = max(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
        self.tokenizer = TokenizerWorker(tokenizer, vocab)
        async_engine = AsyncEngine(engine, max_queued_requests=settings.max_queued_requests, metrics=self.metrics,
                                   max_step_failures=settings.max_step_failures,
                                   step_failure_window_s=settings.step_failure_window_s, on_fatal=on_fatal)
        async_engine.start()
        self.engine = async_engine
        logger.info("serving %s (max_model_len %d)", self.name, engine.max_model_len)

    def health(self) -> tuple[str, str | None]:
        if self.engine is None or self.tokenizer is None:
            return "loading", "the model is still loading"
        if self.engine.error is not None:
            error = self.engine.error
            return "dead", f"the engine stopped: {type(error).__name__}: {error}"
        if not self.engine.healthy:
            return "dead", "the engine is not running (the server is shutting down)"
        return "ready", None


def _register_adapters(engine, loras: list[LoRARequest]) -> None:
    for replica in getattr(engine, "replicas", [engine]):  # each data-parallel replica holds its own adapters
        for lora in loras:
            try:
                replica.lora_slots.register(lora)
            except LoRAError as e:
                raise LoRAError(f"LoRA adapter {lora.lora_name!r}: {e}") from None


class ServerState:
    """The server's models (the first also answers requests that name none) and their shared lifecycle. The
    single-model attributes (engine, tokenizer, metrics, model_name, config) are the first model's."""

    def __init__(self, models: EngineConfig | Sequence[ServedModel], settings: ServerSettings,
                 on_load_error: Callable[[BaseException], None] | None = None):
        self.settings = settings
        if isinstance(models, EngineConfig):
            name = settings.served_model_name or models.model or \
                (DEFAULT_MODEL_NAME if default_model() is not None else DEMO_MODEL_NAME)
            models = [ServedModel(name, models)]
        check_names(models, settings.fallback_model)
        self._served = list(models)
        self.models = {m.name: ModelState(m) for m in models}
        self.primary = self.models[models[0].name]
        # Adapter name -> the model it runs on; each model's own adapters are in its `loras`.
        self.adapters: dict[str, ModelState] = {}
        enabled = {m.name: m.config.enable_lora for m in models}
        assigned = assign_adapters(settings.lora_modules, enabled)
        for base, module, lora_int_id in assigned:
            self.models[base].loras[module.name] = LoRARequest(module.name, lora_int_id, module.path)
            self.adapters[module.name] = self.models[base]
        if settings.allow_runtime_lora_updating and not any(enabled.values()):
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora (no served model runs with LoRA)")
        # Adapters loaded at run time take the ids after --lora-modules', never one already used: an unloaded
        # adapter's requests may still run under its id.
        self._lora_ids = itertools.count(len(assigned) + 1)
        self._loading: set[str] = set()  # adapter names being read (POST /v1/load_lora_adapter)
        self.load_error: BaseException | None = None
        self._failed_model: str | None = None
        self._on_load_error = on_load_error
        # Called on the event loop when an engine dies for good (the CLI stops the server and exits non-zero).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._load_task: asyncio.Task | None = None

    # The first model's, as a one-model server has always had them.
    @property
    def engine(self) -> AsyncEngine | None:
        return self.primary.engine

    @property
    def tokenizer(self) -> TokenizerWorker | None:
        return self.primary.tokenizer

    @property
    def metrics(self) -> ServerMetrics:
        return self.primary.metrics

    @property
    def model_name(self) -> str:
        return self.primary.name

    @property
    def config(self) -> EngineConfig:
        return self.primary.config

    def make_limits(self, keys: list[ApiKey]) -> Limits:
        """Each model's queue limits (queue delay, drain rate), all sharing the API keys' buckets; the first
        model's is returned."""
        first: Limits | None = None
        for model in self.models.values():
            model.limits = Limits(keys, max_queue_delay=self.settings.max_queue_delay,
                                  salt_by_key=self.settings.prefix_cache_salt_by_key, metrics=model.metrics,
                                  keys_from=first)
            first = first or model.limits
        return first

    # ----- lifecycle -----

    def start_loading(self) -> None:
        self._load_task = asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        model = None  # None while planning the KV budgets, which concern every model
        try:
            if len(self.models) > 1:  # every budget explicit, and checked, before any model takes memory
                for served in await asyncio.to_thread(plan_kv_budgets, self._served):
                    self.models[served.name].config = served.config
            for model in self.models.values():
                await model.load(self.settings, self._engine_died)
        except Exception as e:
            self.load_error, self._failed_model = e, model.name if model is not None else None
            logger.exception("%s failed to load", self._which(self._failed_model))
            if self._on_load_error is not None:
                self._on_load_error(e)

    def _engine_died(self, error: BaseException) -> None:
        logger.critical("the engine cannot go on (%s: %s): everything in flight has been failed", type(error).__name__,
                        error)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _which(self, name: str | None) -> str:
        """How messages name a model: by its name where several are served (None: all of them)."""
        if len(self.models) == 1:
            return "the model"
        return f"the model {name}" if name is not None else "the models"

    def health(self) -> tuple[str, str | None]:
        """("loading" | "ready" | "dead", why it is not ready): ready only when every model is."""
        if self.load_error is not None:
            return "dead", f"{self._which(self._failed_model)} failed to load: {self.load_error}"
        worst = ("ready", None)
        for model in self.models.values():
            status, reason = model.health()
            if len(self.models) > 1 and reason is not None:
                reason = f"{model.name}: {reason}"
            if status == "dead":
                return status, reason
            if status == "loading" and worst[0] == "ready":
                worst = (status, reason)
        return worst

    async def wait_loaded(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def shutdown(self) -> None:
        if self._load_task is not None and not self._load_task.done():
            await asyncio.gather(self._load_task, return_exceptions=True)  # a model half loaded cannot be cancelled
        for model in self.models.values():
            if model.engine is not None:
                await model.engine.shutdown()
            if model.tokenizer is not None:
                model.tokenizer.close()

    def render_metrics(self) -> bytes:
        if len(self.models) == 1:
            return self.primary.metrics.render()
        return render_merged([m.metrics.registry for m in self.models.values()])

    # ----- per request -----

    def ready(self) -> None:
        """A 503 unless every model is serving: while one loads, after a load failed, after an engine stopped."""
        if self.load_error is not None:
            raise APIError(503, f"{self._which(self._failed_model)} failed to load: {self.load_error}",
                           code="model_load_failed")
        for model in self.models.values():
            if model.engine is None or model.tokenizer is None:
                raise APIError(503, f"{self._which(model.name)} is still loading; retry shortly",
                               code="model_loading", headers={"Retry-After": "5"})
            if not model.engine.healthy:
                raise APIError(503, "the engine is not running", code="engine_dead")

    def route(self, model: str | None) -> ModelState:
        """The model a request names (the first where it names none; an adapter's base model where it names a LoRA
        adapter), once every model is serving; 404 for a name not served."""
        self.ready()
        if model is None:
            return self.primary
        served = self.models.get(model) or self.adapters.get(model)
        if served is None:
            raise APIError(404, f"The model `{model[:200]}` does not exist.", param="model", code="model_not_found")
        return served

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: a base model)."""
        base = self.adapters.get(model) if model is not None else None
        return base.loras[model] if base is not None else None

    async def load_lora(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """Read the adapter at `path` and serve it as `name` on base_model_name (default: the first model)."""
        self.ready()
        if name in self.models or name in self.adapters or name in self._loading:
            raise APIError(400, f"The lora adapter '{name[:200]}' has already been loaded.", param="lora_name")
        base = self.models.get(base_model_name or self.primary.name)
        if base is None:
            raise APIError(404, f"The model `{base_model_name[:200]}` does not exist.", param="base_model_name",
                           code="model_not_found")
        if not base.config.enable_lora:
            raise APIError(400, f"the model {base.name!r} is served without LoRA (--enable-lora)",
                           param="base_model_name")
        lora = LoRARequest(name, next(self._lora_ids), path)
        self._loading.add(name)
        try:
            adapter = await asyncio.to_thread(base.engine.engine.read_lora, lora)
            await base.engine.call(lambda engine: engine.add_lora(lora, adapter))
        except LoRAError as e:
            raise APIError(400, f"LoRA adapter {name[:200]!r}: {e}", param="lora_path") from None
        finally:
            self._loading.discard(name)
        base.loras[name] = lora
        self.adapters[name] = base
        logger.info("loaded LoRA adapter %r (%s) on %s", name, path, base.name)

    async def unload_lora(self, name: str) -> None:
        """Stop serving the adapter `name`; its requests already admitted finish with it."""
        self.ready()
        base = self.adapters.pop(name, None)
        if base is None:
            raise APIError(404, f"The lora adapter '{name[:200]}' cannot be found.", param="lora_name",
                           code="model_not_found")
        lora = base.loras.pop(name)
        await base.engine.call(lambda engine: engine.remove_lora(lora.lora_int_id))
        logger.info("unloaded LoRA adapter %r", name)

    def fallback_for(self, model: ModelState) -> ModelState | None:
        """Where a request for `model` goes when that model's queue is over its limit."""
        name = self.settings.fallback_model
        return self.models[name] if name is not None and name != model.name else None
