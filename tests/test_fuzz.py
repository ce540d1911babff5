"""schemathesis against /openapi.json of a live demo-model server: the schema's own requests, valid and invalid,
never get a 5xx, and every 4xx body is OpenAI's {"error": {message, type, param, code}}.

Also the vocabulary bound the schema cannot state: prompt token ids at or past the model's vocabulary (but inside
the tokenizer's) are a 400 naming the id, over HTTP and in the offline LLM.
"""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_helpers import TEST_ENGINE_ARGS, ServerThread, wait_until

from checkpoints import DEMO_MODEL_DIR
from jserve.config import EngineConfig
from jserve.server.settings import ServerSettings

# Generated requests may ask for long outputs; the fuzz is about the request surface, not decode speed, so each
# case's output is capped (the bound is applied only to values the schema allows, so invalid ones stay invalid).
MAX_FUZZ_TOKENS = 4
# (path, method, positive cases, negative cases): about 300 requests in all, most on the generating routes.
OPERATIONS = [("/v1/completions", "POST", 70, 40), ("/v1/chat/completions", "POST", 70, 40),
              ("/tokenize", "POST", 25, 15), ("/detokenize", "POST", 15, 10), ("/v1/models", "GET", 3, 0),
              ("/health", "GET", 2, 0), ("/version", "GET", 2, 0), ("/metrics", "GET", 2, 0)]


@pytest.fixture(scope="module")
def demo_server():
    config = EngineConfig(model=str(DEMO_MODEL_DIR), **TEST_ENGINE_ARGS)
    srv = ServerThread(config, ServerSettings(max_queued_requests=64)).start()
    yield srv
    srv.stop()


def _cap_outputs(body: object) -> None:
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS:
            body[name] = MAX_FUZZ_TOKENS
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_FUZZ_TOKENS  # chat's default is the rest of the context


def assert_openai_error(response: httpx.Response | schemathesis.Response, where: str) -> None:
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"{where}: {body}"
    assert isinstance(error["message"], str) and error["message"], f"{where}: {body}"
    assert isinstance(error["type"], str), f"{where}: {body}"
    assert error["param"] is None or isinstance(error["param"], str), f"{where}: {body}"
    assert error["code"] is None or isinstance(error["code"], str), f"{where}: {body}"


