"""What one server holds: its settings, the engine (loaded in the background so /health can say 503 while it
loads), the front-end tokenizer and the metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from checkpoints import DEFAULT_MODEL_NAME, default_model
from jserve.config import EngineConfig
from jserve.server.async_engine import AsyncEngine
from jserve.server.metrics import ServerMetrics
from jserve.server.protocol import APIError
from jserve.server.settings import DEMO_MODEL_NAME, ServerSettings
from jserve.server.tokenizer_worker import TokenizerWorker

logger = logging.getLogger(__name__)

class ServerState:
    def __init__(self, config: EngineConfig, settings: ServerSettings,
                 on_load_error: Callable[[BaseException], None] | None = None):
        self.config = config
        self.settings = settings
        self.model_name = settings.served_model_name or config.model or \
            (DEFAULT_MODEL_NAME if default_model() is not None else DEMO_MODEL_NAME)
        self.engine: AsyncEngine | None = None
        self.tokenizer: TokenizerWorker | None = None
        self.load_error: BaseException | None = None
        self.metrics = ServerMetrics(self.model_name, lambda: self.engine.snapshot if self.engine else None)
        self._on_load_error = on_load_error
        # Called on the event loop when the engine dies for good (the CLI stops the server and exits non-zero).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._load_task: asyncio.Task | None = None

    # ----- lifecycle -----

    def start_loading(self) -> None:
        self._load_task = asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        try:
            from jserve.engine.data_parallel import create_engine
            from jserve.tokenizer import load_tokenizer

            engine = await asyncio.to_thread(create_engine, self.config)
            tokenizer = await asyncio.to_thread(load_tokenizer, str(self.config.tokenizer or engine.model_dir))
            vocab = max(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
            self.tokenizer = TokenizerWorker(tokenizer, vocab)
            async_engine = AsyncEngine(engine, max_queued_requests=self.settings.max_queued_requests,
                                       metrics=self.metrics, max_step_failures=self.settings.max_step_failures,
                                       step_failure_window_s=self.settings.step_failure_window_s,
                                       on_fatal=self._engine_died)
            async_engine.start()
            self.engine = async_engine
            logger.info("serving %s (max_model_len %d)", self.model_name, engine.max_model_len)
        except Exception as e:
            logger.exception("the model failed to load")
            self.load_error = e
            if self._on_load_error is not None:
                self._on_load_error(e)

    def _engine_died(self, error: BaseException) -> None:
        logger.critical("the engine cannot go on (%s: %s): everything in flight has been failed", type(error).__name__,
                        error)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def health(self) -> tuple[str, str | None]:
        """("loading" | "ready" | "dead", why it is not ready)."""
        if self.load_error is not None:
            return "dead", f"the model failed to load: {self.load_error}"
        if self.engine is None or self.tokenizer is None:
            return "loading", "the model is still loading"
        if self.engine.error is not None:
            error = self.engine.error
            return "dead", f"the engine stopped: {type(error).__name__}: {error}"
        if not self.engine.healthy:
            return "dead", "the engine is not running (the server is shutting down)"
        return "ready", None

    async def wait_loaded(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def shutdown(self) -> None:
        if self._load_task is not None and not self._load_task.done():
            await asyncio.gather(self._load_task, return_exceptions=True)  # a model half loaded cannot be cancelled
        if self.engine is not None:
            await self.engine.shutdown()
        if self.tokenizer is not None:
            self.tokenizer.close()

    # ----- per request -----

    def ready(self) -> tuple[AsyncEngine, TokenizerWorker]:
        """The engine and tokenizer, or a 503 while loading or after the engine stopped."""
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
        if self.engine is None or self.tokenizer is None:
            raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "5"})
        if not self.engine.healthy:
            raise APIError(503, "the engine is not running", code="engine_dead")
        return self.engine, self.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model[:200]}` does not exist.", param="model",
                           code="model_not_found")
