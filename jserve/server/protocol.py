"""OpenAI request bodies: one JSON-schema table per route that both validates requests and feeds /openapi.json.

Validation checks JSON types (and the static ranges the schema states); SamplingParams then checks the rest.
Every failure is an APIError naming the parameter, so a bad request is a 400 and never reaches the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from jserve.pooling_params import PoolingParams
from jserve.sampling_params import (
    MAX_CACHE_SALT_LEN,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    InvalidParameterError,
    SamplingParams,
)
from jserve.tokenizer import normalize_messages

# The most samples one request may ask for; each is a full sequence in the batch.
MAX_N = 128
# Python's own int() refuses longer literals; JSON numbers beyond this are rejected as invalid JSON anyway.
INT64 = 2**63
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


class APIError(Exception):
    """An error that becomes OpenAI's body {"error": {message, type, param, code}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "internal_error", 503: "service_unavailable", 504: "timeout_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


# ----- JSON parsing -----

def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def parse_json(raw: bytes) -> dict:
    """Decode a request body that must be a JSON object (strict UTF-8, no NaN/Infinity)."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # NaN, int literals over Python's digit limit, deep nesting
        raise bad_request(f"request body is not valid JSON: {str(e)[:200] or type(e).__name__}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {_json_type(body)}")
    return body


# ----- a small JSON-schema checker (the subset the tables below use) -----

_TYPES = {"null": lambda v: v is None, "boolean": lambda v: isinstance(v, bool),
          # JSON Schema counts 2.0 as an integer (and so do OpenAI's and vLLM's parsers); check_fields turns it into 2
          "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
          or (isinstance(v, float) and v.is_integer()),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "string": lambda v: isinstance(v, str), "array": lambda v: isinstance(v, list),
          "object": lambda v: isinstance(v, dict)}


def _json_type(value: Any) -> str:
    return next((name for name, ok in _TYPES.items() if name not in ("integer",) and ok(value)), "unknown")


def _describe(schema: dict, plural: bool = False) -> str:
    """'an array of strings', or with plural what an array holds: 'strings', 'arrays of integers'."""
    if "anyOf" in schema:
        return " or ".join(_describe(s, plural) for s in schema["anyOf"])
    kind = schema.get("type", "value")
    if kind == "array" and "items" in schema:
        return f"{'arrays' if plural else 'an array'} of {_describe(schema['items'], plural=True)}"
    if plural:
        return "nulls" if kind == "null" else f"{kind}s"
    return {"integer": "an integer", "array": "an array", "object": "an object", "null": "null"}.get(kind, f"a {kind}")


def schema_errors(value: Any, schema: dict, where: str) -> str | None:
    """The first way `value` breaks `schema`, as a message about `where`, or None when it conforms."""
    if "anyOf" in schema:
        errors = [schema_errors(value, option, where) for option in schema["anyOf"]]
        if all(errors):
            shape_ok = [e for e, opt in zip(errors, schema["anyOf"], strict=True) if _TYPES[opt["type"]](value)]
            return shape_ok[0] if len(shape_ok) == 1 else f"{where} must be {_describe(schema)}"
        return None
    kind = schema["type"]
    if not _TYPES[kind](value):
        return f"{where} must be {_describe(schema)}, got {_json_type(value)}"
    if kind in ("integer", "number"):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{where} must be at least {schema['minimum']}, got {value}"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return f"{where} must be greater than {schema['exclusiveMinimum']}, got {value}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{where} must be at most {schema['maximum']}, got {value}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {', '.join(map(repr, schema['enum']))}, got {str(value)[:64]!r}"
    if kind == "string" and len(value) < schema.get("minLength", 0):
        return f"{where} must not be empty"
    if kind == "string" and len(value) > schema.get("maxLength", math.inf):
        return f"{where} must be at most {schema['maxLength']} characters, got {len(value)}"
    if kind == "array":
        if len(value) < schema.get("minItems", 0):
            return f"{where} must have at least {schema['minItems']} item(s)"
        if len(value) > schema.get("maxItems", math.inf):
            return f"{where} must have at most {schema['maxItems']} items, got {len(value)}"
        for i, item in enumerate(value):
            if (error := schema_errors(item, schema["items"], f"{where}[{i}]")) is not None:
                return error
    if kind == "object":
        for key, sub in schema.get("properties", {}).items():
            # null is taken as omitted, as at the top level (the route's own checks decide what omitting means)
            if value.get(key) is not None and (error := schema_errors(value[key], sub, f"{where}.{key}")) is not None:
                return error
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                if key not in schema.get("properties", {}) and \
                        (error := schema_errors(item, extra, f"{where}[{key!r}]")) is not None:
                    return error
    return None


def _nullable(schema: dict, description: str, **extra: Any) -> dict:
    options = schema["anyOf"] if "anyOf" in schema else [schema]
    return {"anyOf": [*options, {"type": "null"}], "description": description, **extra}


def _int(description: str, **bounds: int) -> dict:
    return _nullable({"type": "integer", "minimum": -INT64, "maximum": INT64 - 1, **bounds}, description)


def _num(description: str, **bounds: float) -> dict:
    return _nullable({"type": "number", **bounds}, description)


def _bool(description: str) -> dict:
    return _nullable({"type": "boolean"}, description)


# Stop matching keeps every prefix of every stop string, so their size is bounded (quadratic in the length).
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 64, 512
_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT64 - 1}, "minItems": 1}

SAMPLING_FIELDS: dict[str, dict] = {
    "model": _nullable({"type": "string"}, "The served model name (GET /v1/models); omitted means that model."),
    "n": _int("How many completions to generate for each prompt.", minimum=1, maximum=MAX_N),
    "temperature": _num("Sampling temperature; 0 is greedy.", minimum=0, maximum=MAX_TEMPERATURE),
    "top_p": _num("Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.",
                  exclusiveMinimum=0, maximum=1),
    "stop": _nullable({"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOP_STRINGS}]},
                      "Strings that end the completion; they are cut from the text."),
    "seed": _int("Makes sampling reproducible whatever else shares the batch."),
    "presence_penalty": _num("Penalty for tokens already present in the output.", minimum=-2, maximum=2),
    "frequency_penalty": _num("Penalty scaled by how often a token already occurs in the output.",
                              minimum=-2, maximum=2),
    "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,18}$"},
                             "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                            "Map of token id (as a string) to a bias in [-100, 100] added to its logit."),
    "stream": _bool("Send the output as Server-Sent Events while it is generated."),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _bool(
        "Send a last chunk with the usage and empty choices.")}}, "Options for streaming."),
    "user": _nullable({"type": "string"}, "An end-user id; accepted and ignored."),
    "top_k": _int("Keep only the k most likely tokens; 0 or -1 disables it.", minimum=-1),
    "min_p": _num("Drop tokens whose probability is below min_p times the most likely one's.", minimum=0, maximum=1),
    "repetition_penalty": _num("Penalty (>1) or bonus (<1) for tokens in the prompt or output.",
                               exclusiveMinimum=0, maximum=100),
    "min_tokens": _int("Generate at least this many tokens before EOS or stop tokens may end the output.",
                       minimum=0),
    "ignore_eos": _bool("Keep generating past the end-of-sequence token."),
    "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                            "maximum": INT64 - 1}, "maxItems": 1024},
                                "Token ids that end the completion."),
    "skip_special_tokens": _bool("Leave special tokens out of the text (default true)."),
    "spaces_between_special_tokens": _bool("With skip_special_tokens false: false renders an added token after "
                                           "another as its bare content (vLLM's; default true)."),
    "include_stop_str_in_output": _bool("Keep the matched stop string at the end of the text."),
    "priority": _int("Scheduling priority: lower values are served first (default 0)."),
    # vLLM's, refused rather than ignored: their answers would silently differ from what the client asked for
    "use_beam_search": _bool("Not supported: only false is accepted."),
    "return_tokens_as_token_ids": _bool("Not supported: only false is accepted."),
    "allowed_token_ids": _nullable(_TOKEN_IDS, "Only these token ids may be generated."),
    "bad_words": _nullable({"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH},
                            "maxItems": MAX_STOP_STRINGS},
                           "Words never generated: a word's last token is forbidden wherever the output ends in the "
                           "tokens before it (vLLM's rule)."),
    "truncate_prompt_tokens": _int("Keep only the prompt's last k tokens; -1: as many as the context holds.",
                                   minimum=-1),
    "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_LEN},
                            "Prefix-cache isolation: only requests with the same salt share cached prompt blocks."),
    "structured_outputs": _nullable(
        {"type": "object", "properties": {
            "json": {"anyOf": [{"type": "object"}, {"type": "string", "minLength": 1}]},
            "json_object": {"type": "boolean"},
            "regex": {"type": "string", "minLength": 1},
            "choice": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            "grammar": {"type": "string", "minLength": 1}}},
        "Constrain the output (vLLM's field): exactly one of json (a JSON schema), json_object (true), regex, "
        "choice (a list of strings) or grammar (Lark or EBNF)."),
    # vLLM's older names of the same constraints (before structured_outputs), which clients still send
    "guided_json": _nullable({"anyOf": [{"type": "object"}, {"type": "string", "minLength": 1}]},
                             "structured_outputs.json under vLLM's older name."),
    "guided_regex": _nullable({"type": "string", "minLength": 1}, "structured_outputs.regex under vLLM's older name."),
    "guided_choice": _nullable({"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                               "structured_outputs.choice under vLLM's older name."),
    "guided_grammar": _nullable({"type": "string", "minLength": 1},
                                "structured_outputs.grammar under vLLM's older name."),
    "response_format": _nullable(
        {"type": "object", "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "schema": {"type": "object"}, "strict": _bool("Accepted; the schema is always enforced.")}}}},
        "OpenAI's output format: {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
        "\"json_schema\": {\"name\", \"schema\", \"strict\"}}."),
}

COMPLETION_FIELDS: dict[str, dict] = {
    "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
                         _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1}],
               "description": "A string, a list of strings, a list of token ids, or a list of token-id lists."},
    "max_tokens": _int(f"The most tokens to generate (default {COMPLETION_DEFAULT_MAX_TOKENS}); 0 with echo: none, "
                       "the prompt scored alone.", minimum=0),
    "logprobs": _int("Return the log probabilities of this many most likely tokens at each position.",
                     minimum=0, maximum=MAX_LOGPROBS),
    "echo": _bool("Return the prompt before the completion (with logprobs: the prompt tokens' too, the first null)."),
    "suffix": _nullable({"type": "string"}, "Not supported: only null or an empty string is accepted."),
    "best_of": _int("Only null or n is accepted (every sample is returned).", minimum=1),
    **SAMPLING_FIELDS,
}

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
# `required` inside a message is documentation: normalize_messages checks it, and also accepts an assistant turn
# whose content is null because it only carries tool_calls.
_MESSAGE = {"type": "object", "properties": {
    "role": {"type": "string", "minLength": 1, "description": "system, user, assistant, ... (as the chat template "
                                                               "takes them)"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}],
                "description": "A string, or a list of text parts joined with newlines."}},
    "required": ["role", "content"],
    "description": "An OpenAI chat message: role plus content (a string or a list of text parts)."}

CHAT_FIELDS: dict[str, dict] = {
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "description": "The conversation so far."},
    "max_tokens": _int("Deprecated alias of max_completion_tokens.", minimum=1),
    "max_completion_tokens": _int("The most tokens to generate (default: what the context has left).",
                                  minimum=1),
    "logprobs": _bool("Return the log probability of each output token."),
    "top_logprobs": _int("With logprobs, also return this many most likely tokens at each position.",
                         minimum=0, maximum=MAX_LOGPROBS),
    "add_generation_prompt": _bool("End the rendered prompt with the assistant turn's header (default true)."),
    "continue_final_message": _bool("Render the last message open, so the model continues it (then "
                                    "add_generation_prompt must be false; default false)."),
    "chat_template_kwargs": _nullable({"type": "object"}, "Further variables of the chat template, e.g. "
                                                          "{\"enable_thinking\": false} for Qwen3."),
    "tools": _nullable({"type": "array", "items": {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                                                      "parameters": {"type": "object"}}}}}},
        "Functions the model may call (OpenAI's shape); see tool_choice."),
    "tool_choice": _nullable({"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                        {"type": "object"}]},
                             'Whether and which tool to call: "none", "auto" (needs --tool-call-parser), "required", '
                             'or {"type": "function", "function": {"name": ...}}.'),
    "parallel_tool_calls": _bool("With tool_choice \"required\": allow several calls (default true)."),
    "reasoning_effort": _nullable({"type": "string", "enum": ["low", "medium", "high"]},
                                  "How much a reasoning model should think (vLLM's field): the chat template's "
                                  "reasoning_effort variable, which gpt-oss's template renders; chat_template_kwargs "
                                  "may set it too."),
    "include_reasoning": _bool("With the server's --reasoning-parser: return the reasoning as "
                               "message.reasoning_content (default true)."),
    **SAMPLING_FIELDS,
}

TOKENIZE_FIELDS: dict[str, dict] = {
    "model": SAMPLING_FIELDS["model"],
    "prompt": _nullable({"type": "string"}, "Text to tokenize (or give messages)."),
    "messages": _nullable(CHAT_FIELDS["messages"], "Chat messages to render with the chat template and tokenize."),
    "add_special_tokens": _bool("Add the tokenizer's special tokens to a prompt (default true)."),
    "add_generation_prompt": CHAT_FIELDS["add_generation_prompt"],
    "continue_final_message": CHAT_FIELDS["continue_final_message"],
    "chat_template_kwargs": CHAT_FIELDS["chat_template_kwargs"],
    "reasoning_effort": CHAT_FIELDS["reasoning_effort"],
}

DETOKENIZE_FIELDS: dict[str, dict] = {
    "model": SAMPLING_FIELDS["model"],
    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT64 - 1},
               "description": "Token ids to turn back into text."},
}

EMBEDDING_FIELDS: dict[str, dict] = {
    "model": SAMPLING_FIELDS["model"],
    "input": {**COMPLETION_FIELDS["prompt"], "description": "A string, a list of strings, a list of token ids, or a "
              "list of token-id lists: one embedding each."},
    "encoding_format": _nullable({"type": "string", "enum": ["float", "base64"]}, "float (default): a list of "
                                 "numbers; base64: the float32 values' little-endian bytes in base64."),
    "dimensions": _int("Keep the first this many values (a Matryoshka model's shorter embedding), normalized.",
                       minimum=1),
    "user": _nullable({"type": "string"}, "Accepted and not used."),
    "normalize": _bool("Scale each embedding to unit length (default true)."),
    "truncate_prompt_tokens": _int("Keep only each input's last this many tokens.", minimum=1),
    "priority": SAMPLING_FIELDS["priority"],
}

_NAME = {"type": "string", "minLength": 1, "maxLength": 256}
LOAD_LORA_FIELDS: dict[str, dict] = {
    "lora_name": {**_NAME, "description": "The name requests give as `model` to run with the adapter."},
    "lora_path": {"type": "string", "minLength": 1, "description": "The adapter's PEFT directory on the server."},
    "base_model_name": {**_NAME, "description": "The served model it adapts (default: the first)."},
}
UNLOAD_LORA_FIELDS: dict[str, dict] = {"lora_name": LOAD_LORA_FIELDS["lora_name"]}

REQUIRED = {"completion": ["prompt"], "chat": ["messages"], "embedding": ["input"], "tokenize": [],
            "detokenize": ["tokens"], "load_lora": ["lora_name", "lora_path"], "unload_lora": ["lora_name"]}


def check_fields(body: dict, fields: dict[str, dict], required: list[str]) -> dict[str, Any]:
    """The known, non-null fields of `body`, each checked against its schema; unknown fields are ignored."""
    for name in required:
        if body.get(name) is None:
            raise bad_request(f"'{name}' is a required field", name)
    values = {}
    for name, schema in fields.items():
        if body.get(name) is None:
            continue
        if (error := schema_errors(body[name], schema, name)) is not None:
            raise bad_request(error, name)
        values[name] = _integers(body[name], schema)
    return values


def _integers(value: Any, schema: dict) -> Any:
    """`value`, valid against `schema`, with each integral float the schema says is an integer made an int."""
    if "anyOf" in schema:
        return _integers(value, next(o for o in schema["anyOf"] if schema_errors(value, o, "") is None))
    kind = schema["type"]
    if kind == "integer" and isinstance(value, float):
        return int(value)
    if kind == "array":
        return [_integers(item, schema["items"]) for item in value]
    if kind == "object":
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return {key: _integers(item, props[key]) if key in props and item is not None
                else _integers(item, extra) if key not in props and isinstance(extra, dict) else item
                for key, item in value.items()}
    return value


# ----- typed requests -----

@dataclass
class GenerationRequest:
    """What the completion and chat routes share once the body is checked."""

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    given: frozenset[str]  # the body's non-null fields: the model's defaults fill the rest


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]]
    echo: bool = False
    echo_only: bool = False  # max_tokens 0: the prompt alone (one token is generated and left out)
    echo_texts: list[str] = field(default_factory=list)  # each prompt's text, set once tokenized


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict]
    add_generation_prompt: bool
    template_kwargs: dict = field(default_factory=dict)  # continue_final_message and chat_template_kwargs
    tools: Any = None  # server.tools.ToolRequest, set by the route once it knows the server's tool-call parser
    include_reasoning: bool = True  # with a reasoning parser, whether the reasoning is sent
    reasoning_parser: str | None = None  # the server's (server/reasoning.py), set by the route


_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "cache_salt",
                "allowed_token_ids", "bad_words", "truncate_prompt_tokens")


def _sampling_params(values: dict[str, Any], *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    kwargs = {name: values[name] for name in _PARAM_NAMES if name in values}
    if "logit_bias" in values:
        kwargs["logit_bias"] = _logit_bias(values["logit_bias"])
    constraint = _structured_outputs(values)
    if constraint is not None:
        kwargs["structured_outputs"] = constraint
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
    except InvalidParameterError as e:
        raise bad_request(str(e), e.param) from None


def _structured_outputs(values: dict[str, Any]) -> dict | None:
    """The request's constraint as StructuredOutputsParams fields, from `structured_outputs` or `response_format`."""
    fmt = values.get("response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                              f"got {kind!r}"[:300], "response_format")
        if ("structured_outputs" in values or any(k in values for k in _GUIDED)) and kind != "text":
            raise bad_request("give either response_format or structured_outputs, not both", "response_format")
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                                  "response_format")
            return {"json": schema}
    guided = {field: values[name] for name, field in _GUIDED.items() if name in values}
    if guided:
        if "structured_outputs" in values or len(guided) > 1:
            raise bad_request(f"give one constraint: {', '.join(sorted(k for k in _GUIDED if k in values))} and "
                              f"structured_outputs are the same field under several names", next(
                                  k for k in _GUIDED if k in values))
        return guided
    return values.get("structured_outputs")


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        # Decimal ASCII digits only: int() would also take " 5", "+5", "1_0" and other scripts' digits.
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            raise bad_request(f"logit_bias keys must be token ids (decimal digits), got {key[:64]!r}", "logit_bias")
        out[int(key)] = value
    return out


