"""OpenAI's Responses API (POST /v1/responses) as a view of chat completions: the request becomes a chat request (its
input items messages, its function tools the chat's tools), and the chat's message, or its stream of chunks, becomes
a response's output items (reasoning, message, function calls), or its stream of typed events.

jserve keeps no responses: `previous_response_id`, `conversation` and background runs are refused, and a client
sends the whole conversation as input (function_call and function_call_output items included), as with `store:
false`. Only function tools exist; built-in tools (web search, file search, code interpreter) are refused.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from jserve.server.protocol import bad_request

# Chat fields a Responses body carries under the same name.
_SAME_FIELDS = ("model", "temperature", "top_p", "user", "parallel_tool_calls", "priority", "seed", "top_k", "min_p",
                "repetition_penalty", "stop")
_REFUSED = {"previous_response_id": "jserve keeps no responses: send the whole conversation as input",
            "conversation": "jserve keeps no conversations: send the whole conversation as input",
            "background": "background responses are not supported", "prompt": "stored prompts are not supported"}
_ROLES = ("user", "system", "developer", "assistant")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_body(body: dict) -> dict:
    """The chat completions body a Responses body stands for; 400 for what jserve does not serve."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise bad_request(f"{name} is not supported: {why}", name)
    if body.get("input") is None:
        raise bad_request("'input' is a required field", "input")
    chat: dict[str, Any] = {name: body[name] for name in _SAME_FIELDS if body.get(name) is not None}
    chat["messages"] = _messages(body["input"], body.get("instructions"))
    chat["stream"] = bool(body.get("stream", False))
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(_list(body["tools"], "tools"))]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                              "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                          '"json_schema", "name", "schema"}', "text")
    return chat


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list", name)
    return value


def _chat_tool(tool: Any, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise bad_request(f"tools[{index}]: only function tools are served, not {kind!r}", "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _text(content: Any, where: str) -> str:
    """A message's content (a string, or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    parts = []
    for part in _list(content, where):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}: only text content is served, not {kind or type(part).__name__!r}", "input")
        parts.append(part["text"])
    return "".join(parts)


def _messages(given: Any, instructions: Any) -> list[dict]:
    """The input items (or a string: one user message) as chat messages, after `instructions` as a system one."""
    messages = [] if instructions is None else [{"role": "system", "content": _text(instructions, "instructions")}]
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    for i, item in enumerate(_list(given, "input")):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            messages.append({"role": item["role"], "content": _text(item.get("content", ""), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant" and previous.get("tool_calls"):
                previous["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            continue  # earlier turns' reasoning is not shown to the model again (as chat templates drop it)
        else:
            raise bad_request(f"{where}: an input item must be a message (role user, system, developer or "
                              f"assistant), a function_call or a function_call_output, not {kind!r}", "input")
    return messages


def _base(body: dict, response_id: str, created: int, model: str) -> dict:
    """The response object's fields that do not depend on the output (status in_progress)."""
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    return {"id": response_id, "object": "response", "created_at": created, "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "model": model, "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": {"effort": reasoning.get("effort"), "summary": None},
            "store": False, "temperature": body.get("temperature"), "text": body.get("text") or {
                "format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled",
            "user": body.get("user"), "usage": None}


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _finish(response: dict, finish_reason: str | None, output: list[dict], usage: dict | None) -> dict:
    cut = finish_reason == "length"
    return {**response, "status": "incomplete" if cut else "completed", "output": output, "usage": _usage(usage),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    function = call["function"]
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"] if arguments is None else arguments, "status": status}


def response_of(completion: dict, body: dict) -> dict:
    """A chat completion (one choice) as the response object."""
    choice = completion["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(_new_id("msg"), message["content"]))
    output += [_call_item(call) for call in message.get("tool_calls") or []]
    response = _base(body, completion["id"], completion["created"], completion["model"])
    return _finish(response, choice["finish_reason"], output, completion.get("usage"))


class _EventWriter:
    """Numbers and encodes a stream's events (`event: TYPE` and its JSON, as OpenAI sends them)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


async def response_events(chunks: AsyncIterator[dict], body: dict) -> AsyncIterator[bytes]:
    """A chat completion's stream of chunks (one choice, usage last) as the Responses API's events: the response
    created, each output item added, its text as deltas (function calls' arguments whole), done, then the
    response completed (or incomplete)."""
    event, response, output = _EventWriter(), None, []
    open_item: dict | None = None  # the reasoning or message item being streamed
    finish_reason = None

    def close() -> list[bytes]:
        nonlocal open_item
        if open_item is None:
            return []
        item, index, text = open_item["item"], len(output), open_item["text"]
        open_item = None
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text)
            events = [event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text)]
        else:
            done = _message_item(item["id"], text)
            part = done["content"][0]
            events = [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[]),
                      event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part)]
        output.append(done)
        return [*events, event("response.output_item.done", output_index=index, item=done)]

    def text(kind: str, delta: str) -> list[bytes]:
        nonlocal open_item
        events = []
        if open_item is not None and open_item["item"]["type"] != kind:
            events += close()
        index = len(output)
        if open_item is None:
            item = _reasoning_item(_new_id("rs"), "", "in_progress") if kind == "reasoning" else \
                _message_item(_new_id("msg"), None, "in_progress")
            open_item = {"item": item, "text": ""}
            events.append(event("response.output_item.added", output_index=index, item=item))
            if kind == "message":
                events.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                           "logprobs": []}))
        open_item["text"] += delta
        item_id = open_item["item"]["id"]
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, event(name, item_id=item_id, output_index=index, content_index=0, delta=delta, **extra)]

    async for chunk in chunks:
        if response is None:
            response = _base(body, chunk["id"], chunk["created"], chunk["model"])
            yield event("response.created", response=response)
            yield event("response.in_progress", response=response)
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
                if delta.get(key):
                    for e in text(kind, delta[key]):
                        yield e
            for call in delta.get("tool_calls") or []:
                for e in close():
                    yield e
                index, item = len(output), _call_item(call, "in_progress", "")
                yield event("response.output_item.added", output_index=index, item=item)
                arguments = call["function"]["arguments"]
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=arguments)
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=arguments, name=item["name"])
                done = {**item, "arguments": arguments, "status": "completed"}
                output.append(done)
                yield event("response.output_item.done", output_index=index, item=done)
            finish_reason = choice.get("finish_reason") or finish_reason
        if chunk.get("usage") is not None and response is not None:
            for e in close():
                yield e
            final = _finish(response, finish_reason, output, chunk["usage"])
            kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            yield event(kind, response=final)
