"""OpenAI tool calling through the official `openai` client against a live server on the demo model: `required` and
named tool choices give calls whose arguments validate against the function's schema (jsonschema), streamed deltas
reassemble to the non-streamed message, tool results go back into the conversation; the `auto` parsers read the
Hermes, Llama 3 and DeepSeek formats."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import transformers
from hf_models import build_model, save_tokenizer
from server_helpers import TEST_ENGINE_ARGS, ServerThread

from checkpoints import DEMO_MODEL_DIR
from jserve.config import EngineConfig
from jserve.server.settings import ServerSettings
from jserve.server.tools import ToolRequest, ToolStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(model=str(DEMO_MODEL_DIR), **TEST_ENGINE_ARGS)
    srv = ServerThread(config, ServerSettings(tool_call_parser="hermes")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def reassemble(stream) -> tuple[str | None, list[dict], str | None]:
    """A streamed chat choice as (content, tool_calls, finish_reason), joining deltas as the OpenAI docs describe."""
    content, calls, finish = None, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_valid_calls_streamed_and_not(client, server, parallel):
    model = server.state.model_name
    for seed in range(5):
        kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
                      seed=seed, max_tokens=150, parallel_tool_calls=parallel)
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        content, streamed, finish = reassemble(client.chat.completions.create(**kwargs, stream=True))
        assert finish == "tool_calls" and content is None
        assert [(c["name"], c["arguments"]) for c in streamed] == \
            [(c.function.name, c.function.arguments) for c in calls]


def test_a_named_function_is_called_with_valid_arguments(client, server):
    model = server.state.model_name
    choice = {"type": "function", "function": {"name": "add"}}
    for seed in range(5):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               temperature=1.0, seed=seed, max_tokens=60)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop" and message.content is None
        (call,) = message.tool_calls
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), ADD)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_cut_by_a_stop_string_stays_content(client, server, stream):
    """The stop string ends the arguments before their JSON does: no tool call with arguments json.loads rejects
    (as tool_choice "required"), but the text as content, finish_reason "stop" and the stop string as stop_reason."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=server.state.model_name, messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0,
                  max_tokens=60, stop=[","])
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        content, calls, finish = reassemble(chunks)
        stop_reason = chunks[-1].choices[0].model_extra["stop_reason"]
    else:
        reply = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = reply.message.content, reply.message.tool_calls or [], reply.finish_reason
        stop_reason = reply.model_extra["stop_reason"]
    assert calls == [] and finish == "stop" and stop_reason == ","
    assert content.startswith('{"city"') and "," not in content
    with pytest.raises(ValueError):
        json.loads(content)


def test_streamed_tool_calls_carry_the_logprobs(client, server):
    kwargs = dict(model=server.state.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  temperature=0, max_tokens=80, logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.message.tool_calls and reply.logprobs.content
    streamed = [t for c in client.chat.completions.create(**kwargs, stream=True) for ch in c.choices
                if ch.logprobs for t in ch.logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in reply.logprobs.content]


def test_parallel_tool_calls_null_is_the_default(server):
    body = dict(model=server.state.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=None, temperature=0, max_tokens=150)
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)  # an explicit JSON null
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["tool_calls"]


def test_tool_results_go_back_into_the_conversation(client, server):
    model = server.state.model_name
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=150)
    call = first.choices[0].message.tool_calls[0]
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content is not None


def test_auto_returns_text_when_the_model_writes_no_call(client, server):
    """A reply without a call under tool_choice "auto" streams its content as it comes (not whole at the end)."""
    kwargs = dict(model=server.state.model_name, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=12)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, **kwargs)
              if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == choice.message.content


