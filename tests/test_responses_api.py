"""OpenAI's Responses API (/v1/responses) through the official `openai` client against a live demo-model server: the
same answer as the chat completion it stands for, streamed events that the client's own accumulator checks and
rebuilds, function calls and their outputs, structured text, and the refusals."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import TEST_ENGINE_ARGS, ServerThread

from checkpoints import DEMO_MODEL_DIR
from jserve.config import EngineConfig
from jserve.server.settings import ServerSettings

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(EngineConfig(model=str(DEMO_MODEL_DIR), **TEST_ENGINE_ARGS),
                       ServerSettings(tool_call_parser="hermes")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_response_is_its_chat_completion(client, server):
    """instructions become the system message and the input items the conversation: the output text, its token
    counts and the finish are the chat completion's for those messages."""
    model = server.state.model_name
    messages = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "def add(a, b):"},
                {"role": "assistant", "content": "    return a + b"}, {"role": "user", "content": "and sub?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12, temperature=0)
    response = client.responses.create(
        model=model, instructions="Answer in Python.", max_output_tokens=12, temperature=0,
        input=[{"role": "user", "content": "def add(a, b):"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                     "text": "    return a + b"}]},
               {"role": "user", "content": [{"type": "input_text", "text": "and sub?"}]}])
    assert response.object == "response" and response.id.startswith("resp") and response.model == model
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    if finished == "length":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_rebuild_the_response(client, server):
    """The client's stream helper checks every event against what it has seen (items added before their deltas, one
    identity an item) and rebuilds the response; it is the one a plain request returns, cut at max_output_tokens
    (its last event response.incomplete) or not."""
    model = server.state.model_name
    for extra in (dict(max_output_tokens=24), dict(max_output_tokens=200, extra_body={"stop": ["sys"]})):
        kwargs = dict(model=model, input="import os\n", temperature=0, **extra)
        whole = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
            if whole.status == "completed":
                assert stream.get_final_response().output_text == whole.output_text
        kinds = [event.type for event in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-1] == f"response.{whole.status}" and kinds.count("response.output_text.delta") > 1
        assert events[-1].response.output_text == whole.output_text
    assert whole.status == "completed"  # ended by the stop string (vLLM's extra sampling fields pass through)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_and_their_outputs(client, server, stream):
    """tool_choice required: each function_call item's arguments satisfy its tool's schema; sending the calls back
    with their outputs is a conversation the chat template renders (the same prompt as the chat messages)."""
    model = server.state.model_name
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]
    kwargs = dict(model=model, input="Weather in Paris?", tools=tools, tool_choice="required", max_output_tokens=150,
                  temperature=0, parallel_tool_calls=False)
    if stream:
        with client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = client.responses.create(model=model, tools=tools, max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"},
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
        *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]])
    chat = client.chat.completions.create(model=model, max_completion_tokens=4, tools=[
        {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": WEATHER}}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]},
        *[{"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls]])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_text_format(client, server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}}, "required": ["answer"],
              "additionalProperties": False}
    response = client.responses.create(model=server.state.model_name, input="Give an answer.", max_output_tokens=48,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                        "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(previous_response_id="resp_1"), "previous_response_id is not supported"),
    (dict(tools=[{"type": "web_search"}]), "only function tools are served"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "only text content is served"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "an input item must be a message"),
    (dict(tool_choice={"type": "file_search"}), "tool_choice must be"),
    (dict(text={"format": {"type": "xml"}}), "text.format must be"),
])
def test_what_is_not_served_is_a_400(client, server, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.responses.create(**{"model": server.state.model_name, "input": "hi", **kwargs})
