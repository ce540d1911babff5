"""The route handlers: OpenAI completions and chat (streaming and not), models, tokenize/detokenize, health,
metrics and version. Each handler gets the request and the ServerState; errors are raised as APIError."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from jserve import __version__
from jserve.lora import LoRARequest
from jserve.sampling_params import InvalidParameterError, SamplingParams, StructuredOutputsParams, with_defaults
from jserve.server import responses as R
from jserve.server import responses_api
from jserve.server.async_engine import AsyncEngine, EngineDeadError, Generation, QueueFullError
from jserve.server.http import EventStreamResponse, read_json, unless_disconnected
from jserve.server.limits import TIMEOUT_HEADER, Admission, Limits, MeteredGeneration
from jserve.server.multi_model import FALLBACK_HEADER
from jserve.server.protocol import (
    DETOKENIZE_FIELDS,
    LOAD_LORA_FIELDS,
    REQUIRED,
    TOKENIZE_FIELDS,
    UNLOAD_LORA_FIELDS,
    APIError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerationRequest,
    bad_request,
    chat_template_kwargs,
    check_fields,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from jserve.server.reasoning import ReasoningStream, split_reasoning
from jserve.server.state import ModelState, ServerState
from jserve.server.tokenizer_worker import TokenizerWorker
from jserve.server.tools import READS_SPECIAL_TOKENS, STREAMED_PARSERS, ToolRequest, ToolStream, parse_tool_request

logger = logging.getLogger(__name__)

# nginx's status for a request whose client closed the connection before the response.
CLIENT_CLOSED_REQUEST = 499
# Seconds a client is told to wait after a 429; the openai client honours Retry-After.
RETRY_AFTER_SECONDS = 1


# ----- admission -----

class _QueueFull(APIError):
    """The model's queue is full: a 429, or the fallback model's turn."""


@contextlib.contextmanager
def _admission_errors() -> Iterator[None]:
    try:
        yield
    except QueueFullError as e:
        raise _QueueFull(429, str(e), code="rate_limit_exceeded",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from None
    except ValueError as e:
        raise bad_request(str(e), "n") from None


def _precheck(request: Request, state: ServerState, model: ModelState, num_prompts: int,
              req: GenerationRequest, lora: LoRARequest | None) -> tuple[ModelState, Admission]:
    """The model that serves the request and its admission: `model`, or the server's fallback model where
    `model`'s queue is over its limit (full, or its estimated wait over --max-queue-delay). A request for a LoRA
    adapter has no fallback: the adapter is its base model's."""
    try:
        return model, _begin(request, model, num_prompts, req)
    except APIError as e:
        fallback = state.fallback_for(model) if lora is None else None
        if fallback is None or not (isinstance(e, _QueueFull) or e.code == "queue_delay_exceeded"):
            raise
        logger.info("%s is over its queue limit (%s): %s serves the request", model.name, e.code, fallback.name)
        return fallback, _begin(request, fallback, num_prompts, req)


def _begin(request: Request, model: ModelState, num_prompts: int, req: GenerationRequest) -> Admission:
    """Refuse what cannot be admitted before spending time on tokenization: the model's capacity, then the API
    key's limits, the queue delay and the deadline header (jserve/server/limits.py). The caller must end or
    refuse the returned Admission."""
    engine = model.engine
    with _admission_errors():
        engine.check_admissible(num_prompts, req.params.n)
    limits: Limits = model.limits or request.state.limits
    admission = limits.begin(request.state.api_key, req.priority, num_prompts * req.params.n,
                             engine.engine.config.max_num_seqs, request.headers.get(TIMEOUT_HEADER))
    if isinstance(req.params, SamplingParams):  # embeddings use no prefix cache, so no salt
        salt = admission.cache_salt(req.params.cache_salt)
        if salt != req.params.cache_salt:
            req.params = req.params.clone(cache_salt=salt)
    return admission