def _fuzz(url: str, operation, mode: GenerationMode, count: int, seen: dict[int, int]) -> None:
    where = f"{operation.method.upper()} {operation.path} ({mode.value})"

    @settings(max_examples=count, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        _cap_outputs(case.body)
        response = case.call(base_url=url, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        detail = f"{where}: {response.status_code} for {case.body!r:.500}"
        assert response.status_code < 500, f"{detail}: {response.text[:500]}"
        if 400 <= response.status_code < 500:
            assert_openai_error(response, detail)
        elif mode is GenerationMode.POSITIVE and response.status_code == 200 \
                and "application/json" in str(response.headers.get("content-type")):
            operation.validate_response(response)  # the body matches the documented schema

    run()


def test_schemathesis_finds_no_server_error_and_only_openai_shaped_errors(demo_server):
    schema = schemathesis.openapi.from_url(f"{demo_server.url}/openapi.json")
    seen: dict[int, int] = {}
    for path, method, positive, negative in OPERATIONS:
        for mode, count in ((GenerationMode.POSITIVE, positive), (GenerationMode.NEGATIVE, negative)):
            if count:
                _fuzz(demo_server.url, schema[path][method], mode, count, seen)
    print("status codes of the fuzzed requests:", dict(sorted(seen.items())))
    total = sum(seen.values())
    assert total >= 250, seen
    # Both sides of the surface were exercised: accepted requests and refused ones.
    assert seen.get(200, 0) >= 50 and seen.get(400, 0) >= 50, seen
    engine = demo_server.state.engine.engine
    assert wait_until(lambda: not engine.has_unfinished_requests(), 30)


def test_prompt_ids_outside_the_model_vocabulary_are_refused(hf_model_dir, llm_factory):
    """The model's table has 300 rows, the tokenizer ~400 tokens: id 350 is a token, but not one the model has."""
    model_dir = hf_model_dir("llama", vocab_size=300)
    llm = llm_factory(model_dir)
    assert llm.engine.tokenizer.vocab_size > 350 and llm.engine.model_config.vocab_size == 300
    with pytest.raises(ValueError, match=r"prompt token id 350 is outside the model's vocabulary.*\[0, 300\)"):
        llm.generate([{"prompt_token_ids": [5, 350]}])
    assert llm.generate([{"prompt_token_ids": [5, 299]}])[0].outputs[0].token_ids

    config = EngineConfig(model=str(model_dir), **TEST_ENGINE_ARGS)
    srv = ServerThread(config, ServerSettings()).start()
    try:
        for body, param, needle in [
            ({"prompt": [5, 350], "max_tokens": 2}, "prompt", "350"),
            ({"prompt": [[5], [6, 300]], "max_tokens": 2}, "prompt", "300"),
            ({"prompt": "hi", "max_tokens": 2, "logit_bias": {"320": 1}}, "logit_bias", "320"),
            ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": [399]}, "stop_token_ids", "399"),
        ]:
            response = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 400, response.text
            assert_openai_error(response, str(body))
            error = response.json()["error"]
            assert error["param"] == param and needle in error["message"] and "300" in error["message"], error
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5, 299], "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        srv.stop()


_CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "logit_bias": {"+5": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1_0": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"\u0665": 1}}, "logit_bias"),  # an Arabic-Indic 5: int() would take it
    ({"prompt": "hi", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"prompt": "hi", "temperature": 101}, "temperature"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 129}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stop": ["x"] * 65}, "stop"),
    ({"prompt": "hi", "stop": ["x" * 513]}, "stop"),
    ({"prompt": [5, -1]}, "prompt"),
    ({"messages": _CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
], ids=lambda v: None if isinstance(v, str) else json.dumps(v)[:40])
def test_out_of_range_fields_are_400s_naming_the_field(demo_server, body, param):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{demo_server.url}{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert_openai_error(response, str(body))
    assert response.json()["error"]["param"] == param, response.json()


def test_integral_numbers_are_integers(demo_server):
    """JSON Schema's (and OpenAI's) reading: 2.0 is the integer 2, in every integer field and token list."""
    as_ints = {"prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "temperature": 0, "logit_bias": {"9": 2}}
    as_floats = {"prompt": [5.0, 6.0, 7.0], "max_tokens": 3.0, "n": 2.0, "temperature": 0, "logit_bias": {"9": 2}}
    answers = [httpx.post(f"{demo_server.url}/v1/completions", json=body, timeout=60) for body in (as_ints, as_floats)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    texts = [[c["text"] for c in a.json()["choices"]] for a in answers]
    assert texts[0] == texts[1] and len(texts[0]) == 2
    assert answers[1].json()["usage"] == answers[0].json()["usage"]
    detok = httpx.post(f"{demo_server.url}/detokenize", json={"tokens": [5.0, 6.0]}, timeout=30)
    assert detok.status_code == 200
    assert detok.json() == httpx.post(f"{demo_server.url}/detokenize", json={"tokens": [5, 6]}, timeout=30).json()


def test_openapi_request_schemas_state_the_real_rules(demo_server):
    """The published request schemas, checked by an independent JSON-schema validator (jsonschema-rs, which
    schemathesis brings): the bodies the server takes validate, the ones it refuses for a range, a type or a
    missing field do not."""
    spec = httpx.get(f"{demo_server.url}/openapi.json", timeout=10).json()
    schemas = spec["components"]["schemas"]

    def valid(name: str, body: dict) -> bool:
        validator = jsonschema_rs.Draft202012Validator({**schemas[name], "components": spec["components"]})
        return validator.is_valid(body)

    assert valid("CompletionRequest", {"prompt": "hi", "max_tokens": 4, "n": 2, "cache_salt": "tenant-a",
                                       "logit_bias": {"42": -100}, "stop": ["\n"], "temperature": 0.7})
    for bad in ({"max_tokens": 4}, {"prompt": "hi", "n": 129}, {"prompt": "hi", "temperature": 101},
                {"prompt": "hi", "logprobs": 21}, {"prompt": "hi", "logit_bias": {"+5": 1}},
                {"prompt": "hi", "stop": ["x"] * 65}, {"prompt": [5, -1]}, {"prompt": "hi", "cache_salt": 5}):
        assert not valid("CompletionRequest", bad), bad
    assert schemas["CompletionRequest"]["properties"]["cache_salt"]["anyOf"][0]["type"] == "string"
    assert "cache_salt" not in schemas["CompletionRequest"]["required"]
    assert valid("ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                           "logprobs": True, "top_logprobs": 3})
    for bad in ({"messages": []}, {"messages": [{"role": "user", "content": 5}]},
                {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 21}):
        assert not valid("ChatCompletionRequest", bad), bad
    assert valid("TokenizeRequest", {"prompt": "a"}) and valid("TokenizeRequest", {"messages": [
        {"role": "user", "content": "a"}]})
    assert not valid("TokenizeRequest", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]})
    assert not valid("TokenizeRequest", {})
    assert valid("DetokenizeRequest", {"tokens": [1, 2]}) and not valid("DetokenizeRequest", {"tokens": [-1]})
    # The one cross-field rule the schema states (exactly one of prompt and messages) is the route's own.
    assert httpx.post(f"{demo_server.url}/tokenize", json={"prompt": "a", "messages": [
        {"role": "user", "content": "a"}]}, timeout=10).status_code == 400
