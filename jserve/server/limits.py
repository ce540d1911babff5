"""Per-key rate limits, load shedding and request deadlines, all decided on the event loop before any work.

* Each limited key has two token buckets (requests and tokens per minute, refilled continuously, holding a
  minute's worth unless the key sets a burst) and a cap on concurrent requests. A request takes one request
  token up front and, once its prompt is tokenized, `prompt + max_tokens` tokens per sample; when it ends the
  unused part of that reservation is given back, so the bucket is charged the real count.
* `--max-queue-delay` refuses a request whose estimated queue wait is longer: the sequences admitted ahead of
  it (in flight beyond the `max_num_seqs` that run at once, counting only those whose priority is at least as
  good as its own) divided by the drain rate (sequences finished per second over the last `DRAIN_WINDOW`
  seconds). Lower tiers see every queued sequence ahead of them, better tiers fewer, so overload sheds the
  lowest tier first.
* A deadline (the `X-Request-Timeout` header) aborts a request that runs out of time.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from jserve.server.auth import ApiKey
from jserve.server.metrics import ServerMetrics
from jserve.server.protocol import APIError

# Seconds over which the drain rate is averaged.
DRAIN_WINDOW = 10.0
# The most seconds a client may ask for in X-Request-Timeout (a day: beyond it the value is a mistake).
MAX_REQUEST_TIMEOUT = 86400.0
TIMEOUT_HEADER = "x-request-timeout"


def _duration(seconds: float) -> str:
    """A Go-style duration as OpenAI's x-ratelimit-reset-* headers write it: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(math.ceil(seconds)), 60)
    return f"{minutes}m{rest}s"


def rate_limited(message: str, retry_after: float, code: str = "rate_limit_exceeded",
                 status: int = 429) -> APIError:
    """A 429 (or 503) whose Retry-After (whole seconds) and retry-after-ms (which the openai client prefers)
    say when a retry can succeed."""
    retry_after = max(retry_after, 0.001)
    return APIError(status, message, code=code, headers={"Retry-After": str(max(1, math.ceil(retry_after))),
                                                         "retry-after-ms": str(math.ceil(retry_after * 1000))})


