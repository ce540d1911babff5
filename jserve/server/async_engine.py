"""The asyncio front of the engine: the engine core steps on its own thread; HTTP handlers never wait on a step.

Handlers talk to the engine thread only through an inbox of commands (add, abort, stop), applied between
steps, so the engine itself stays single-threaded. Each step's outputs are handed back to the event loop
with one `call_soon_threadsafe` and land on per-request asyncio queues. A request whose consumer goes away
(the client disconnected) posts an abort, which the engine applies before its next step.

A step that raises fails only the requests it held (each gets a StepFailedError, a 500) and the engine recovers
(LLMEngine.recover: a fresh KV cache, the other sequences preempted) and goes on serving. If recovery fails, or more
than max_step_failures steps fail within step_failure_window_s seconds, the engine is dead: everything in flight
gets an EngineUnavailableError (a 503) and on_fatal is called on the event loop (the CLI then exits non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from jserve.engine.engine import EngineSnapshot, LLMEngine
from jserve.lora import LoRARequest
from jserve.outputs import EmbeddingRequestOutput, RequestOutput
from jserve.sampling_params import SamplingParams
from jserve.server.metrics import ServerMetrics
from jserve.server.protocol import APIError

logger = logging.getLogger(__name__)


def request_finish_reason(output: RequestOutput) -> str:
    """A finished request's reason for jserve:request_success_total: its samples' least complete one ("abort" over
    "length" over "stop"), so one count per request still shows any sample that was cut short."""
    if isinstance(output, EmbeddingRequestOutput):  # pooled once its prompt is computed
        return "stop"
    reasons = {out.finish_reason or "abort" for out in output.outputs}
    return next((r for r in ("abort", "length") if r in reasons), "stop")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (it failed for good, or the server is shutting down)."""


class EngineUnavailableError(EngineDeadError, APIError):
    """What a request in flight gets when the engine dies under it: a 503 in OpenAI's shape."""

    def __init__(self, message: str):
        EngineDeadError.__init__(self, message)
        APIError.__init__(self, 503, message, code="engine_dead")


class StepFailedError(APIError):
    """What a request gets when a step it was part of failed (the engine recovers): a 500 in OpenAI's shape."""

    def __init__(self, cause: BaseException):
        super().__init__(500, f"the engine step running this request failed: {type(cause).__name__}: {cause}",
                         code="engine_step_failed")


class QueueFullError(RuntimeError):
    """More sequences are in flight than the server admits; the client should retry later."""


@dataclass
class _Add:
    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    sink: asyncio.Queue
    done: concurrent.futures.Future
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """fn(engine) run on the engine thread, between steps; its result or exception in `done`."""
    fn: Callable[[Any], Any]
    done: concurrent.futures.Future


class _Stop:
    pass


@dataclass
class _Tracked:
    """Engine-thread bookkeeping for one engine request."""

    sink: asyncio.Queue
    prompt_index: int
    arrival: float
    started: bool = False
    last_output: float | None = None


@dataclass
class _Delivery:
    items: list[tuple[asyncio.Queue, object]] = field(default_factory=list)