async def _admit(engine: AsyncEngine, request_id: str, prompts: list[list[int]],
                 req: GenerationRequest, admission: Admission, lora: LoRARequest | None = None) -> MeteredGeneration:
    """Admit and add the request: 429 when the server is full or the key is out of tokens, 400 when the engine
    rejects it."""
    sampling = isinstance(req.params, SamplingParams)  # else PoolingParams: an embedding generates no token
    if sampling and req.params.structured_outputs is not None:
        await _compile_constraint(engine, req.params.structured_outputs)
    admission.reserve_tokens([len(p) for p in prompts], req.params.max_tokens if sampling else 0, req.params.n,
                             engine.engine.max_model_len)
    with _admission_errors():
        gen = engine.generate(request_id, prompts, req.params, admission.priority, lora_request=lora)
    try:
        await gen.start()
    except ValueError as e:
        gen.close()
        raise bad_request(str(e), getattr(e, "param", None)) from None
    except EngineDeadError as e:
        gen.close()
        raise APIError(503, str(e), code="engine_dead") from None
    except BaseException:
        gen.close()
        raise
    admission.admitted()
    return MeteredGeneration(gen, admission)


async def _compile_constraint(engine: AsyncEngine, constraint: StructuredOutputsParams) -> None:
    """Compile a request's constraint off the engine thread (a large schema takes a while): a 400 naming the
    compiler's complaint, or the compiled grammar cached for the engine's matchers."""
    grammars = getattr(engine.engine, "grammars", None)  # a data-parallel front compiles in each replica instead
    if grammars is None:
        return
    try:
        await asyncio.to_thread(grammars.check, constraint)
    except InvalidParameterError as e:
        raise bad_request(str(e), e.param) from None


def _tracker(req: GenerationRequest) -> R.ChoiceTracker:
    return R.ChoiceTracker(req.params.n, frozenset(req.params.stop_token_ids or ()))


def _completion_tracker(req: CompletionRequest) -> R.ChoiceTracker:
    tracker = _tracker(req)
    if req.echo:
        tracker.echo, tracker.echo_only = req.echo_texts, req.echo_only
    return tracker


async def _token_bytes(tokenizer: TokenizerWorker, deltas: list[R.ChoiceDelta]) -> dict[int, bytes]:
    ids = {token for d in deltas for entry in d.logprobs for token in (entry if isinstance(entry, dict) else (entry,))}
    return await tokenizer.token_bytes(ids) if ids else {}


def _stream_error(error: Exception) -> bytes:
    if isinstance(error, APIError):  # e.g. the request's deadline passed
        return R.sse(error.body())
    status = 503 if isinstance(error, EngineDeadError) else 500
    return R.sse(APIError(status, str(error) or type(error).__name__).body())


def _stream(gen: Generation, events: AsyncIterator[bytes]) -> EventStreamResponse:
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except Exception as e:  # the stream has begun: report in-band, in OpenAI's shape
            if not isinstance(e, (EngineDeadError, APIError)):
                logger.exception("error while streaming %s", gen.request_ids[0])
            yield _stream_error(e)
        yield R.sse("[DONE]")

    return EventStreamResponse(guarded(), on_close=gen.close)


def _mark_fallback(response: Response | EventStreamResponse, asked: ModelState, served: ModelState) -> Response:
    """A response from the fallback model names the model asked for in a header (its `model` field says which
    model served it)."""
    if served is not asked:
        if isinstance(response, EventStreamResponse):
            response.headers = [*response.headers, (FALLBACK_HEADER.encode(), asked.name.encode())]
        else:
            response.headers[FALLBACK_HEADER] = asked.name
    return response


async def _respond(request: Request, gen: Generation, stream: bool, make, args: tuple, streamer=None) -> Response:
    """Stream SSE events from make(*args) (through `streamer`, for another framing), or await its JSON body
    (aborting if the client goes away)."""
    if stream:
        return (streamer or _stream)(gen, make(*args))
    try:
        return JSONResponse(await unless_disconnected(request, make(*args)))
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise  # the server itself cancels this handler (shutdown)
        # The client went away (unless_disconnected): a routine event, so end normally instead of raising into
        # the ASGI server's error log. Nobody reads the response; 499 is what the access log shows.
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        gen.close()


# ----- completions -----

