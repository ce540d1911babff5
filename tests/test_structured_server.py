"""Structured outputs through the HTTP API with the official `openai` client against the demo model: OpenAI's
`response_format` (json_object, json_schema through `chat.completions.parse` with a Pydantic model) and vLLM's
`structured_outputs` (regex, choice, a Lark grammar), streamed and not; a constraint that does not compile is a 400."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import lark
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import TEST_ENGINE_ARGS, ServerThread

from checkpoints import DEMO_MODEL_DIR
from jserve.config import EngineConfig
from jserve.server.settings import ServerSettings

MESSAGES = [{"role": "user", "content": "Describe a person."}]
GRAMMAR = r"""
start: sum
sum: NUMBER (("+" | "*") NUMBER)~0..3
NUMBER: /[1-9][0-9]?/
"""


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(model=str(DEMO_MODEL_DIR), **{**TEST_ENGINE_ARGS, "max_num_seqs": 32})
    srv = ServerThread(config, ServerSettings(max_queued_requests=128)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_succeeds_100_of_100_at_temperature_1(client, server):
    model = server.state.model_name

    def one(seed: int) -> Person:
        reply = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Person,
                                              temperature=1.0, seed=seed, max_tokens=120)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.parsed

    with ThreadPoolExecutor(32) as pool:
        people = list(pool.map(one, range(100)))
    assert all(isinstance(p, Person) for p in people)  # parse() validated each against the model
    assert len({p.model_dump_json() for p in people}) > 10  # sampled, not one answer repeated


def test_json_object_outputs_parse_streamed_and_not(client, server):
    """Every json_object reply that ends parses as an object. A free-form key is a free string, which the 4M demo
    model can run on past max_tokens (about 3 in 4 replies here): those end with "length", a JSON prefix."""
    model = server.state.model_name
    kwargs = dict(model=model, messages=MESSAGES, temperature=0.8, max_tokens=200,
                  response_format={"type": "json_object"})

    def streamed(seed: int) -> str:
        stream = client.chat.completions.create(**kwargs, seed=seed, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    # All 16 at once, so the server decodes them as one batch (seeded sampling does not depend on the batch).
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda seed: client.chat.completions.create(**kwargs, seed=seed), range(16)))
        texts = list(pool.map(streamed, range(16)))
    stopped = 0
    for reply, text in zip(replies, texts, strict=True):
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(reply.choices[0].message.content), dict)
            stopped += 1
        assert text == reply.choices[0].message.content  # the same seed streams the same constrained text
    assert stopped >= 2


def test_stop_reason_tells_a_stop_string_from_the_schema_end(client, server):
    """A reply that ends at the schema's end has stop_reason null and matches; a stop string ends one early with
    finish_reason "stop" too, and its stop_reason (the string) says so: the text is a prefix, not valid JSON."""
    kwargs = dict(model=server.state.model_name, messages=MESSAGES, temperature=0, max_tokens=120,
                  response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                          "schema": Person.model_json_schema()}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop" and whole.model_extra["stop_reason"] is None
    Person.model_validate_json(whole.message.content)
    cut = client.chat.completions.create(**kwargs, stop=[","]).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == ","
    assert whole.message.content.startswith(cut.message.content + ",")
    with pytest.raises(ValueError):
        json.loads(cut.message.content)


@pytest.mark.parametrize("constraint", ["regex", "choice", "grammar"])
def test_structured_outputs_field_on_completions_and_chat(client, server, constraint):
    model = server.state.model_name
    spec = {"regex": r"[A-Z][a-z]{1,6} [0-9]{2}", "choice": ["cat", "dog", "a bird"], "grammar": GRAMMAR}[constraint]
    check = {"regex": lambda t: re.fullmatch(spec, t), "choice": lambda t: t in spec,
             "grammar": lambda t: lark.Lark(GRAMMAR).parse(t)}[constraint]
    for seed in range(6):
        extra = {"structured_outputs": {constraint: spec}}
        completion = client.completions.create(model=model, prompt="x =", temperature=1.0, seed=seed, max_tokens=40,
                                               extra_body=extra)
        chat = client.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, seed=seed,
                                              max_tokens=40, extra_body=extra)
        for text in (completion.choices[0].text, chat.choices[0].message.content):
            assert check(text), text


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(extra_body={"structured_outputs": {"regex": "a("}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "structured_outputs"),
    (dict(response_format={"type": "yaml"}), "response_format"),
])
def test_a_constraint_that_cannot_compile_is_a_400(client, server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.state.model_name, messages=MESSAGES, max_tokens=4, **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert info.value.body["message"]


def test_vllms_older_guided_fields_constrain_alike(client, server):
    """guided_choice, guided_regex and guided_json (vLLM's names before structured_outputs, which clients still
    send) constrain as structured_outputs does; given with it, or two at once, they are a 400."""
    model = server.state.model_name
    kwargs = dict(model=model, messages=MESSAGES, temperature=1.0, max_tokens=40)
    for seed in range(4):
        choice = client.chat.completions.create(**kwargs, seed=seed, extra_body={"guided_choice": ["yes", "no"]})
        assert choice.choices[0].message.content in ("yes", "no")
        digits = client.completions.create(model=model, prompt="n =", max_tokens=12, temperature=1.0, seed=seed,
                                           extra_body={"guided_regex": "[0-9]{3}"})
        assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    shaped = client.chat.completions.create(**kwargs, seed=0, extra_body={"guided_json": schema})
    assert set(json.loads(shaped.choices[0].message.content)) == {"n"}
    for extra in ({"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}},
                  {"guided_choice": ["a"], "guided_regex": "b"}):
        with pytest.raises(openai.BadRequestError, match="give one constraint"):
            client.chat.completions.create(**kwargs, extra_body=extra)
