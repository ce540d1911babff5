"""The OpenAPI 3.1 description served at /openapi.json. Request schemas are the very tables the server
validates with (protocol.py), so the document cannot drift from what the server accepts."""

from __future__ import annotations

from jserve import __version__
from jserve.server.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    EMBEDDING_FIELDS,
    LOAD_LORA_FIELDS,
    REQUIRED,
    TOKENIZE_FIELDS,
    UNLOAD_LORA_FIELDS,
    request_schema,
)


def _obj(required: list[str], **props: dict) -> dict:
    return {"type": "object", "properties": props, "required": required}


_STR, _INT, _NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_NULL_STR = {"type": ["string", "null"]}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", None]}
_CHAT_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None]}
# vLLM's field: the stop string or stop_token_ids id that ended the choice, else null.
_STOP_REASON = {"type": ["string", "integer", "null"]}
_USAGE = _obj(["prompt_tokens", "completion_tokens", "total_tokens"], prompt_tokens=_INT,
              completion_tokens=_INT, total_tokens=_INT,
              prompt_tokens_details=_obj(["cached_tokens"], cached_tokens=_INT))
_TOP = _obj(["token", "logprob"], token=_STR, logprob=_NUM, bytes={"type": "array", "items": _INT})
_CHAT_LOGPROBS = {"type": ["object", "null"], "properties": {"content": {"type": "array", "items": {
    **_TOP, "properties": {**_TOP["properties"], "top_logprobs": {"type": "array", "items": _TOP}}}}}}
_COMPLETION_LOGPROBS = {"type": ["object", "null"], "properties": {
    "tokens": {"type": "array", "items": _STR}, "token_logprobs": {"type": "array", "items": _NUM},
    "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": _NUM}},
    "text_offset": {"type": "array", "items": _INT}}}


def _envelope(kind: str, choice: dict, usage_required: bool) -> dict:
    required = ["id", "object", "created", "model", "choices"] + (["usage"] if usage_required else [])
    return _obj(required, id=_STR, object={"type": "string", "const": kind}, created=_INT, model=_STR,
                choices={"type": "array", "items": choice}, usage={"anyOf": [_USAGE, {"type": "null"}]})


def _tokenize_request() -> dict:
    """Exactly one of `prompt` or `messages` (the route's rule), as two exclusive forms of the same table."""
    def form(field: str, option: str) -> dict:
        other = "messages" if field == "prompt" else "prompt"
        fields = {name: TOKENIZE_FIELDS[name] for name in ("model", field, option)}
        fields[field] = {"anyOf": [s for s in fields[field]["anyOf"] if s.get("type") != "null"],
                         "description": fields[field]["description"]}
        return {**request_schema(fields, [field]), "not": {"required": [other]}}

    return {"oneOf": [form("prompt", "add_special_tokens"), form("messages", "add_generation_prompt")],
            "description": "Give `prompt` (text) or `messages` (rendered with the chat template), not both."}