async def create_completion(request: Request, state: ServerState) -> Response:
    state.ready()
    req = parse_completion(await read_json(request, state.settings.max_request_bytes))
    asked, lora = state.route(req.model), state.lora_request(req.model)
    served, admission = _precheck(request, state, asked, len(req.prompts), req, lora)

    async def prompts(tokenizer: TokenizerWorker) -> list:
        if req.echo:  # what is echoed: the prompt as given, or its ids' text
            req.echo_texts = [p if isinstance(p, str) else await tokenizer.decode(p) for p in req.prompts]
        return [await tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]

    return await _generate(request, req, asked, served, admission, "cmpl", prompts, _completion_events,
                           _completion_body, lora)


async def _generate(request: Request, req, asked: str, served, admission, id_prefix: str, prompts_of, events,
                    body, lora: LoRARequest | None, streamer=None) -> Response:
    """Tokenize (prompts_of), admit into the served model's engine (with the LoRA adapter `lora` where the request
    names one), and answer streamed (events) or whole (body); the admission is given back if anything before the
    engine fails."""
    try:
        # The served model's recommended sampling fields (generation_config.json) for those the body left out
        req.params = with_defaults(req.params, req.given, served.engine.engine.sampling_defaults)
        prompts = await prompts_of(served.tokenizer)
        # vLLM's `model` of an adapter's response is the adapter's name
        header = R.ResponseHeader(R.new_id(id_prefix), lora.lora_name if lora is not None else served.name)
        gen = await _admit(served.engine, header.id, prompts, req, admission, lora)
    except BaseException:
        admission.refuse()
        raise
    response = await _respond(request, gen, req.stream, events if req.stream else body,
                              (gen, req, header, served.tokenizer), streamer)
    return _mark_fallback(response, asked, served)


async def _completion_events(gen: Generation, req: CompletionRequest, header: R.ResponseHeader,
                             tokenizer: TokenizerWorker) -> AsyncIterator[bytes]:
    tracker, k = _completion_tracker(req), req.params.logprobs
    extra = {"usage": None} if req.include_usage else {}
    async for prompt_index, output in gen:
        deltas = tracker.update(prompt_index, output)
        token_bytes = await _token_bytes(tokenizer, deltas) if k is not None else {}
        for d in deltas:
            choice = R.completion_choice(d, token_bytes.__getitem__, k, tracker.choices[d.index])
            yield R.sse(header.obj("text_completion", [choice], **extra))
    if req.include_usage:
        yield R.sse(header.obj("text_completion", [], usage=tracker.usage()))


async def _completion_body(gen: Generation, req: CompletionRequest, header: R.ResponseHeader,
                           tokenizer: TokenizerWorker) -> dict:
    tracker, k, deltas = _completion_tracker(req), req.params.logprobs, []
    async for prompt_index, output in gen:
        deltas += tracker.update(prompt_index, output)
    merged = R.merge_deltas(deltas)
    token_bytes = await _token_bytes(tokenizer, merged) if k is not None else {}
    choices = [R.completion_choice(d, token_bytes.__getitem__, k, R.ChoiceState()) for d in merged]
    return header.obj("text_completion", choices, usage=tracker.usage())


# ----- chat -----

async def create_chat_completion(request: Request, state: ServerState) -> Response:
    state.ready()
    return await serve_chat(request, state, await read_json(request, state.settings.max_request_bytes), "chatcmpl",
                            _chat_events, chat_body)


async def create_response(request: Request, state: ServerState) -> Response:
    """OpenAI's Responses API, served as a chat completion (jserve.server.responses_api)."""
    state.ready()
    body = await read_json(request, state.settings.max_request_bytes)

    def events(gen: Generation, req: ChatRequest, header: R.ResponseHeader, tokenizer: TokenizerWorker):
        return responses_api.response_events(chat_chunks(gen, req, header, tokenizer), body)

    async def whole(gen: Generation, req: ChatRequest, header: R.ResponseHeader, tokenizer: TokenizerWorker) -> dict:
        return responses_api.response_of(await chat_body(gen, req, header, tokenizer), body)

    return await serve_chat(request, state, responses_api.chat_body(body), "resp", events, whole)