def test_auto_streams_the_content_before_a_call(client, server):
    """Content before a hermes call streams in pieces; the call, read once the output is complete, follows: the
    stream reassembles to the non-streamed message."""
    call = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    kwargs = dict(model=server.state.model_name, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
                  extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{3,8}( [a-z]{3,8}){3}\.\n" + call}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and re.fullmatch(r"[A-Z][a-z]+( [a-z]+){3}\.", choice.message.content)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) > 1
    content, calls, finish = reassemble(chunks)
    assert (content, finish) == (choice.message.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(t.function.name, t.function.arguments)
                                                            for t in choice.message.tool_calls]


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tool_requests_are_400s(client, server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.state.model_name, messages=MESSAGES, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param


DEEPSEEK_V3_CALLS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                     '{"city": "Beijing", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
                     '<｜tool▁sep｜>add\n```json\n{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


def tool_request(choice: str = "auto", parser: str | None = "hermes") -> ToolRequest:
    return ToolRequest(TOOLS, choice, True, parser)


AUTO_CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>', "Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "add", '
               '"arguments": {"a": 3, "b": 4}}</tool_call>', None,
     [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("hermes", "No tools needed; it is sunny.", "No tools needed; it is sunny.", []),
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b", "unit": "celsius"}}; '
                    '{"name": "add", "parameters": {"a": 5, "b": 6}}', None,
     [("get_weather", {"city": "a;b", "unit": "celsius"}), ("add", {"a": 5, "b": 6})]),
    ("llama3_json", "The answer is 3.", "The answer is 3.", []),
    # Arguments that are not a JSON object are no call (OpenAI's arguments always are one): the text stays.
    ("hermes", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "add", "arguments": 7}</tool_call>',
     '<tool_call>{"name": "add", "arguments": 7}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', None,
     [("add", {"a": 1, "b": 2})]),  # arguments as JSON text of an object, as some models write them
    ("llama3_json", '{"name": "add", "parameters": "x"}', '{"name": "add", "parameters": "x"}', []),
    # DeepSeek-V3 / R1 (vLLM's DeepSeekV3ToolParser's documented output) and DeepSeek-V3.1 (its tool-call template)
    ("deepseek_v3", DEEPSEEK_V3_CALLS, None, [("get_weather", {"city": "Beijing", "unit": "celsius"}),
                                              ("add", {"a": 1, "b": 2})]),
    ("deepseek_v3", "Let me check.\n" + DEEPSEEK_V3_CALLS[:DEEPSEEK_V3_CALLS.index("\n<｜tool▁call▁begin｜>")]
     + "<｜tool▁calls▁end｜>", "Let me check.", [("get_weather", {"city": "Beijing", "unit": "celsius"})]),
    ("deepseek_v3", DEEPSEEK_V3_CALLS.replace("add", "sub"), DEEPSEEK_V3_CALLS.replace("add", "sub"), []),
    ("deepseek_v3", "It is sunny.", "It is sunny.", []),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 4, \"b\": 5}"
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [("add", {"a": 4, "b": 5})]),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 4<｜tool▁call▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 4<｜tool▁call▁end｜>", []),
    # Mistral's (vLLM's MistralToolParser): a JSON list after [TOOL_CALLS] (tokenizers up to v7), NAME[ARGS]{...} per
    # call (v11 on), with a call id (v13)
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', None,
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]add[ARGS]'
                '{"a": 1, "b": 2}', "Sure.", [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                              ("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 5, "b": 6}', None, [("add", {"a": 5, "b": 6})]),
    ("mistral", '[TOOL_CALLS]sub[ARGS]{"a": 5}', '[TOOL_CALLS]sub[ARGS]{"a": 5}', []),
    ("mistral", "It is [sunny].", "It is [sunny].", []),
    # pythonic (vLLM's PythonicToolParser and Llama4PythonicToolParser)
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), add(a=1, b=-2)]', None,
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": -2})]),
    ("pythonic", "<|python_start|>[add(a=3, b=4)]<|python_end|>", None, [("add", {"a": 3, "b": 4})]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", '[os.system("ls")]', '[os.system("ls")]', []),
    ("pythonic", "[add(a=x, b=2)]", "[add(a=x, b=2)]", []),  # a name, not a literal: nothing is evaluated
    ("pythonic", "The list is [a, b].", "The list is [a, b].", []),
    # text that starts as a marker or a call would, and is none
    ("hermes", "Use <tool> tags\n", "Use <tool> tags\n", []),
    ("llama3_json", "  <|python", "  <|python", []),
    ("llama3_json", "{not json}", "{not json}", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), AUTO_CASES)
def test_auto_parsers_read_the_model_formats(parser, text, content, calls):
    got_content, got = tool_request(parser=parser).calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), AUTO_CASES)
def test_streamed_content_is_the_replys_content(parser, text, content, calls, size):
    """Fed in pieces, the tool stream sends exactly the content the non-streamed reply has, and none of it before
    it is sure: where the text holds calls, what it sent is the reply's content; where it holds none, that plus the
    rest it held back is the whole text."""
    stream, sent = ToolStream(parser), ""
    for i in range(0, len(text), size):
        sent += stream.feed(text[i:i + size])
        assert text.startswith(sent)
    got_content, got = tool_request(parser=parser).calls(text)
    if not got:
        sent += stream.rest()
    assert sent == (got_content or "") and got_content == content


@pytest.mark.parametrize(("choice", "text"), [("add", '{"a": 1'), ("add", "[1, 2]"), ("required", '[{"name": "add"'),
                                              ("required", "{}")])
def test_forced_output_that_is_no_call_stays_content(choice, text):
    """Output a stop string cut (or anything else that is not the constrained JSON) is left as content."""
    assert tool_request(choice).calls(text) == (text, [])


DEEPSEEK_TOKENS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁sep｜>"]


@pytest.fixture(scope="module")
def deepseek_client(tmp_path_factory):
    """The tiny DeepSeek-V3 behind a server with --tool-call-parser deepseek_v3; its tokenizer has DeepSeek's tool-call
    markers as special tokens, as DeepSeek's own has them as added tokens."""
    model_dir = build_model("deepseek_v3", tmp_path_factory.mktemp("deepseek_tools"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(save_tokenizer(model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": DEEPSEEK_TOKENS})
    tokenizer.save_pretrained(model_dir)
    config = EngineConfig(model=str(model_dir), **TEST_ENGINE_ARGS)
    srv = ServerThread(config, ServerSettings(served_model_name="deepseek", tool_call_parser="deepseek_v3")).start()
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    srv.stop()


def test_deepseek_v3_calls_through_the_openai_client(deepseek_client):
    """DeepSeek-V3's calls block, its markers special tokens (an llguidance grammar forces the output): the parser
    reads it into the official client's tool_calls, streamed and not, with the text before it as content."""
    arguments = r'\{"a": [1-9], "b": [1-9]\}'
    grammar = ('start: /[A-Z][a-z]{2,6}\\./ " " <｜tool▁calls▁begin｜> <｜tool▁call▁begin｜> "function" '
               f'<｜tool▁sep｜> "add\\n```json\\n" /{arguments}/ "\\n```" <｜tool▁call▁end｜> <｜tool▁calls▁end｜>')
    kwargs = dict(model="deepseek", messages=MESSAGES, max_tokens=100, temperature=0, tools=TOOLS,
                  extra_body={"structured_outputs": {"grammar": grammar}})
    choice = deepseek_client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and re.fullmatch(r"[A-Z][a-z]{2,6}\.", choice.message.content)
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and re.fullmatch(arguments, call.function.arguments)
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    content, calls, finish = reassemble(deepseek_client.chat.completions.create(stream=True, **kwargs))
    assert (content, finish) == (choice.message.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", call.function.arguments)]
