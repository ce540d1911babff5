"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/ps, /api/version), so tools and
clients written for Ollama talk to jserve. A chat or generate request becomes a chat completion (its options the
sampling fields, `format` the response format) and the answer goes back in Ollama's shape: one JSON object, or a
stream of newline-delimited JSON objects (Ollama streams unless `stream` is false), the last with `done: true`, the
finish reason and the token counts. Errors are Ollama's `{"error": "..."}`.

Not served: model management (pull, push, create, copy, delete: a 501 saying so), images, /api/generate's `raw`,
`suffix` and `context`, and the options that size the runtime (num_ctx, num_gpu, ...), which are read and ignored
as the server's own settings govern them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jserve import __version__
from jserve.pooling_params import PoolingParams
from jserve.server import routes
from jserve.server.http import EventStreamResponse, read_json
from jserve.server.protocol import APIError, EmbeddingRequest, bad_request
from jserve.server.state import ModelState, ServerState

# Ollama's options -> the chat completions fields they set
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}
NDJSON = "application/x-ndjson"


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ollama_errors(handler: Callable[[Request, ServerState], Awaitable[Response]]):
    """A route handler whose errors answer in Ollama's shape, {"error": message}, with the same status."""
    async def wrapped(request: Request, state: ServerState) -> Response:
        try:
            return await handler(request, state)
        except APIError as e:
            return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)
    return wrapped


def _model(state: ServerState, name: Any) -> ModelState:
    """The served model an Ollama name means: the name itself, or without its ":latest" tag."""
    if name is not None and not isinstance(name, str):
        raise bad_request("model must be a string", "model")
    if isinstance(name, str) and name not in state.models and name.endswith(":latest"):
        name = name[:-len(":latest")]
    return state.route(name)


def _chat_fields(body: dict, model: ModelState) -> dict:
    """The chat completions fields an Ollama chat or generate body sets (model, options, format, stream)."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("options must be an object", "options")
    chat = {"model": model.name, "stream": body.get("stream", True) is not False}
    chat.update({field: options[name] for name, field in _OPTIONS.items() if options.get(name) is not None})
    predict = options.get("num_predict")
    if predict is not None and predict != -1:  # -1: no limit but the context
        chat["max_completion_tokens"] = predict
    fmt = body.get("format")
    if fmt == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request('format must be "json" or a JSON schema', "format")
    if body.get("think") is False:
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}  # the last object carries the counts
    return chat


def _messages(given: Any) -> list[dict]:
    if not isinstance(given, list):
        raise bad_request("messages must be a list", "messages")
    messages = []
    for i, message in enumerate(given):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        if message.get("images"):
            raise bad_request("images are not supported: jserve serves text models", "messages")
        out = {key: message[key] for key in ("role", "content") if key in message}
        calls = message.get("tool_calls")
        if calls:  # Ollama's arguments are an object; OpenAI's are JSON text
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise bad_request(f'messages[{i}].tool_calls must be [{{"function": {{"name", "arguments"}}}}]',
                                  "messages")
            out["tool_calls"] = [{"id": f"call_{j}", "type": "function", "function": {
                "name": c["function"].get("name"), "arguments": json.dumps(c["function"].get("arguments") or {})}}
                for j, c in enumerate(calls)]
        messages.append(out)
    return messages


def _counts(usage: dict | None, started: float) -> dict:
    total = int((time.monotonic() - started) * 1e9)
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    return {"total_duration": total, "load_duration": 0, "prompt_eval_count": usage["prompt_tokens"],
            "prompt_eval_duration": 0, "eval_count": usage["completion_tokens"], "eval_duration": total}


def _ollama_calls(calls: list[dict] | None) -> list[dict]:
    return [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls or []]


def _reply(kind: str, model: str, text: str, thinking: str | None = None, calls: list[dict] | None = None) -> dict:
    """One Ollama object's payload: a chat's message, or a generate's response."""
    if kind == "generate":
        return {"model": model, "created_at": _now(), "response": text,
                **({"thinking": thinking} if thinking else {})}
    message = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}
    if calls:
        message["tool_calls"] = _ollama_calls(calls)
    return {"model": model, "created_at": _now(), "message": message}


def _done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"


def ndjson_stream(gen, lines: AsyncIterator[bytes]) -> EventStreamResponse:
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for line in lines:
                yield line
        except Exception as e:  # the stream has begun: the error is its last object, as Ollama sends it
            yield (json.dumps({"error": str(e) or type(e).__name__}) + "\n").encode()

    response = EventStreamResponse(guarded(), on_close=gen.close)
    response.headers = [(b"content-type", NDJSON.encode()), *response.headers[1:]]
    return response


async def _serve(request: Request, state: ServerState, kind: str, chat: dict) -> Response:
    started, model = time.monotonic(), chat["model"]

    async def whole(gen, req, header, tokenizer) -> dict:
        body = await routes.chat_body(gen, req, header, tokenizer)
        choice = body["choices"][0]
        message = choice["message"]
        return {**_reply(kind, model, message.get("content") or "", message.get("reasoning_content"),
                         message.get("tool_calls")),
                "done": True, "done_reason": _done_reason(choice["finish_reason"]),
                **_counts(body.get("usage"), started)}

    async def events(gen, req, header, tokenizer) -> AsyncIterator[bytes]:
        finish = None
        async for chunk in routes.chat_chunks(gen, req, header, tokenizer):
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                text, thinking = delta.get("content") or "", delta.get("reasoning_content")
                if text or thinking or delta.get("tool_calls"):
                    line = {**_reply(kind, model, text, thinking, delta.get("tool_calls")), "done": False}
                    yield (json.dumps(line, ensure_ascii=False) + "\n").encode()
            if chunk.get("usage") is not None:
                last = {**_reply(kind, model, ""), "done": True, "done_reason": _done_reason(finish),
                        **_counts(chunk["usage"], started)}
                yield (json.dumps(last) + "\n").encode()

    return await routes.serve_chat(request, state, chat, "ollama", events, whole, ndjson_stream)