class AsyncEngine:
    """Owns an LLMEngine and the thread that steps it."""

    def __init__(self, engine: LLMEngine, *, max_queued_requests: int = 256, metrics: ServerMetrics | None = None,
                 max_step_failures: int = 3, step_failure_window_s: float = 60.0,
                 on_fatal: Callable[[BaseException], None] | None = None):
        """max_step_failures: failed steps recovered from within any step_failure_window_s seconds (one more is
        fatal; 0: the first failure is); on_fatal(error): called on the event loop once the engine is dead."""
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be non-negative, got {max_queued_requests}")
        if max_step_failures < 0 or step_failure_window_s <= 0:
            raise ValueError(f"max_step_failures must be non-negative and step_failure_window_s positive, got "
                             f"{max_step_failures}, {step_failure_window_s}")
        self.max_step_failures = max_step_failures
        self.step_failure_window_s = step_failure_window_s
        self.on_fatal = on_fatal
        self.num_step_failures = 0  # every failed step, recovered or not
        self._recent_failures: deque[float] = deque()
        self.engine = engine
        self.metrics = metrics
        # max_num_seqs sequences run at once in each data-parallel replica; up to max_queued_requests more wait
        # their turn in the engine.
        self.capacity = engine.config.max_num_seqs * engine.config.data_parallel_size + max_queued_requests
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None
        self._in_flight = 0  # sequences admitted and not yet finished; touched on the event loop only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "closed" against submissions, so no command is left unanswered
        self._closed = False
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.started_at = time.time()

    # ----- lifecycle -----

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.started_at = time.time()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="jserve-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._closed

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    async def shutdown(self) -> None:
        """Abort whatever still runs and stop the engine thread."""
        self._submit(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ----- requests -----

    def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int = 0, lora_request: LoRARequest | None = None) -> Generation:
        """Admit a request of one or more prompts (each runs as its own engine request with params.n samples, with
        the LoRA adapter lora_request where one is given).

        Raises QueueFullError when the server is full and ValueError when the request could never fit.
        """
        num_seqs = self.check_admissible(len(prompts), params.n)
        self._in_flight += num_seqs
        return Generation(self, request_id, prompts, params, priority, num_seqs, lora_request)

    def check_admissible(self, num_prompts: int, n: int) -> int:
        """The request's sequence count, if it can be admitted now (else the error generate() would raise)."""
        num_seqs = num_prompts * n
        if self.error is not None or self._closed:
            raise EngineDeadError("the engine is not running")
        if num_seqs > self.capacity:
            raise ValueError(f"the request has {num_seqs} sequences ({num_prompts} prompts x n={n}) but "
                             f"the server admits at most {self.capacity} at once")
        if self._in_flight + num_seqs > self.capacity:
            raise QueueFullError(f"the server is at capacity ({self._in_flight} of {self.capacity} sequences "
                                 "in flight); retry later")
        return num_seqs

    def _release(self, num_seqs: int) -> None:
        self._in_flight -= num_seqs

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on the engine thread between steps (what touches the engine's state must run there)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._submit(_Call(fn, done)):
            raise EngineDeadError("the engine is not running")
        return await asyncio.wrap_future(done)

    def _submit(self, command: object) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._inbox.put(command)
            return True

    # ----- the engine thread -----

    def _run(self) -> None:
        try:
            while True:
                commands = self._drain(block=not self.engine.has_unfinished_requests())
                if any(isinstance(c, _Stop) for c in commands):
                    self._fail_all(EngineUnavailableError("the server is shutting down"), commands)
                    return
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    try:
                        self._step()
                    except Exception as e:
                        self._recover(e)
                self._publish()
        except BaseException as e:  # recovery failed, too many failures, or a bug here: stop serving
            logger.exception("engine thread died")
            self.error = e
            self._fail_all(EngineUnavailableError(f"the engine stopped: {type(e).__name__}: {e}"), [])
            if self.on_fatal is not None:
                self._call_on_loop(self.on_fatal, e)

    def _recover(self, error: Exception) -> None:
        """Fail the failed step's requests and make the engine usable again; raises when it must not go on."""
        self.num_step_failures += 1
        if self.metrics is not None:
            self.metrics.step_failures.inc()
        now = time.monotonic()
        self._recent_failures.append(now)
        while self._recent_failures[0] < now - self.step_failure_window_s:
            self._recent_failures.popleft()
        if len(self._recent_failures) > self.max_step_failures:
            raise RuntimeError(f"{len(self._recent_failures)} engine steps failed within "
                               f"{self.step_failure_window_s:g} s (the last: {type(error).__name__}: {error})"
                               ) from error
        try:
            dropped = self.engine.recover(error)
        except Exception as e:
            raise RuntimeError(f"recovery from a failed step ({type(error).__name__}: {error}) failed: "
                               f"{type(e).__name__}: {e}") from e
        failure = StepFailedError(error)
        delivery = _Delivery()
        for rid in dropped:
            tracked = self._tracked.pop(rid, None)
            if tracked is not None:
                delivery.items.append((tracked.sink, failure))
        logger.warning("recovered from a failed step; failed %d request(s)", len(dropped))
        if delivery.items:
            self._deliver(delivery)

    def _call_on_loop(self, callback: Callable[[BaseException], None], error: BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, error)
        except RuntimeError:  # the event loop is closed: the server is stopping anyway
            pass

    def _drain(self, block: bool) -> list[object]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: object) -> None:
        if isinstance(command, _Abort):
            for rid in command.request_ids:
                if self._tracked.pop(rid, None) is not None:
                    self.engine.abort_request(rid)
        elif isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Call) and command.done.set_running_or_notify_cancel():
            try:
                command.done.set_result(command.fn(self.engine))
            except Exception as e:  # the caller's error to raise
                command.done.set_exception(e)

    def _add(self, command: _Add) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the client went away before we got to it; from here on it cannot cancel any more
        added = []
        lora = {"lora_request": command.lora_request} if command.lora_request is not None else {}
        try:
            for rid, prompt in zip(command.request_ids, command.prompts, strict=True):
                self.engine.add_request(rid, {"prompt_token_ids": prompt}, command.params, priority=command.priority,
                                        **lora)
                added.append(rid)
        except Exception as e:  # one bad prompt rejects the whole request
            for rid in added:
                self.engine.abort_request(rid)
            command.done.set_exception(e)
            return
        now = time.monotonic()
        for index, rid in enumerate(command.request_ids):
            self._tracked[rid] = _Tracked(command.sink, index, now)
        command.done.set_result(None)

    def _step(self) -> None:
        step_start = time.monotonic()
        outputs = self.engine.step()
        now = time.monotonic()
        self._observe_queue_times(step_start)
        delivery = _Delivery()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue  # aborted while it ran
            self._observe_output(tracked, output, now)
            delivery.items.append((tracked.sink, (tracked.prompt_index, output)))
            if output.finished:
                del self._tracked[output.request_id]
        if delivery.items:
            self._deliver(delivery)

    def _observe_queue_times(self, step_start: float) -> None:
        if self.metrics is None:
            return
        for rid, tracked in self._tracked.items():
            if tracked.started:
                continue
            if self.engine.request_started(rid):
                tracked.started = True
                self.metrics.request_queue_time.observe(max(0.0, step_start - tracked.arrival))

    def _observe_output(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        if self.metrics is None:
            return
        if tracked.last_output is None:
            self.metrics.time_to_first_token.observe(now - tracked.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - tracked.last_output)
        tracked.last_output = now
        if output.finished:  # one count per engine request (a prompt and its n samples) here and in the histograms
            self.metrics.e2e_request_latency.observe(now - tracked.arrival)
            self.metrics.request_finished(request_finish_reason(output))

    def _deliver(self, delivery: _Delivery) -> None:
        try:
            self._loop.call_soon_threadsafe(_put_all, delivery.items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _publish(self) -> None:
        self.snapshot = self.engine.snapshot()

    def _fail_all(self, error: Exception, commands: list[object]) -> None:
        with self._lock:
            self._closed = True
        commands = commands + self._drain(block=False)
        for command in commands:
            if isinstance(command, (_Add, _Call)) and not command.done.done():
                command.done.set_exception(error)
        delivery = _Delivery([(t.sink, error) for t in self._tracked.values()])
        for rid in list(self._tracked):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; the requests are failed either way
                logger.debug("abort of %s failed while stopping", rid, exc_info=True)
        self._tracked.clear()
        self._deliver(delivery)
        self._publish_safely()

    def _publish_safely(self) -> None:
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - a broken engine keeps its last snapshot
            logger.debug("could not publish the engine state", exc_info=True)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)


class Generation:
    """One admitted request: `await start()` adds it (raising ValueError for bad input), iterate for
    (prompt_index, RequestOutput) pairs, and `close()` aborts what is unfinished and frees its place."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int, num_seqs: int, lora_request: LoRARequest | None = None):
        self._engine = engine
        self._lora_request = lora_request
        self.request_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._prompts = prompts
        self._params = params
        self._priority = priority
        self._num_seqs = num_seqs
        self._sink: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(self.request_ids)
        self._added = False
        self._closed = False

    async def start(self) -> None:
        done: concurrent.futures.Future = concurrent.futures.Future()
        command = _Add(self.request_ids, self._prompts, self._params, self._priority, self._sink, done,
                       self._lora_request)
        if not self._engine._submit(command):
            raise EngineDeadError("the engine is not running")
        self._added = True  # from here on close() must abort, even if we are cancelled while waiting
        await asyncio.wrap_future(done)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            item = await self._sink.get()
            if isinstance(item, Exception):
                raise item
            prompt_index, output = item
            if output.finished:
                self._unfinished.discard(output.request_id)
            yield prompt_index, output

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._added and self._unfinished:
            self._engine._submit(_Abort(sorted(self._unfinished)))
        self._engine._release(self._num_seqs)