async def serve_chat(request: Request, state: ServerState, body: dict, id_prefix: str, events, whole,
                     streamer=None) -> Response:
    """A chat completions body served: admitted, then answered by events(gen, req, header, tokenizer) (streamed,
    through `streamer` where the framing is not OpenAI's SSE) or whole(...) (its JSON body). chat_chunks and
    chat_body are the OpenAI shapes other APIs (Responses, Ollama) build theirs from."""
    req = parse_chat(body)
    asked, lora = state.route(req.model), state.lora_request(req.model)
    req.tools = parse_tool_request(body, state.settings.tool_call_parser)
    req.reasoning_parser = state.settings.reasoning_parser
    # harmony's markers and DeepSeek's tool-call markers are special tokens: the parsers read them
    if req.reasoning_parser == "openai_gptoss" or (req.tools is not None and req.tools.choice == "auto"
                                                    and req.tools.parser in READS_SPECIAL_TOKENS):
        req.params = req.params.clone(skip_special_tokens=False, spaces_between_special_tokens=False)
    if req.tools is not None and (constraint := req.tools.constraint()) is not None:
        if req.params.structured_outputs is not None:
            raise bad_request("a required or named tool_choice constrains the output itself: drop "
                              "response_format/structured_outputs", "tool_choice")
        req.params = req.params.clone(structured_outputs=constraint)
    served, admission = _precheck(request, state, asked, 1, req, lora)

    async def prompts(tokenizer: TokenizerWorker) -> list:
        return [await tokenizer.chat(req.messages, req.add_generation_prompt,
                                     req.tools.tools if req.tools is not None else None, req.template_kwargs)]

    return await _generate(request, req, asked, served, admission, id_prefix, prompts, events, whole, lora, streamer)


async def _chat_events(gen: Generation, req: ChatRequest, header: R.ResponseHeader,
                       tokenizer: TokenizerWorker) -> AsyncIterator[bytes]:
    async for chunk in chat_chunks(gen, req, header, tokenizer):
        yield R.sse(chunk)


async def chat_chunks(gen: Generation, req: ChatRequest, header: R.ResponseHeader,
                       tokenizer: TokenizerWorker) -> AsyncIterator[dict]:
    k = req.params.logprobs
    # An auto choice's content streams as it comes, its calls once the output is complete (ToolStream); a required
    # or named call is the whole output, and gpt-oss's are harmony messages: those, and any choice with logprobs
    # (which ride on the message), are sent whole at the end, as deltas OpenAI's way.
    streamed_tools = req.tools is not None and req.tools.choice == "auto" and req.tools.parser in STREAMED_PARSERS \
        and k is None
    if req.tools is not None and not streamed_tools:
        body = await chat_body(gen, req, header, tokenizer)
        extra = {"usage": None} if req.include_usage else {}
        for choice in body["choices"]:
            for chunk in R.tool_chunk_choices(choice):
                yield header.obj("chat.completion.chunk", [chunk], **extra)
        if req.include_usage:
            yield header.obj("chat.completion.chunk", [], usage=body["usage"])
        return
    tracker, extra = _tracker(req), {"usage": None} if req.include_usage else {}
    reasoning: dict[int, ReasoningStream] = {}  # by choice index, with a reasoning parser
    tool_streams: dict[int, ToolStream] = {}  # by choice index, with streamed_tools
    async for prompt_index, output in gen:
        deltas = tracker.update(prompt_index, output)
        token_bytes = await _token_bytes(tokenizer, deltas) if k is not None else {}
        for d in deltas:
            parts = None
            if req.reasoning_parser is not None:
                stream = reasoning.setdefault(d.index, ReasoningStream(req.reasoning_parser))
                thought, content = stream.feed(d.text, d.finish_reason is not None)
                parts = (thought if req.include_reasoning else "", content)
            if streamed_tools:
                choices = _tool_stream_choices(d, parts, tool_streams.setdefault(d.index, ToolStream(
                    req.tools.parser)), req.tools)
            else:
                choices = R.chat_chunk_choices(d, token_bytes.__getitem__, k, parts)
            for choice in choices:
                yield header.obj("chat.completion.chunk", [choice], **extra)
    if req.include_usage:
        yield header.obj("chat.completion.chunk", [], usage=tracker.usage())