@ollama_errors
async def chat(request: Request, state: ServerState) -> Response:
    body = await read_json(request, state.settings.max_request_bytes)
    model = _model(state, body.get("model"))
    payload = {**_chat_fields(body, model), "messages": _messages(body.get("messages") or [])}
    if body.get("tools"):
        payload["tools"] = body["tools"]
    return await _serve(request, state, "chat", payload)


@ollama_errors
async def generate(request: Request, state: ServerState) -> Response:
    body = await read_json(request, state.settings.max_request_bytes)
    model = _model(state, body.get("model"))
    for name in ("raw", "suffix", "context", "images"):
        if body.get(name):
            raise bad_request(f"{name} is not supported (send chat messages to /api/chat, or a prompt as it is to "
                              "/v1/completions)", name)
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string", "prompt")
    if not prompt:  # Ollama's way to load a model: an empty prompt answers at once
        return JSONResponse({"model": model.name, "created_at": _now(), "response": "", "done": True,
                             "done_reason": "load"})
    system = body.get("system")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return await _serve(request, state, "generate", {**_chat_fields(body, model), "messages": messages})


@ollama_errors
async def embed(request: Request, state: ServerState) -> Response:
    """/api/embed {"model", "input": str | [str]}, and the older /api/embeddings {"model", "prompt"}."""
    body = await read_json(request, state.settings.max_request_bytes)
    legacy = request.url.path.endswith("/embeddings")
    given = body.get("prompt" if legacy else "input")
    inputs = [given] if isinstance(given, str) else given
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
        raise bad_request(f"{'prompt' if legacy else 'input'} must be a string or a list of strings", "input")
    model = _model(state, body.get("model"))
    dimensions = body.get("dimensions")
    try:
        params = PoolingParams(dimensions=dimensions)
    except ValueError as e:
        raise bad_request(str(e), "dimensions") from None
    started = time.monotonic()
    result = await routes.embed(request, state, EmbeddingRequest(model.name, inputs, params, "float", 0))
    if isinstance(result, Response):
        return result
    name, vectors, tokens = result
    if legacy:
        return JSONResponse({"embedding": vectors[0]})
    return JSONResponse({"model": name, "embeddings": vectors, "total_duration": int((time.monotonic() - started) *
                                                                                   1e9),
                         "load_duration": 0, "prompt_eval_count": tokens})


def _details(model: ModelState) -> dict:
    engine = model.engine.engine
    config = engine.model_config
    path = str(engine.model_dir)
    return {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors",
            "family": config.model_type, "families": [config.model_type],
            "quantization_level": (engine.quantization or engine.config.dtype).upper()}


def _card(model: ModelState) -> dict:
    engine = model.engine.engine
    return {"name": model.name, "model": model.name, "modified_at": _now(), "size": engine.resident_weight_bytes,
            "digest": hashlib.sha256(str(engine.model_dir).encode()).hexdigest(), "details": _details(model)}


@ollama_errors
async def tags(request: Request, state: ServerState) -> Response:
    state.ready()
    return JSONResponse({"models": [_card(m) for m in state.models.values()]})


@ollama_errors
async def ps(request: Request, state: ServerState) -> Response:
    state.ready()
    return JSONResponse({"models": [{**_card(m), "expires_at": "0001-01-01T00:00:00Z",
                                     "size_vram": _card(m)["size"]} for m in state.models.values()]})


@ollama_errors
async def show(request: Request, state: ServerState) -> Response:
    body = await read_json(request, state.settings.max_request_bytes)
    model = _model(state, body.get("model") or body.get("name"))
    engine = model.engine.engine
    config = engine.model_config
    pooling = engine.config.runner == "pooling"
    template = engine.tokenizer.hf.chat_template or ""
    info = {"general.architecture": config.model_type, f"{config.model_type}.context_length": engine.max_model_len,
            f"{config.model_type}.embedding_length": config.hidden_size,
            f"{config.model_type}.block_count": config.num_layers}
    return JSONResponse({"modelfile": "", "parameters": "", "template": template, "details": _details(model),
                         "model_info": info, "modified_at": _now(),
                         "capabilities": ["embedding"] if pooling else ["completion", "tools"]})


@ollama_errors
async def version(request: Request, state: ServerState) -> Response:
    return JSONResponse({"version": __version__})


@ollama_errors
async def not_served(request: Request, state: ServerState) -> Response:
    raise APIError(501, f"{request.url.path} is not served: jserve serves the models it was started with "
                        "(jserve serve --model ...)")


ROUTES = [("/api/chat", ["POST"], chat, True), ("/api/generate", ["POST"], generate, True),
          ("/api/embed", ["POST"], embed, True), ("/api/embeddings", ["POST"], embed, True),
          ("/api/tags", ["GET"], tags, True), ("/api/ps", ["GET"], ps, True), ("/api/show", ["POST"], show, True),
          ("/api/version", ["GET"], version, False),
          *((f"/api/{name}", ["POST", "DELETE"], not_served, True)
            for name in ("pull", "push", "create", "copy", "delete"))]
