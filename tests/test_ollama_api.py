"""Ollama's API through Ollama's own Python client (`ollama`) against live servers: the demo model's chat and
generate (streamed and not) equal to the chat completions they stand for, tool calls, structured output, the model
list, and embeddings from an embedding model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from server_helpers import TEST_ENGINE_ARGS, ServerThread

from checkpoints import DEMO_MODEL_DIR
from jserve.config import EngineConfig
from jserve.server.settings import ServerSettings

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
MESSAGES = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(EngineConfig(model=str(DEMO_MODEL_DIR), **TEST_ENGINE_ARGS),
                       ServerSettings(served_model_name="demo", tool_call_parser="llama3_json")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def _chat_completion(server, **kwargs):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model="demo", temperature=0, **kwargs)


def test_chat_is_its_chat_completion(client, server):
    """options become the sampling fields: the reply, its counts and its end are the chat completion's; streamed,
    the pieces join to it and the last object carries done, the reason and the counts."""
    expected = _chat_completion(server, messages=MESSAGES, max_completion_tokens=12)
    options = {"temperature": 0, "num_predict": 12}
    reply = client.chat(model="demo:latest", messages=MESSAGES, options=options, stream=False)
    assert reply.message.role == "assistant" and reply.message.content == expected.choices[0].message.content
    assert reply.done and reply.done_reason == "length" and reply.eval_count == 12
    assert reply.prompt_eval_count == expected.usage.prompt_tokens
    parts = list(client.chat(model="demo", messages=MESSAGES, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == reply.message.content
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done and parts[-1].eval_count == 12


def test_generate_applies_the_chat_template(client, server):
    expected = _chat_completion(server, messages=MESSAGES, max_completion_tokens=8)
    reply = client.generate(model="demo", system="Answer in Python.", prompt="def add(a, b):",
                            options={"temperature": 0, "num_predict": 8})
    assert reply.response == expected.choices[0].message.content and reply.done
    streamed = "".join(p.response for p in client.generate(model="demo", system="Answer in Python.",
                                                            prompt="def add(a, b):", stream=True,
                                                            options={"temperature": 0, "num_predict": 8}))
    assert streamed == reply.response


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_and_format(client, stream):
    """A format schema shaped as Llama 3's JSON call makes the model call (the llama3_json parser reads it): the call
    comes back with its arguments as an object, valid for its function; a conversation holding a call and its
    result renders and runs."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": WEATHER}}]
    call_shape = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
                  "required": ["name", "parameters"], "additionalProperties": False}
    kwargs = dict(model="demo", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                  format=call_shape, options={"temperature": 0, "num_predict": 150})
    if stream:
        parts = list(client.chat(**kwargs, stream=True))
        calls = [c for p in parts for c in p.message.tool_calls or []]
        assert parts[-1].done and parts[-1].done_reason == "stop"
    else:
        reply = client.chat(**kwargs)
        calls = reply.message.tool_calls or []
        assert reply.message.content == ""
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER)
    followed = client.chat(model="demo", options={"num_predict": 2}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}])
    assert followed.done


def test_format_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}}, "required": ["answer"],
              "additionalProperties": False}
    shaped = client.chat(model="demo", messages=[{"role": "user", "content": "Answer."}], format=schema,
                         options={"num_predict": 48})
    jsonschema.validate(json.loads(shaped.message.content), schema)


def test_models_and_errors(client, server):
    (card,) = client.list().models
    assert card.model == "demo" and card.details.family == "llama" and card.size > 0
    shown = client.show("demo")
    assert "completion" in shown.capabilities and shown.modelinfo["llama.context_length"] == 512
    assert client.ps().models[0].model == "demo"
    assert httpx.get(f"{server.url}/api/version", timeout=30).json()["version"]
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="nope", messages=MESSAGES)
    assert missing.value.status_code == 404 and "does not exist" in missing.value.error
    with pytest.raises(ollama.ResponseError) as pulled:
        client.pull("llama3")
    assert pulled.value.status_code == 501
    with pytest.raises(ollama.ResponseError, match="images are not supported"):
        client.chat(model="demo", messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}])
    with pytest.raises(ollama.ResponseError, match="generates text and does not serve embeddings"):
        client.embed(model="demo", input="hi")


def test_embed_from_an_embedding_model(tmp_path):
    import torch
    import transformers
    from hf_models import _save_random, make_config, save_tokenizer

    torch.manual_seed(0)
    _save_random(transformers.Qwen3Model(make_config("qwen3")), tmp_path)
    save_tokenizer(tmp_path)
    srv = ServerThread(EngineConfig(model=str(tmp_path), runner="pooling", executor="xla", **TEST_ENGINE_ARGS),
                       ServerSettings(served_model_name="emb")).start()
    try:
        reply = ollama.Client(host=srv.url, timeout=120).embed(model="emb", input=["hello", "def f(x):"])
        legacy = ollama.Client(host=srv.url, timeout=120).embeddings(model="emb", prompt="hello")
        shown = ollama.Client(host=srv.url, timeout=120).show("emb")
    finally:
        srv.stop()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    model = transformers.AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for text, got in zip(["hello", "def f(x):"], reply.embeddings, strict=True):
        with torch.no_grad():
            last = model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(got, last / np.linalg.norm(last), atol=2e-6)
    np.testing.assert_allclose(legacy.embedding, reply.embeddings[0], atol=1e-7)
    assert shown.capabilities == ["embedding"]