def _common(values: dict[str, Any]) -> dict[str, Any]:
    for name, why in (("use_beam_search", "beam search is not served; sample with n instead"),
                      ("return_tokens_as_token_ids", "logprobs name their tokens by text")):
        if values.get(name):
            raise bad_request(f"{name} is not supported: {why}", name)
    options = values.get("stream_options") or {}
    stream = bool(values.get("stream", False))
    if options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return dict(model=values.get("model"), stream=stream, include_usage=bool(options.get("include_usage")),
                priority=values.get("priority", 0), given=frozenset(k for k, v in values.items() if v is not None))


def parse_completion(body: dict) -> CompletionRequest:
    values = check_fields(body, COMPLETION_FIELDS, REQUIRED["completion"])
    echo = bool(values.get("echo"))
    if values.get("max_tokens") == 0 and not echo:
        raise bad_request("max_tokens 0 needs echo: true (the prompt scored alone)", "max_tokens")
    if values.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    if values.get("best_of") not in (None, values.get("n", 1)):
        raise bad_request("best_of must equal n: every sample is returned", "best_of")
    prompt = values["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    max_tokens = values.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    params = _sampling_params(values, max_tokens=max_tokens or 1, logprobs=values.get("logprobs"))
    if echo and params.logprobs is not None:  # the prompt's tokens are scored too (lm-eval-harness' loglikelihood)
        params = params.clone(prompt_logprobs=params.logprobs)
    return CompletionRequest(params=params, prompts=prompts, echo=echo, echo_only=max_tokens == 0,
                             **_common(values))


@dataclass
class EmbeddingRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: PoolingParams
    encoding_format: str
    priority: int


def parse_embedding(body: dict) -> EmbeddingRequest:
    values = check_fields(body, EMBEDDING_FIELDS, REQUIRED["embedding"])
    given = values["input"]
    prompts = [given] if isinstance(given, str) or isinstance(given[0], int) else list(given)
    params = PoolingParams(normalize=values.get("normalize", True), dimensions=values.get("dimensions"),
                           truncate_prompt_tokens=values.get("truncate_prompt_tokens"))
    return EmbeddingRequest(values.get("model"), prompts, params, values.get("encoding_format", "float"),
                            values.get("priority", 0))


def parse_chat(body: dict) -> ChatRequest:
    values = check_fields(body, CHAT_FIELDS, REQUIRED["chat"])
    try:
        messages = normalize_messages(values["messages"])
    except InvalidParameterError as e:
        raise bad_request(str(e), e.param) from None
    # Accepted and ignored, these would silently break their promise (JSON output, tool calls), as vLLM's refusal
    # without a tool parser or a guided-decoding backend makes clear.
    if "top_logprobs" in values and not values.get("logprobs"):
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = values.get("top_logprobs", 0) if values.get("logprobs") else None
    max_tokens = values.get("max_completion_tokens", values.get("max_tokens"))
    params = _sampling_params(values, max_tokens=max_tokens, logprobs=logprobs)
    return ChatRequest(params=params, messages=messages,
                       add_generation_prompt=values.get("add_generation_prompt", True),
                       template_kwargs=chat_template_kwargs(values),
                       include_reasoning=values.get("include_reasoning", True), **_common(values))


def chat_template_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """The chat template's further arguments a chat or /tokenize body sets: continue_final_message (which, as in
    vLLM and transformers, excludes add_generation_prompt), reasoning_effort (where chat_template_kwargs leaves it
    unset) and chat_template_kwargs."""
    kwargs = dict(values.get("chat_template_kwargs") or {})
    if values.get("reasoning_effort") is not None:
        kwargs.setdefault("reasoning_effort", values["reasoning_effort"])
    if values.get("continue_final_message"):
        if values.get("add_generation_prompt", True):
            raise bad_request("continue_final_message needs add_generation_prompt set to false: the prompt cannot "
                              "both continue the last message and open a new one", "continue_final_message")
        kwargs["continue_final_message"] = True
    return kwargs


def request_schema(fields: dict[str, dict], required: list[str]) -> dict:
    """The JSON schema of a request body (for /openapi.json)."""
    return {"type": "object", "properties": fields, "required": required, "additionalProperties": True}