class TokenBucket:
    """`capacity` tokens, refilled at `per_minute / 60` per second; the level may not go below zero."""

    def __init__(self, per_minute: int, capacity: int | None, clock: Callable[[], float]):
        self.limit = per_minute
        self.capacity = float(capacity or per_minute)
        self.rate = per_minute / 60.0
        self._clock = clock
        self._level = self.capacity
        self._at = clock()

    def _refill(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` tokens are there (0 if they are now; inf if they never fit)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self._refill()) / self.rate)

    def take(self, amount: float) -> None:
        self._level = self._refill() - amount

    def give_back(self, amount: float) -> None:
        self._level = min(self.capacity, self._refill() + amount)

    @property
    def remaining(self) -> int:
        return max(0, int(self._refill()))

    @property
    def reset_seconds(self) -> float:
        return (self.capacity - self._refill()) / self.rate


class _KeyState:
    def __init__(self, key: ApiKey, clock: Callable[[], float]):
        self.key = key
        self.requests = TokenBucket(key.requests_per_minute, key.requests_burst, clock) \
            if key.requests_per_minute else None
        self.tokens = TokenBucket(key.tokens_per_minute, key.tokens_burst, clock) if key.tokens_per_minute else None
        self.active = 0

    def headers(self) -> dict[str, str]:
        out = {}
        for name, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
                out[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining)
                out[f"x-ratelimit-reset-{name}"] = _duration(bucket.reset_seconds)
        return out


class _Drain:
    """Sequences finished per second over the last DRAIN_WINDOW seconds (over the time since the first one
    finished, but at least a second, while the server is younger than that); 0 when none finished lately."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._count = 0
        self._first: float | None = None

    def add(self, num_seqs: int) -> None:
        now = self._clock()
        self._events.append((now, num_seqs))
        self._count += num_seqs
        if self._first is None:
            self._first = now

    def rate(self) -> float:
        now = self._clock()
        while self._events and self._events[0][0] < now - DRAIN_WINDOW:
            self._count -= self._events.popleft()[1]
        if not self._count or self._first is None:
            return 0.0
        return self._count / min(DRAIN_WINDOW, max(1.0, now - self._first))


@dataclass
class Deadline:
    """When the request must be done (time.monotonic), and the timeout it came from."""

    at: float
    seconds: float


def parse_timeout(value: str | None, now: float) -> Deadline | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_REQUEST_TIMEOUT:  # NaN fails too
        raise APIError(400, f"X-Request-Timeout must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT:g}], "
                            f"got {value[:64]!r}", param=TIMEOUT_HEADER, code="invalid_value")
    return Deadline(now + seconds, seconds)


class Limits:
    """One server's rate limits (per key), load shedding and deadlines."""

    def __init__(self, keys: list[ApiKey], *, max_queue_delay: float | None = None, salt_by_key: bool = False,
                 metrics: ServerMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 keys_from: Limits | None = None):
        """keys_from: another Limits whose keys' buckets these share (each model of a server has its own queue
        but a key's limits span every model)."""
        self._states = keys_from._states if keys_from is not None else {key.id: _KeyState(key, clock) for key in keys}
        self.max_queue_delay = max_queue_delay
        self.salt_by_key = salt_by_key
        self.metrics = metrics
        self._clock = clock
        self._drain = _Drain(clock)
        self._in_flight: collections.Counter[int] = collections.Counter()  # sequences by priority
        self._max_num_seqs: int | None = None
        # Admission runs on the event loop; a /metrics scrape reads the estimate from a worker thread.
        self._lock = threading.Lock()
        if metrics is not None:
            metrics.set_queue_wait_source(lambda: self.estimated_wait(None, 0))

    def headers(self, key: ApiKey | None) -> dict[str, str]:
        state = self._states.get(key.id) if key is not None else None
        return state.headers() if state is not None else {}

    # ----- admission -----

    def estimated_wait(self, priority: int | None, num_seqs: int) -> float:
        """Seconds a request of `num_seqs` sequences at `priority` (None: the worst) would wait in the queue."""
        if self._max_num_seqs is None:
            return 0.0
        with self._lock:
            total = sum(self._in_flight.values())
            ahead = total if priority is None else sum(n for p, n in self._in_flight.items() if p <= priority)
            rate = self._drain.rate()
        queued = total + num_seqs - self._max_num_seqs
        if queued <= 0:
            return 0.0  # a seat is free
        if rate <= 0:
            return math.inf if total > 0 else 0.0
        return (min(queued - num_seqs, ahead) + num_seqs) / rate

    def begin(self, key: ApiKey | None, priority: int, num_seqs: int, max_num_seqs: int,
              timeout_header: str | None) -> Admission:
        """Admit a request before its prompt is tokenized: per-key concurrency and request rate, then the queue
        delay. Raises APIError 429/503 (with Retry-After) to refuse it."""
        deadline = parse_timeout(timeout_header, self._clock())
        self._max_num_seqs = max_num_seqs
        if key is not None:
            priority = max(priority, key.priority)  # a request may lower its priority below its key's, not raise it
        state = self._states.get(key.id) if key is not None else None
        if state is not None:
            limit = state.key.max_concurrent_requests
            if limit is not None and state.active >= limit:
                self._count(key, "rate_limited")
                raise rate_limited(f"API key {key.id!r} already has {limit} requests in flight, its limit",
                                   self._concurrency_retry(), code="concurrency_limit_exceeded")
            if state.requests is not None:
                wait = state.requests.wait_for(1)
                if wait > 0:
                    self._count(key, "rate_limited")
                    raise rate_limited(f"Rate limit reached for API key {key.id!r} on requests per minute: "
                                       f"limit {state.requests.limit}. Retry in {wait:.2f}s.", wait)
        if self.max_queue_delay is not None:
            wait = self.estimated_wait(priority, num_seqs)
            # With no recent completion the wait is unknown (inf), not known to be long: such requests queue.
            if self.max_queue_delay < wait < math.inf:
                self._count(key, "shed")
                if self.metrics is not None:
                    self.metrics.requests_shed.inc()
                raise rate_limited(f"the server is overloaded: the estimated queue wait is {wait:.1f}s, over the "
                                   f"--max-queue-delay of {self.max_queue_delay:g}s", wait - self.max_queue_delay,
                                   code="queue_delay_exceeded", status=503)
        if state is not None:
            if state.requests is not None:
                state.requests.take(1)
            state.active += 1
            if self.metrics is not None:
                self.metrics.key_running(key.id, state.active)
        with self._lock:
            self._in_flight[priority] += num_seqs
        return Admission(self, key, state, priority, num_seqs, deadline)

    def _concurrency_retry(self) -> float:
        with self._lock:
            rate = self._drain.rate()
        return 1.0 / rate if rate > 0 else 1.0

    def _count(self, key: ApiKey | None, outcome: str) -> None:
        if self.metrics is not None and key is not None:
            self.metrics.key_request(key.id, outcome)

    def _end(self, admission: Admission, tokens: int, ran: bool) -> None:
        with self._lock:
            self._in_flight[admission.priority] -= admission.num_seqs
            if not self._in_flight[admission.priority]:
                del self._in_flight[admission.priority]
            if ran:  # only requests that reached the engine say how fast it drains
                self._drain.add(admission.num_seqs)
        state = admission.state
        if state is not None:
            state.active -= 1
            if self.metrics is not None:
                self.metrics.key_running(state.key.id, state.active)
                self.metrics.key_tokens(state.key.id, tokens)


class Admission:
    """One admitted request's share of the limits; `end()` (idempotent) gives back what it did not use."""

    def __init__(self, limits: Limits, key: ApiKey | None, state: _KeyState | None, priority: int, num_seqs: int,
                 deadline: Deadline | None):
        self._limits = limits
        self.key = key
        self.state = state
        self.priority = priority
        self.num_seqs = num_seqs
        self.deadline = deadline
        self._reserved = 0
        self._ended = False
        self._ran = False

    def cache_salt(self, salt: str | None) -> str | None:
        """The request's prefix-cache salt: with --prefix-cache-salt-by-key, bound to its key id."""
        if not self._limits.salt_by_key or self.key is None:
            return salt
        if salt is None:
            return f"key:{self.key.id}"
        return f"key:{self.key.id}:{hashlib.sha256(salt.encode('utf-8', 'surrogatepass')).hexdigest()}"

    def reserve_tokens(self, prompt_lens: list[int], max_tokens: int | None, n: int, max_model_len: int) -> None:
        """Charge prompt + max_tokens for each sample (max_tokens None: the rest of the context); 429 if the key's
        tokens per minute cannot cover it now."""
        bucket = self.state.tokens if self.state is not None else None
        if bucket is None:
            return
        cost = sum(length + n * (max_tokens if max_tokens is not None else max(0, max_model_len - length))
                   for length in prompt_lens)
        wait = bucket.wait_for(cost)
        if wait > 0:
            self._limits._count(self.key, "rate_limited")
            if math.isinf(wait):
                raise APIError(429, f"Request too large for API key {self.key.id!r}: it needs {cost} tokens "
                                    f"(prompt + max_tokens) but the key's bucket holds {bucket.capacity:g} "
                                    f"(tokens per minute: {bucket.limit}). Lower max_tokens.",
                               code="request_too_large")
            raise rate_limited(f"Rate limit reached for API key {self.key.id!r} on tokens per minute: limit "
                               f"{bucket.limit}, requested {cost}. Retry in {wait:.2f}s.", wait)
        bucket.take(cost)
        self._reserved = cost

    def admitted(self) -> None:
        self._ran = True
        self._limits._count(self.key, "admitted")

    def end(self, used_tokens: int | None = None) -> None:
        """The request is over: give back the unused reservation (all of it when `used_tokens` is None)."""
        if self._ended:
            return
        self._ended = True
        used = self._reserved if used_tokens is None else min(used_tokens, self._reserved)
        bucket = self.state.tokens if self.state is not None else None
        if bucket is not None and self._reserved > used:
            bucket.give_back(self._reserved - used)
        self._limits._end(self, used if bucket is not None else (used_tokens or 0), self._ran)

    def refuse(self) -> None:
        """The request was refused after `begin` (bad input, server full): undo its request charge too."""
        if self.state is not None and self.state.requests is not None and not self._ended:
            self.state.requests.give_back(1)
        self.end(0)

    def timed_out(self) -> APIError:
        self._limits._count(self.key, "timeout")
        if self._limits.metrics is not None:
            self._limits.metrics.request_timeouts.inc()
        seconds = self.deadline.seconds if self.deadline else 0
        return APIError(504, f"the request did not finish within its X-Request-Timeout of {seconds:g}s and was "
                             f"aborted", code="request_timeout")


class MeteredGeneration:
    """Wraps an admitted Generation: counts the tokens it used, enforces the deadline, and ends the admission
    when closed. Anything else is the Generation's."""

    def __init__(self, gen, admission: Admission):
        self._gen = gen
        self._admission = admission
        self._tokens: dict[tuple[str, int], int] = {}  # (request id, sample or -1 for the prompt) -> tokens

    def __getattr__(self, name: str):
        return getattr(self._gen, name)

    async def __aiter__(self) -> AsyncIterator:
        deadline = self._admission.deadline
        iterator = self._gen.__aiter__()
        while True:
            try:
                if deadline is None:
                    item = await iterator.__anext__()
                else:
                    async with asyncio.timeout_at(_loop_time(deadline.at)):
                        item = await iterator.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                self._gen.close()  # aborts what still runs
                raise self._admission.timed_out() from None
            _, output = item
            self._tokens[(output.request_id, -1)] = len(output.prompt_token_ids)
            for out in output.outputs if isinstance(output.outputs, list) else ():  # an embedding: none
                self._tokens[(output.request_id, out.index)] = len(out.token_ids)  # cumulative per sample
            yield item

    def close(self) -> None:
        self._gen.close()
        self._admission.end(sum(self._tokens.values()))


def _loop_time(monotonic_at: float) -> float:
    """A time.monotonic() instant on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_at - time.monotonic())