SCHEMAS = {
    "CompletionRequest": request_schema(COMPLETION_FIELDS, REQUIRED["completion"]),
    "ChatCompletionRequest": request_schema(CHAT_FIELDS, REQUIRED["chat"]),
    # What the Responses route reads before it hands the body on as a chat completion (responses_api.chat_body)
    "ResponseRequest": request_schema({
        "model": CHAT_FIELDS["model"],
        "input": {"anyOf": [_STR, {"type": "array", "items": {"type": "object"}}],
                  "description": "A user message, or items: messages, function_call and function_call_output."},
        "instructions": {"anyOf": [_STR, {"type": "null"}], "description": "A system message before the input."},
        "max_output_tokens": CHAT_FIELDS["max_completion_tokens"], "temperature": CHAT_FIELDS["temperature"],
        "top_p": CHAT_FIELDS["top_p"], "stream": CHAT_FIELDS["stream"],
        "tools": {"type": "array", "items": {"type": "object"}, "description": "Function tools (type function)."},
        "tool_choice": {"anyOf": [_STR, {"type": "object"}]}, "parallel_tool_calls": CHAT_FIELDS["parallel_tool_calls"],
        "text": {"type": "object", "description": "format: text, json_object or json_schema."},
        "reasoning": {"type": "object", "description": "effort: the chat template's reasoning_effort."},
        "metadata": {"type": "object"}}, ["input"]),
    "Response": _obj(["id", "object", "created_at", "status", "model", "output"], id=_STR,
                     object={"type": "string", "const": "response"}, created_at=_INT, model=_STR,
                     status={"type": "string", "enum": ["completed", "incomplete"]},
                     output={"type": "array", "items": {"type": "object"}}),
    "EmbeddingRequest": request_schema(EMBEDDING_FIELDS, REQUIRED["embedding"]),
    "Embedding": _obj(["object", "data", "model", "usage"], id=_STR, object={"type": "string", "const": "list"},
                      created=_INT, model=_STR, usage=_obj(["prompt_tokens", "total_tokens"], prompt_tokens=_INT,
                                                           total_tokens=_INT), data={"type": "array", "items": _obj(
                          ["object", "index", "embedding"], object={"type": "string", "const": "embedding"},
                          index=_INT, embedding={"anyOf": [{"type": "array", "items": {"type": "number"}}, _STR]})}),
    "TokenizeRequest": _tokenize_request(),
    "DetokenizeRequest": request_schema(DETOKENIZE_FIELDS, REQUIRED["detokenize"]),
    "LoadLoraAdapterRequest": request_schema(LOAD_LORA_FIELDS, REQUIRED["load_lora"]),
    "UnloadLoraAdapterRequest": request_schema(UNLOAD_LORA_FIELDS, REQUIRED["unload_lora"]),
    "Completion": _envelope("text_completion", _obj(
        ["index", "text", "finish_reason", "logprobs"], index=_INT, text=_STR, finish_reason=_FINISH,
        stop_reason=_STOP_REASON, logprobs=_COMPLETION_LOGPROBS), usage_required=False),
    "ChatCompletion": _envelope("chat.completion", _obj(
        ["index", "message", "finish_reason"], index=_INT, finish_reason=_CHAT_FINISH, stop_reason=_STOP_REASON,
        logprobs=_CHAT_LOGPROBS,
        message=_obj(["role", "content"], role={"type": "string", "const": "assistant"}, content=_NULL_STR)),
        usage_required=True),
    "ChatCompletionChunk": _envelope("chat.completion.chunk", _obj(
        ["index", "delta", "finish_reason"], index=_INT, finish_reason=_CHAT_FINISH, stop_reason=_STOP_REASON,
        logprobs=_CHAT_LOGPROBS, delta=_obj([], role=_STR, content=_STR)), usage_required=False),
    "ModelList": _obj(["object", "data"], object={"type": "string", "const": "list"}, data={
        "type": "array", "items": _obj(["id", "object", "created", "owned_by"], id=_STR, object=_STR,
                                       created=_INT, owned_by=_STR, root=_STR, parent=_NULL_STR,
                                       max_model_len=_INT)}),
    "TokenizeResponse": _obj(["count", "max_model_len", "tokens"], count=_INT, max_model_len=_INT,
                             tokens={"type": "array", "items": _INT}),
    "DetokenizeResponse": _obj(["prompt"], prompt=_STR),
    "Error": _obj(["error"], error=_obj(["message", "type", "param", "code"], message=_STR, type=_STR,
                                        param=_NULL_STR, code=_NULL_STR)),
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_ERRORS = {str(status): {"description": why, "content": {"application/json": {"schema": _ref("Error")}}}
           for status, why in [(400, "Invalid JSON, content type or parameter; prompt too long."),
                               (401, "Missing or wrong API key (when the server has one)."),
                               (404, "Unknown model."), (413, "Request body over the size limit."),
                               (429, "Server at capacity; retry after Retry-After seconds."),
                               (503, "Model loading, or the engine stopped.")]}


def _post(summary: str, request: str, response: str, stream: str | None = None) -> dict:
    content = {"application/json": {"schema": _ref(response)}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": f"`data: <{stream}>` events "
                                                   "then `data: [DONE]`"}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": _ref(request)}}}, "responses": {"200": {
            "description": "OK", "content": content}, **_ERRORS}, "security": [{"bearer": []}]}}


def _get(summary: str, response: dict | None = None, media: str = "application/json") -> dict:
    ok = {"description": "OK"}
    if response is not None:
        ok["content"] = {media: {"schema": response}}
    return {"get": {"summary": summary, "responses": {"200": ok}}}


def openapi_spec(lora_updating: bool = False) -> dict:
    """The API's description; lora_updating: with the run-time LoRA routes (--allow-runtime-lora-updating)."""
    lora = {path: {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": _ref(schema)}}}, "responses": {"200": {"description": "OK", "content": {
            "text/plain": {"schema": _STR}}}, **_ERRORS}, "security": [{"bearer": []}]}}
        for path, summary, schema in [("/v1/load_lora_adapter", "Load a LoRA adapter and serve it by name",
                                       "LoadLoraAdapterRequest"),
                                      ("/v1/unload_lora_adapter", "Stop serving a LoRA adapter",
                                       "UnloadLoraAdapterRequest")]} if lora_updating else {}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jserve", "version": __version__,
                 "description": "OpenAI-compatible LLM serving on JAX/XLA."},
        "paths": {
            "/v1/completions": _post("Create a completion", "CompletionRequest", "Completion", "Completion"),
            "/v1/chat/completions": _post("Create a chat completion", "ChatCompletionRequest", "ChatCompletion",
                                          "ChatCompletionChunk"),
            "/v1/responses": _post("Create a response (OpenAI's Responses API, served as a chat completion)",
                                   "ResponseRequest", "Response", "ResponseStreamEvent"),
            "/v1/embeddings": _post("Create embeddings (a model served with --runner pooling)", "EmbeddingRequest",
                                    "Embedding"),
            "/v1/models": {"get": {**_get("List the served models", _ref("ModelList"))["get"],
                                   "security": [{"bearer": []}]}},
            "/tokenize": _post("Tokenize a prompt or chat messages", "TokenizeRequest", "TokenizeResponse"),
            "/detokenize": _post("Turn token ids into text", "DetokenizeRequest", "DetokenizeResponse"),
            "/health": {"get": {"summary": "200 when ready; 503 while loading or after the engine stopped",
                                "responses": {"200": {"description": "Ready"},
                                              "503": {"description": "Not ready"}}}},
            "/metrics": _get("Prometheus metrics", {"type": "string"}, "text/plain"),
            "/version": _get("The jserve version", _obj(["version"], version=_STR)),
            **lora,
        },
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
