"""HTTP plumbing shared by the routes: request ids and access log, error bodies, bounded body reading,
disconnect detection and the Server-Sent Events response (API keys are in auth.py)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jserve.server.protocol import APIError, bad_request, parse_json

access_logger = logging.getLogger("jserve.server.access")
logger = logging.getLogger(__name__)
T = TypeVar("T")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")  # an incoming x-request-id is echoed only if it is tame
_JSON_TYPE = re.compile(r"^application/([a-z0-9.+\-]+\+)?json$")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class RequestContextMiddleware:
    """Gives every response an x-request-id, logs one access line per request, and turns an unexpected
    exception into a JSON 500 without a stack trace (the trace goes to the server log)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start, status = time.perf_counter(), [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # the client left while its body was being read: routine, and nobody to answer
            status[0] = status[0] or 499
        except Exception:
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if status[0] == 0:
                status[0] = 500
                response = error_response(APIError(500, "internal server error; see the server log",
                                                   code="internal_error"))
                await response(scope, receive, send_with_id)
        finally:
            client = scope.get("client") or ("-", 0)
            access_logger.info('%s "%s %s" %d %.1fms id=%s', client[0], scope["method"], scope["path"], status[0],
                               (time.perf_counter() - start) * 1000, request_id)


async def read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object: 400 for other content types or bad JSON, 413 beyond `limit` bytes."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _JSON_TYPE.match(content_type.split(";")[0].strip().lower()):
        raise bad_request(f"Content-Type must be application/json, got {content_type[:100]!r}")
    too_large = APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return parse_json(bytes(body))


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work` (after the body was read), cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise asyncio.CancelledError("client disconnected")
    return task.result()


class EventStreamResponse:
    """Streams SSE bytes from an async iterator, and cancels it the moment the client disconnects (even
    while the iterator is waiting for its next item), so the request behind it is aborted at once."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None):
        self.events = events
        self.on_close = on_close  # runs even when the iterator never started (then its finally never runs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": list(self.headers)})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump_task, watcher):
                task.cancel()
            await asyncio.gather(pump_task, watcher, return_exceptions=True)
            await self.events.aclose()
            if self.on_close is not None:
                self.on_close()
        if not pump_task.cancelled() and pump_task.exception() is not None:
            exc = pump_task.exception()
            if not isinstance(exc, OSError):  # a write to a closed socket is a disconnect, not a bug
                raise exc