def _tool_stream_choices(d: R.ChoiceDelta, parts: tuple[str, str] | None, stream: ToolStream,
                         tools: ToolRequest) -> list[dict]:
    """A chat delta's stream choices under an auto tool choice: the content the tool stream lets through, and at a
    finish by a stop the calls the whole content holds (with finish_reason "tool_calls"), else the rest."""
    thought, content = ("", d.text) if parts is None else parts
    content = stream.feed(content)
    calls = tools.calls(stream.text)[1] if d.finish_reason == "stop" else []
    if d.finish_reason is not None and not calls:
        content += stream.rest()
    if not calls:
        return R.chat_chunk_choices(d, lambda _: b"", None, (thought, content))
    choices = R.chat_chunk_choices(dataclasses.replace(d, finish_reason=None), lambda _: b"", None, (thought, content))
    if not (thought or content):  # nothing but the role before the calls
        choices = choices[:-1]
    return choices + R.tool_call_chunks(d.index, [call.body() for call in calls], "tool_calls", d.stop_reason)


async def chat_body(gen: Generation, req: ChatRequest, header: R.ResponseHeader,
                    tokenizer: TokenizerWorker) -> dict:
    tracker, k, deltas = _tracker(req), req.params.logprobs, []
    async for prompt_index, output in gen:
        deltas += tracker.update(prompt_index, output)
    merged = R.merge_deltas(deltas)
    token_bytes = await _token_bytes(tokenizer, merged) if k is not None else {}
    choices = [R.chat_message_choice(d, token_bytes.__getitem__, k) for d in merged]
    for choice in choices:
        text = choice["message"]["content"]
        if req.reasoning_parser is not None:
            split = split_reasoning(text, req.reasoning_parser)
            choice["message"]["content"] = split.content or None
            if req.include_reasoning:
                choice["message"]["reasoning_content"] = split.reasoning or None
        if req.tools is not None:
            # gpt-oss's calls are harmony messages of their own, read from the text with its markers
            _tool_message(choice, req.tools, text if req.tools.parser == "openai" else choice["message"]["content"])
    return header.obj("chat.completion", choices, usage=tracker.usage())


def _tool_message(choice: dict, tools: ToolRequest, text: str | None) -> None:
    """Turn a finished chat choice's text (its content, or for gpt-oss its harmony messages) into OpenAI's
    tool_calls where it holds calls."""
    message = choice["message"]
    if choice["finish_reason"] != "stop":  # cut short: no complete call to report
        return
    content, calls = tools.calls(text or "")
    if calls:
        message["content"] = content
        message["tool_calls"] = [call.body() for call in calls]
        # OpenAI ends a forced call to a named function with "stop", a call the model chose with "tool_calls".
        choice["finish_reason"] = "tool_calls" if tools.choice in ("auto", "required") else "stop"


# ----- the rest of the API -----

# ----- embeddings -----

