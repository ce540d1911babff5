"""OpenAI tool calling on chat completions: the request's `tools` and `tool_choice`, the constraint that makes a
required or named call valid JSON for its function's schema, and the parsers that find calls in a model's own format
when the model chooses (`tool_choice: "auto"`, with `--tool-call-parser`).

- `required`: the output is a JSON array of `{"name", "arguments"}` objects, each name one of the tools and its
  arguments valid against that tool's `parameters` (one item without `parallel_tool_calls`).
- a named function: the output is that function's arguments, valid against its schema.
- `auto`: the output is free; the parser reads calls out of it (`hermes`: `<tool_call>{"name", "arguments"}
  </tool_call>` blocks, as Hermes and Qwen chat templates ask for; `llama3_json`: a JSON object `{"name",
  "parameters"}` (or several separated by `;`), optionally after `<|python_tag|>`, as Llama 3.1's template asks for;
  `openai`: gpt-oss's harmony messages to `functions.NAME`, which the `openai_gptoss` reasoning parser reads out of
  the output, server/reasoning.py; `deepseek_v3`: DeepSeek-V3's and R1's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>
  NAME` lines, each followed by its arguments in a json code fence and `<｜tool▁call▁end｜>`, inside
  `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`; `deepseek_v31`: DeepSeek-V3.1's `<｜tool▁call▁begin｜>NAME
  <｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>` there; `mistral`: Mistral's `[TOOL_CALLS]` followed by a JSON list of
  `{"name", "arguments"}` or, from tokenizer v11 on, by `NAME[ARGS]{...}`, once a call; `pythonic`: a whole output
  that is a Python list of calls with literal keyword arguments, as Llama 3.2 and Llama 4 write them, Llama 4's
  between `<|python_start|>` and `<|python_end|>`). DeepSeek's, Mistral's and Llama 4's markers are added tokens of
  their tokenizers: requests under those parsers keep special tokens in their text, and the parser takes the markers
  out.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from jserve.server.protocol import bad_request
from jserve.server.reasoning import split_reasoning

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_DEEPSEEK_CALLS = "<｜tool▁calls▁begin｜>"
_DEEPSEEK_CALL = {  # one call within the calls block
    "deepseek_v3": re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(?P<name>[^\n]*)\n"
                              r"```json\n(?P<arguments>.*?)\n```<｜tool▁call▁end｜>", re.DOTALL),
    "deepseek_v31": re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<arguments>.*?)<｜tool▁call▁end｜>",
                               re.DOTALL),
}
_MISTRAL_CALLS = "[TOOL_CALLS]"
# Mistral's newer calls (tokenizer v11 on: Mistral Small 3.2, Devstral, Magistral): NAME, an optional call id, then
# [ARGS] and the arguments' JSON, one call after each [TOOL_CALLS]
_MISTRAL_CALL = re.compile(r"\s*(?P<name>[A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\](?P<arguments>.*)",
                           re.DOTALL)
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
# parsers whose markers are special tokens, kept in the text for them (routes.create_chat_completion)
READS_SPECIAL_TOKENS = ("openai", *_DEEPSEEK_CALL, "mistral", "pythonic")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolRequest:
    tools: list[dict]  # the request's tools, as sent ({"type": "function", "function": {...}})
    choice: str  # "auto" | "required" | a function's name
    parallel: bool
    parser: str | None  # the server's --tool-call-parser (what "auto" reads calls with)

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def constraint(self) -> dict | None:
        """structured_outputs for the choice (None for auto: the model writes freely)."""
        if self.choice == "auto":
            return None
        if self.choice != "required":
            return {"json": _parameters(self.functions[self.choice])}
        items = {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                               "arguments": _parameters(fn)},
                            "required": ["name", "arguments"], "additionalProperties": False}
                           for name, fn in self.functions.items()]}
        return {"json": {"type": "array", "items": items, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}}

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the message content left, the calls) of a finished output. Output that a stop string or stop token
        ended before the constraint did is no complete call: it stays as content, as OpenAI never returns a call
        whose arguments do not parse."""
        if self.choice == "auto":
            if self.parser == "hermes":
                return _parse_hermes(text, self.functions)
            if self.parser == "openai":  # text: the harmony messages, markers and all
                return _parse_harmony(text, self.functions)
            if self.parser in _DEEPSEEK_CALL:
                return _parse_deepseek(text, self.functions, _DEEPSEEK_CALL[self.parser])
            if self.parser == "mistral":
                return _parse_mistral(text, self.functions)
            if self.parser == "pythonic":
                return _parse_pythonic(text, self.functions)
            return _parse_llama3_json(text, self.functions)
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if self.choice != "required":
            return (None, [ToolCall(self.choice, text)]) if isinstance(value, dict) else (text, [])
        calls = [_call(item, self.functions, "arguments") for item in value] if isinstance(value, list) else []
        if not calls or None in calls:
            return text, []
        return None, calls


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def parse_tool_request(body: dict, parser: str | None) -> ToolRequest | None:
    """The request's tools, checked (400s naming the field); None when it has none or tool_choice is "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        raise bad_request('tools must be a list of {"type": "function", "function": {"name", "description", '
                          '"parameters"}} with names of letters, digits, _ and - (at most 64)', "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            raise bad_request(f"tool_choice names a function that is not among the tools: {name!r}"[:300],
                              "tool_choice")
        choice = name
    elif choice not in ("auto", "required"):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if choice == "auto" and parser is None:
        raise bad_request('tool_choice "auto" needs the server started with --tool-call-parser (hermes, '
                          'llama3_json, openai, deepseek_v3, deepseek_v31, mistral or pythonic); "required" and a '
                          "named function work without one", "tool_choice")
    if choice != "auto" and parser == "openai":
        raise bad_request('gpt-oss (--tool-call-parser openai) serves tool_choice "auto" only: a required or named '
                          "call would constrain the output to JSON outside its harmony messages", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # null is the default, as for the other nullable fields
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    return ToolRequest(tools, choice, parallel, parser)


def _is_function_tool(tool: Any) -> bool:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(_NAME.match(fn["name"])) and \
        isinstance(fn.get("parameters", {}), dict)


def _call(obj: Any, functions: dict[str, dict], arguments_key: str) -> ToolCall | None:
    """The call a parsed object names, or None where it is none: an unknown name, or arguments that are not a JSON
    object (an object, or JSON text of one, as OpenAI's arguments always are)."""
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(obj["name"], arguments) if isinstance(parsed, dict) else None
    return ToolCall(obj["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


# Where each parser's calls begin (llama3_json's are the whole output: ToolStream)
_CALL_MARKERS = {"hermes": "<tool_call>", "deepseek_v3": _DEEPSEEK_CALLS, "deepseek_v31": _DEEPSEEK_CALLS,
                 "mistral": _MISTRAL_CALLS}
_PYTHON_TAG = "<|python_tag|>"
# parsers whose calls are the whole output, held back while the output may still be one: where it may start
_WHOLE_OUTPUT_STARTS = {"llama3_json": ("{", _PYTHON_TAG), "pythonic": ("[", _PYTHON_START)}
STREAMED_PARSERS = (*_CALL_MARKERS, *_WHOLE_OUTPUT_STARTS)


class ToolStream:
    """An auto tool choice's content streamed as it comes (STREAMED_PARSERS), holding back what may be a call: the
    text from the parser's call marker on, an end of the text that may still become the marker, and trailing
    whitespace (content before a call keeps none); for llama3_json, an output that starts as a call would (after
    whitespace, `{` or `<|python_tag|>`). At the end the whole text is read (ToolRequest.calls): its calls, or the
    rest of the text as content. What was sent is then the content a non-streamed reply gives: the text before the
    first call, without its trailing whitespace."""

    def __init__(self, parser: str):
        self.marker = _CALL_MARKERS.get(parser)
        self.starts = _WHOLE_OUTPUT_STARTS.get(parser, ())
        self.text, self.sent = "", 0

    def feed(self, piece: str) -> str:
        """Add the next piece of content; returns what can be sent now."""
        self.text += piece
        end = max(self.sent, self._safe_end())
        out, self.sent = self.text[self.sent:end], end
        return out

    def rest(self) -> str:
        """The text held back (at the end, where it holds no call)."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _safe_end(self) -> int:
        if self.marker is None:  # llama3_json, pythonic: all or nothing
            body = self.text.lstrip()
            maybe_call = not body or body.startswith(self.starts) or any(s.startswith(body) for s in self.starts)
            return self.sent if maybe_call else len(self.text)
        pos = self.text.find(self.marker)
        if pos < 0:
            pos = len(self.text)
            for k in range(min(len(self.marker) - 1, len(self.text)), 0, -1):
                if self.marker.startswith(self.text[-k:]):
                    pos -= k
                    break
        return len(self.text[:pos].rstrip())


def _parse_hermes(text: str, functions: dict[str, dict]) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = _call(json.loads(block), functions, "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []  # a malformed block: the text is returned as it is
        calls.append(call)
    if not calls:
        return text, []
    return text[:text.index("<tool_call>")].rstrip() or None, calls


def _parse_deepseek(text: str, functions: dict[str, dict], call: re.Pattern) -> tuple[str | None, list[ToolCall]]:
    """The calls of DeepSeek's calls block and the text before it as content (ToolStream's); a block that holds no
    call, or a call that is no call (an unknown name, arguments that are not a JSON object), leaves the whole text as
    content."""
    start = text.find(_DEEPSEEK_CALLS)
    if start < 0:
        return text, []
    calls = [_call({"name": m["name"].strip(), "arguments": m["arguments"]}, functions, "arguments")
             for m in call.finditer(text, start)]
    if not calls or None in calls:
        return text, []
    return text[:start].rstrip() or None, calls


def _parse_harmony(text: str, functions: dict[str, dict]) -> tuple[str | None, list[ToolCall]]:
    split = split_reasoning(text, "openai_gptoss")
    calls = [ToolCall(name, arguments) for name, arguments in split.calls if name in functions]
    return split.content or None, calls


def _parse_mistral(text: str, functions: dict[str, dict]) -> tuple[str | None, list[ToolCall]]:
    """Mistral's calls after the text's content: `[TOOL_CALLS][{"name", "arguments"}, ...]` (tokenizers up to v7),
    or `[TOOL_CALLS]NAME[ARGS]{...}` once a call (v11 on). Anything else after the marker leaves the text as it is."""
    start = text.find(_MISTRAL_CALLS)
    if start < 0:
        return text, []
    parts = text[start:].split(_MISTRAL_CALLS)[1:]
    calls: list[ToolCall | None] = []
    if len(parts) == 1 and parts[0].lstrip().startswith("["):
        try:
            items = json.loads(parts[0])
        except ValueError:
            return text, []
        calls = [_call(item, functions, "arguments") for item in items] if isinstance(items, list) else []
    else:
        for part in parts:
            m = _MISTRAL_CALL.fullmatch(part)
            calls.append(None if m is None else _call({"name": m["name"], "arguments": m["arguments"].strip()},
                                                      functions, "arguments"))
    if not calls or None in calls:
        return text, []
    return text[:start].rstrip() or None, calls


def _parse_pythonic(text: str, functions: dict[str, dict]) -> tuple[str | None, list[ToolCall]]:
    """A whole output that is a Python list of calls with literal keyword arguments (Llama 3.2's and Llama 4's
    `[get_weather(city="Paris"), add(a=1, b=2)]`, Llama 4 between <|python_start|> and <|python_end|>); read with
    ast, nothing evaluated but literals."""
    body = text.strip().removeprefix(_PYTHON_START).removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg is not None for k in node.keywords)):
                return text, []
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(_call({"name": node.func.id, "arguments": arguments}, functions, "arguments"))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []
    if None in calls:
        return text, []
    return None, calls


def _parse_llama3_json(text: str, functions: dict[str, dict]) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):  # objects one after another, separated by ";" (and whitespace)
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(obj, functions, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        while pos < len(body) and body[pos] in "; \t\n":
            pos += 1
    return None, calls