async def create_embedding(request: Request, state: ServerState) -> Response:
    """OpenAI's POST /v1/embeddings, served by a model of runner "pooling" (jserve.engine.pooling)."""
    req = parse_embedding(await read_json(request, state.settings.max_request_bytes))
    header = R.ResponseHeader(R.new_id("embd"), "")
    result = await embed(request, state, req)
    if isinstance(result, Response):  # the client went away
        return result
    name, vectors, tokens = result
    return JSONResponse({"id": header.id, "object": "list", "created": header.created, "model": name,
                         "data": [{"object": "embedding", "index": i,
                                   "embedding": R.encode_embedding(v, req.encoding_format)}
                                  for i, v in enumerate(vectors)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def embed(request: Request, state: ServerState, req: EmbeddingRequest
                ) -> tuple[str, list[list[float]], int] | Response:
    """An embedding request admitted and run on the model it names -> (the model's name, each input's vector, the
    prompt tokens), or the 499 response where the client went away."""
    state.ready()
    model = state.route(req.model)
    if model.engine.engine.config.runner != "pooling":
        raise bad_request(f"model {model.name!r} generates text and does not serve embeddings (serve an embedding "
                          "model with --runner pooling)", "model")
    admission = _begin(request, model, len(req.prompts), req)  # an embedding model has no fallback
    try:
        prompts = [await model.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
        gen = await _admit(model.engine, R.new_id("embd"), prompts, req, admission)
    except BaseException:
        admission.refuse()
        raise

    async def vectors() -> list:
        found: list = [None] * len(prompts)
        async for prompt_index, output in gen:
            found[prompt_index] = output.outputs.embedding
        return found

    try:
        return model.name, await unless_disconnected(request, vectors()), sum(map(len, prompts))
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        gen.close()


async def list_models(request: Request, state: ServerState) -> Response:
    state.ready()
    cards = [{"id": m.name, "object": "model", "created": int(m.engine.started_at), "owned_by": "jserve",
              "root": str(m.engine.engine.model_dir), "parent": None, "max_model_len": m.engine.engine.max_model_len}
             for m in state.models.values()]
    # Then the LoRA adapters, as vLLM lists them: root their directory, parent their base model
    cards += [{"id": name, "object": "model", "created": int(m.engine.started_at), "owned_by": "jserve",
               "root": m.loras[name].lora_path, "parent": m.name, "max_model_len": m.engine.engine.max_model_len}
              for name, m in state.adapters.items()]
    return JSONResponse({"object": "list", "data": cards})


async def load_lora_adapter(request: Request, state: ServerState) -> Response:
    """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"[, "base_model_name"]}: 200 with a plain-text
    line once the adapter serves requests whose model is lora_name."""
    _check_lora_updating(state)
    values = check_fields(await read_json(request, state.settings.max_request_bytes), LOAD_LORA_FIELDS,
                          REQUIRED["load_lora"])
    await state.load_lora(values["lora_name"], values["lora_path"], values.get("base_model_name"))
    return PlainTextResponse(f"Success: LoRA adapter '{values['lora_name']}' added successfully.")


async def unload_lora_adapter(request: Request, state: ServerState) -> Response:
    """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: 200 with a plain-text line; requests already admitted
    with the adapter finish with it, later ones get 404."""
    _check_lora_updating(state)
    values = check_fields(await read_json(request, state.settings.max_request_bytes), UNLOAD_LORA_FIELDS,
                          REQUIRED["unload_lora"])
    await state.unload_lora(values["lora_name"])
    return PlainTextResponse(f"Success: LoRA adapter '{values['lora_name']}' removed successfully.")


def _check_lora_updating(state: ServerState) -> None:
    if not state.settings.allow_runtime_lora_updating:
        raise APIError(404, "loading and unloading LoRA adapters at run time is off: start the server with "
                            "--allow-runtime-lora-updating", code="not_found")


async def tokenize(request: Request, state: ServerState) -> Response:
    state.ready()
    values = check_fields(await read_json(request, state.settings.max_request_bytes), TOKENIZE_FIELDS,
                          REQUIRED["tokenize"])
    model = state.route(values.get("model"))
    engine, tokenizer = model.engine, model.tokenizer
    if ("prompt" in values) == ("messages" in values):
        raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
    if "prompt" in values:
        tokens = await tokenizer.encode(values["prompt"], values.get("add_special_tokens", True))
    else:
        chat = parse_chat({"messages": values["messages"]})
        tokens = await tokenizer.chat(chat.messages, values.get("add_generation_prompt", True),
                                      template_kwargs=chat_template_kwargs(values))
    return JSONResponse({"count": len(tokens), "max_model_len": engine.engine.max_model_len, "tokens": tokens})


async def detokenize(request: Request, state: ServerState) -> Response:
    state.ready()
    values = check_fields(await read_json(request, state.settings.max_request_bytes), DETOKENIZE_FIELDS,
                          REQUIRED["detokenize"])
    tokenizer = state.route(values.get("model")).tokenizer
    return JSONResponse({"prompt": await tokenizer.decode(values["tokens"])})


async def health(request: Request, state: ServerState) -> Response:
    # 200 {"status": "ok"} when serving; 503 with "loading" (retry soon) or "dead" (the process is about to exit,
    # or its model cannot load) otherwise.
    status, reason = state.health()
    if status == "ready":
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": status, "reason": reason}, status_code=503)


async def metrics(request: Request, state: ServerState) -> Response:
    return Response(await asyncio.to_thread(state.render_metrics), media_type=CONTENT_TYPE_LATEST)


async def version(request: Request, state: ServerState) -> Response:
    return JSONResponse({"version": __version__})
