"""The OpenAI-compatible server, over a real uvicorn socket, seen through the official openai client.

One server (a tiny random Llama) is shared by every test here. Outputs are checked against the offline engine
(`LLM.generate` / `LLM.chat` on the same weights and settings); errors against OpenAI's error classes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import TEST_ENGINE_ARGS, ServerThread, metric_total, metric_values, wait_until
from transformers import AutoTokenizer

from jserve.config import EngineConfig
from jserve.sampling_params import SamplingParams
from jserve.server.responses import ChoiceState, completion_logprobs
from jserve.server.settings import ServerSettings

API_KEY = "test-key"
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), **TEST_ENGINE_ARGS)
    # 16 running + 112 queued: the 100-stream test fits without a 429.
    srv = ServerThread(config, ServerSettings(api_key=API_KEY, max_queued_requests=112)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir, llm_factory):
    return llm_factory(model_dir)


@pytest.fixture(scope="module")
def model_name(server):
    return server.state.model_name


def make_client(server, *, strict: bool = True, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, _strict_response_validation=strict,
                         max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return make_client(server)


@pytest.fixture(scope="module")
def loose_client(server):
    # The SDK types a completions chunk's finish_reason as never null, but OpenAI (and we) send null until the
    # last chunk, so completion *streams* cannot pass strict validation; their shape is checked by hand instead.
    return make_client(server, strict=False)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def drained(server) -> bool:
    engine = server.state.engine.engine
    s = engine.snapshot()
    return (s.num_running == 0 and s.num_waiting == 0 and not engine.has_unfinished_requests()
            and s.num_free_blocks == s.num_blocks)


def check_completion_chunks(chunks) -> dict[int, str]:
    """Each completion chunk is well formed; finish_reason is null until each choice's last chunk."""
    texts, finished = {}, set()
    for chunk in chunks:
        assert chunk.object == "text_completion" and chunk.id.startswith("cmpl-") and chunk.created > 0
        for choice in chunk.choices:
            assert choice.index not in finished
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.finish_reason in ("stop", "length")
                finished.add(choice.index)
    assert finished == set(texts)
    return texts


def stream_chat_texts(chunks) -> dict[int, str]:
    texts, finished, roles = {}, set(), set()
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index not in finished
            if choice.delta.role is not None:
                assert choice.index not in roles and choice.delta.content == ""  # role once, before any text
                roles.add(choice.index)
            else:
                assert choice.index in roles
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == roles == set(texts)
    return texts


# ----- outputs -----

def test_completion_stream_equals_nonstream_equals_offline(client, loose_client, offline, model_name):
    expected = [o.outputs[0] for o in offline.generate(PROMPTS, greedy(12), use_tqdm=False)]
    for prompt, out in zip(PROMPTS, expected, strict=True):
        full = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
        want = out.text
        assert full.choices[0].text == want and full.usage.completion_tokens == len(out.token_ids)
        stream = loose_client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True)
        assert check_completion_chunks(list(stream)) == {0: want}


def test_completion_batch_prompts_and_token_ids(client, offline, model_name):
    ids = offline.get_tokenizer().encode(PROMPTS[1])
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS[:2], greedy(6), use_tqdm=False)]
    full = client.completions.create(model=model_name, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    assert [c.text for c in sorted(full.choices, key=lambda c: c.index)] == expected
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == expected[1]
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_stream_equals_nonstream_equals_offline(client, offline, model_name):
    want = offline.chat(MESSAGES, greedy(10), use_tqdm=False)[0].outputs[0].text
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=10, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == want
    assert full.usage.prompt_tokens == len(offline.get_tokenizer().apply_chat_template(MESSAGES))
    stream = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=10,
                                            temperature=0, stream=True)
    assert stream_chat_texts(list(stream)) == {0: want}


def test_n2_with_seed_is_reproducible_and_matches_offline(client, loose_client, offline, model_name):
    params = SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=8)
    want = {o.index: o.text for o in offline.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs}
    full = client.completions.create(model=model_name, prompt=PROMPTS[0], n=2, temperature=1.0, seed=1234,
                                     max_tokens=8)
    assert {c.index: c.text for c in full.choices} == want
    stream = loose_client.completions.create(model=model_name, prompt=PROMPTS[0], n=2, temperature=1.0,
                                             seed=1234, max_tokens=8, stream=True)
    assert check_completion_chunks(list(stream)) == want
    chat_want = {o.index: o.text for o in offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs}
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, n=2, temperature=1.0, seed=1234,
                                          max_tokens=8, stream=True)
    assert stream_chat_texts(list(chat)) == chat_want


def test_stop_string_cuts_the_text(client, loose_client, offline, model_name):
    text = offline.generate(PROMPTS[2], greedy(16), use_tqdm=False)[0].outputs[0].text
    stop = text[4:6]
    want = offline.generate(PROMPTS[2], greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text
    full = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                     stop=stop)
    assert (full.choices[0].text, full.choices[0].finish_reason) == (want.text, "stop")
    chunks = list(loose_client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=16,
                                                  temperature=0, stop=[stop], stream=True))
    assert check_completion_chunks(chunks) == {0: want.text}
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_engine_extras_and_penalties_match_offline(client, offline, model_name):
    tokenizer = offline.get_tokenizer()
    favoured = tokenizer.encode(" os", add_special_tokens=False)[0]
    extras = dict(top_k=20, min_p=0.01, repetition_penalty=1.3, min_tokens=4, logit_bias={favoured: 4.0},
                  presence_penalty=0.5, frequency_penalty=0.3, seed=7, temperature=0.8)
    want = offline.generate(PROMPTS[1], SamplingParams(max_tokens=10, **extras), use_tqdm=False)[0].outputs[0]
    body = {k: v for k, v in extras.items() if k in ("top_k", "min_p", "repetition_penalty", "min_tokens")}
    full = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=10, seed=7,
                                     temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3,
                                     logit_bias={str(favoured): 4.0}, extra_body={**body, "priority": -1})
    assert full.choices[0].text == want.text and full.usage.completion_tokens == len(want.token_ids)


def test_vllm_token_restrictions_match_offline(client, offline, model_name):
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens through extra_body give the offline API's
    tokens; an id outside the vocabulary is a 400 naming the field."""
    free = offline.generate(PROMPTS[0], greedy(8), use_tqdm=False)[0].outputs[0]
    tokenizer = offline.get_tokenizer()
    word = next(w for w in (tokenizer.decode([t]).strip() for t in free.token_ids) if w and "\ufffd" not in w)
    allowed = tokenizer.encode(" return value", add_special_tokens=False)
    cases = [dict(allowed_token_ids=allowed), dict(bad_words=[word]), dict(truncate_prompt_tokens=3)]
    for extra in cases:
        want = offline.generate(PROMPTS[0], greedy(8, **extra), use_tqdm=False)[0]
        full = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                         extra_body=extra)
        assert full.choices[0].text == want.outputs[0].text != free.text, extra
        assert set(want.outputs[0].token_ids) <= set(extra.get("allowed_token_ids", want.outputs[0].token_ids))
        assert full.usage.prompt_tokens == len(want.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hi", max_tokens=2,
                                  extra_body={"allowed_token_ids": [offline.engine.model_config.vocab_size]})
    assert info.value.body["param"] == "allowed_token_ids"


def test_chat_template_arguments_render_as_transformers_does(server, client, model_dir, model_name):
    """chat_template_kwargs, reasoning_effort and continue_final_message reach the template (vLLM's fields):
    /tokenize and a chat's prompt are transformers' own rendering; conflicting, reserved or unknown arguments are a
    400 naming the field."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    render = functools.partial(hf.apply_chat_template, tokenize=True, return_dict=False)
    partial = MESSAGES + [{"role": "assistant", "content": "Hello"}]
    cases = [({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
              render(MESSAGES, add_generation_prompt=True, enable_thinking=False)),
             ({"messages": MESSAGES, "reasoning_effort": "high"},
              render(MESSAGES, add_generation_prompt=True, reasoning_effort="high")),
             ({"messages": partial, "continue_final_message": True, "add_generation_prompt": False},
              render(partial, continue_final_message=True))]
    for body, want in cases:
        assert httpx.post(f"{server.url}/tokenize", headers=AUTH, json=body).json()["tokens"] == want
        extra = {k: v for k, v in body.items() if k != "messages"}
        reply = client.chat.completions.create(model=model_name, messages=body["messages"], max_tokens=2,
                                               extra_body=extra)
        assert reply.usage.prompt_tokens == len(want)
    # the arguments mattered
    assert cases[0][1] != render(MESSAGES, add_generation_prompt=True) != cases[1][1]
    assert cases[2][1] != render(partial, add_generation_prompt=False)
    for extra, param in [({"continue_final_message": True}, "continue_final_message"),
                         ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                         ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model_name, messages=partial, max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param


def test_completion_logprobs(client, loose_client, model_name):
    full = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                     logprobs=3)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == full.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(loose_client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=6,
                                                  temperature=0, logprobs=3, stream=True))
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_chat_logprobs(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
               for t in content)
    stream = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [t.logprob for c in stream for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content])


# Emoji, an accented letter and CJK: each character is several byte tokens of the tiny byte-level vocabulary.
MULTIBYTE = "🌟é中🌟"


def _utf8(raw: bytes) -> str | None:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def _token_string(raw: bytes) -> str:
    return _utf8(raw) if _utf8(raw) is not None else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_chat_logprobs_of_partial_characters_carry_their_bytes(client, model_name):
    """The regex makes the random model write MULTIBYTE; its tokens' bytes join to the content, and a token that
    is part of a character is named by its bytes (OpenAI's "bytes:\\xNN"), not U+FFFD."""
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=30, temperature=0,
                                          logprobs=True, top_logprobs=5,
                                          extra_body={"structured_outputs": {"regex": MULTIBYTE}})
    choice = full.choices[0]
    assert choice.message.content == MULTIBYTE and choice.finish_reason == "stop"
    content = choice.logprobs.content
    # The EOS that ends the reply is among the logprobs (as in vLLM: one entry per completion token), its text left
    # out of the content.
    assert len(content) == full.usage.completion_tokens and content[-1].token == "</s>"
    assert b"".join(bytes(t.bytes) for t in content[:-1]) == MULTIBYTE.encode()
    assert any(_utf8(bytes(t.bytes)) is None for t in content)  # precondition: partial characters occur
    for t in content:
        assert all(top.token == _token_string(bytes(top.bytes)) for top in [t, *t.top_logprobs])
    stream = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=30, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True,
                                            extra_body={"structured_outputs": {"regex": MULTIBYTE}})
    streamed = [t for c in stream for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]


def test_completion_logprobs_of_partial_characters(client, loose_client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPTS[1], max_tokens=30, temperature=0, logprobs=5,
                  extra_body={"structured_outputs": {"regex": MULTIBYTE}})
    full = client.completions.create(**kwargs)
    text, lp = full.choices[0].text, full.choices[0].logprobs
    assert text == MULTIBYTE
    raw = [bytes.fromhex(t.removeprefix("bytes:").replace("\\x", "")) if t.startswith("bytes:") else t.encode()
           for t in lp.tokens]
    assert b"".join(raw) == text.encode() + b"</s>"  # the EOS that ends it last
    # text_offset: the character (of the returned text) that each token's first byte belongs to.
    starts = [sum(len(r) for r in raw[:i]) for i in range(len(raw))]
    assert lp.text_offset == [len(text.encode()[:b].decode("utf-8", errors="ignore")) for b in starts]
    assert all(0 <= offset < len(text) for offset in lp.text_offset[:-1]) and lp.text_offset[-1] == len(text)
    chunks = list(loose_client.completions.create(**kwargs, stream=True))
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_byte_tokens_are_distinct_top_logprobs_keys():
    """Three candidate byte tokens (parts of different characters) are three keys, named by their bytes."""
    token_bytes = {1: b"\xf0\x9f", 2: b"\xe4", 3: b"\xc3", 4: b" ok"}.__getitem__
    lp = completion_logprobs([{2: -0.5, 1: -1.0, 3: -2.0, 4: -3.0}], token_bytes, 4, ChoiceState())
    assert lp["tokens"] == ["bytes:\\xe4"]
    assert lp["top_logprobs"] == [{"bytes:\\xe4": -0.5, "bytes:\\xf0\\x9f": -1.0, "bytes:\\xc3": -2.0, " ok": -3.0}]


def test_include_usage_and_cached_tokens(client, loose_client, model_name):
    prompt = " ".join(PROMPTS) * 3  # long enough to fill whole KV blocks, which the prefix cache keeps
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0)
    chunks = list(loose_client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (first.usage.prompt_tokens,
                                                              first.usage.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 16  # the second run found the first one's blocks
    chat = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=3, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 3


# ----- errors, seen through the client -----

def test_bad_parameters_are_bad_requests(client, model_name):
    cases = [dict(temperature=-1), dict(max_tokens=-5), dict(top_p=0), dict(n=0), dict(logprobs=99),
             dict(extra_body={"top_k": "many"})]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model_name, prompt="hi", **kwargs)
        param = next(iter(kwargs if "extra_body" not in kwargs else kwargs["extra_body"]))
        assert info.value.body["param"] == param and info.value.status_code == 400


def test_auto_tool_choice_without_a_parser_is_refused_not_ignored(client, model_name):
    """This server has no --tool-call-parser: tools with tool_choice "auto" (the default) are a 400, not ignored."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2, tools=tools)
    assert info.value.body["param"] == "tool_choice" and "--tool-call-parser" in info.value.body["message"]
    # What the server can honour goes through: tools the client asks to be ignored, and plain text.
    reply = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2, tools=tools,
                                           tool_choice="none", response_format={"type": "text"})
    assert reply.choices[0].message.content is not None


def test_prompt_errors_describe_every_accepted_shape(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt=[["a"]])
    assert info.value.body["message"] == ("prompt must be a string or an array of strings or an array of integers "
                                          "or an array of arrays of integers")


def test_too_long_prompt_is_a_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens"):
        client.completions.create(model=model_name, prompt=[5] * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model_name, prompt=[5] * 500, max_tokens=100)


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_wrong_or_missing_key_is_unauthorized(server, model_name):
    with pytest.raises(openai.AuthenticationError):
        make_client(server, key="wrong").completions.create(model=model_name, prompt="hi", max_tokens=2)
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    non_ascii = {"Authorization": "Bearer t\xc3\xa9st".encode("latin-1")}  # must not break the compare
    assert httpx.get(f"{server.url}/v1/models", headers=non_ascii).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


# ----- the other routes -----

def test_models_tokenize_detokenize_version(server, client, offline, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    tok = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": PROMPTS[0]}).json()
    assert tok["tokens"] == offline.get_tokenizer().encode(PROMPTS[0]) and tok["count"] == len(tok["tokens"])
    chat = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"messages": MESSAGES}).json()
    assert chat["tokens"] == offline.get_tokenizer().apply_chat_template(MESSAGES)
    text = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == offline.get_tokenizer().decode(tok["tokens"], skip_special_tokens=False)
    # The chat prompt round-trips, special tokens included (as vLLM's /detokenize): the template's own text.
    text = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": chat["tokens"]}).json()["prompt"]
    reference = AutoTokenizer.from_pretrained(server.state.engine.engine.model_dir)
    assert text == reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "<s>" in text
    assert httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": [10**9]}).status_code == 400
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_openapi_describes_the_routes(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
                 "/health", "/metrics", "/version"):
        assert path in spec["paths"]
    body = spec["components"]["schemas"]["CompletionRequest"]
    assert body["required"] == ["prompt"] and {"max_tokens", "logprobs", "top_k"} <= set(body["properties"])
    # the run-time LoRA routes only with --allow-runtime-lora-updating (tests/test_lora_server.py)
    assert "/v1/load_lora_adapter" not in spec["paths"]
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "a", "lora_path": "/p"})
    assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]


def test_request_id_and_json_404(server):
    r = httpx.get(f"{server.url}/nope", headers={"x-request-id": "abc-123"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "abc-123" and "error" in r.json()
    r = httpx.get(f"{server.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["message"]
    replaced = httpx.get(f"{server.url}/health", headers={"x-request-id": "bad id <script>"})
    assert len(replaced.headers["x-request-id"]) == 32  # an unsafe id is replaced, not echoed


def test_metrics_are_exported(server, client, model_name):
    client.completions.create(model=model_name, prompt="hi", max_tokens=2)
    values = metric_values(server.url)
    for name in ("jserve:num_requests_running", "jserve:num_requests_waiting", "jserve:kv_cache_usage_perc",
                 "jserve:prefix_cache_queries_total", "jserve:prefix_cache_hits_total",
                 "jserve:num_preemptions_total", "jserve:prompt_tokens_total", "jserve:generation_tokens_total",
                 "jserve:time_to_first_token_seconds_count", "jserve:inter_token_latency_seconds_count",
                 "jserve:e2e_request_latency_seconds_count", "jserve:request_queue_time_seconds_count"):
        assert name in values, name
    assert values["jserve:generation_tokens_total"] >= 2 and values["jserve:e2e_request_latency_seconds_count"] >= 1
    assert values["jserve:prompt_tokens_total"] > 0


def test_request_metrics_count_requests_not_samples(server, client, model_name):
    """One finished request (its n samples together) is one count in request_success_total, in the e2e and in
    the TTFT histograms alike."""
    names = ("jserve:request_success_total", "jserve:e2e_request_latency_seconds_count",
             "jserve:time_to_first_token_seconds_count")
    assert wait_until(lambda: drained(server), 30)
    before = [metric_total(server.url, name) for name in names]
    client.completions.create(model=model_name, prompt="hi", max_tokens=3, n=4, temperature=1.0, seed=1)
    assert [metric_total(server.url, name) - b for name, b in zip(names, before, strict=True)] == [1, 1, 1]


# ----- load and disconnects -----

def test_100_concurrent_streams(server, offline, model_name):
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(100)]
    expected = [o.outputs[0].text for o in offline.generate(prompts, greedy(8), use_tqdm=False)]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert wait_until(lambda: drained(server), 2.0)
    assert wait_until(lambda: metric_values(server.url)["jserve:num_requests_running"] == 0, 2.0)
    assert metric_values(server.url)["jserve:kv_cache_usage_perc"] == 0


def recorded_aborts(engine, monkeypatch) -> list[str]:
    """The ids the server's engine thread aborts from now on (it aborts only requests still running)."""
    abort, aborted = engine.abort_request, []

    def recording_abort(request_id):
        aborted.append(request_id)
        return abort(request_id)

    monkeypatch.setattr(engine, "abort_request", recording_abort)
    return aborted


def test_closed_streams_are_aborted(server, client, model_name, monkeypatch):
    # Each stream asks for 400 tokens and closes after 3 chunks: the engine must abort all 16 rather than finish them.
    # The wait is generous because a loaded machine may be seconds into a step when the disconnects arrive.
    aborted = recorded_aborts(server.state.engine.engine, monkeypatch)

    async def open_and_close(aclient):
        stream = await aclient.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=400,
                                                  temperature=0.7, stream=True, extra_body={"ignore_eos": True})
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.close()
        return received

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        async with aclient:
            return await asyncio.gather(*(open_and_close(aclient) for _ in range(16)))

    assert asyncio.run(main()) == [3] * 16
    assert wait_until(lambda: drained(server), 30.0)
    assert len(aborted) == 16
    after = client.completions.create(model=model_name, prompt="still there?", max_tokens=3, temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length")


def test_non_streaming_client_timeout_aborts(server, model_name, monkeypatch):
    # Each engine step is held back 50 ms, so the answer cannot arrive before the client's 50 ms read timeout however
    # fast the machine decodes; the test then checks the engine aborted the request rather than finishing it.
    engine = server.state.engine.engine
    assert wait_until(lambda: drained(server), 30.0)  # nothing left over to abort
    step, aborted = engine.step, recorded_aborts(engine, monkeypatch)

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {"model": model_name, "prompt": PROMPTS[1], "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=httpx.Timeout(5, read=0.05))
    assert wait_until(lambda: drained(server), 30.0)
    assert len(aborted) == 1


# ----- malformed input: always a 4xx with an OpenAI error body, never a 500 -----

def post_raw(server, content: bytes, path: str = "/v1/completions", content_type: str = "application/json"):
    return httpx.post(f"{server.url}{path}", content=content, timeout=30,
                      headers={**AUTH, "content-type": content_type})


def assert_error(response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and "Traceback" not in error["message"] and set(error) == {"message", "type",
                                                                                         "param", "code"}
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "hi", "max_tok', None),
    (b'[1, 2, 3]', None),
    (b'"just a string"', None),
    (b'{"prompt": "hi", "temperature": NaN}', None),
    (b'{"prompt": "hi", "temperature": 1e999}', None),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    (b"[" * 100000 + b"]" * 100000, None),
    (b'{"prompt": "\xff\xfe invalid utf-8"}', None),
    (b'{"prompt": 123}', "prompt"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": [[]]}', "prompt"),
    (b'{"prompt": ["a", 1]}', "prompt"),
    (b'{"prompt": [-1, 5]}', "prompt"),
    (b'{"prompt": [1000000]}', "prompt"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"max_tokens": 5}', "prompt"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "hi", "use_beam_search": true}', "use_beam_search"),
    (b'{"prompt": "hi", "return_tokens_as_token_ids": true}', "return_tokens_as_token_ids"),
    (b'{"prompt": "hi", "max_tokens": 1e30}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 100000000000000000000000000000}', "max_tokens"),
    (b'{"prompt": "hi", "n": 100000000000000000000}', "n"),
    (b'{"prompt": "hi", "n": true}', "n"),
    (json.dumps({"prompt": ["a"] * 200}).encode(), "n"),  # 200 sequences: more than the server ever admits
    (b'{"prompt": "hi", "seed": 100000000000000000000000000000}', "seed"),
    (b'{"prompt": "hi", "priority": -100000000000000000000000000000}', "priority"),
    (b'{"prompt": "hi", "logit_bias": {"99999999999999999999": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": {"abc": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": [1, 2]}', "logit_bias"),
    (b'{"prompt": "hi", "stop": 5}', "stop"),
    (b'{"prompt": "hi", "stop": [""]}', "stop"),
    (b'{"prompt": "hi", "stop": ["' + b"x" * 100000 + b'"]}', "stop"),
    (b'{"prompt": "hi", "stop_token_ids": [99999999]}', "stop_token_ids"),
    (b'{"prompt": "hi", "stream": "yes"}', "stream"),
    (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', "stream_options"),
    (b'{"prompt": "hi", "top_k": 1.5}', "top_k"),
    (b'{"prompt": "hi", "min_tokens": 50, "max_tokens": 5}', "min_tokens"),
    (b'{"prompt": "hi", "model": 7}', "model"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "hi", "use_beam_search": true}', "use_beam_search"),
    (b'{"prompt": "hi", "return_tokens_as_token_ids": true}', "return_tokens_as_token_ids"),
    (b'{"prompt": "hi", "best_of": 3}', "best_of"),
])
def test_malformed_completion_requests(server, raw, param):
    assert_error(post_raw(server, raw), 400, param)


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": []}', "messages"),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": [{}]}', "messages"),
    (b'{"messages": [{"role": "user"}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
    (b'{"messages": [{"role": "", "content": "x"}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": 3}', "logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}', "max_completion_tokens"),
    (b'{"messages": [{"role": "user", "content": "' + b"word " * 2000 + b'"}]}', "prompt"),
])
def test_malformed_chat_requests(server, raw, param):
    assert_error(post_raw(server, raw, "/v1/chat/completions"), 400, param)


def test_wrong_content_type_and_huge_body(server):
    assert_error(post_raw(server, b'{"prompt": "hi"}', content_type="text/plain"), 400)
    assert_error(post_raw(server, b"prompt=hi", content_type="application/x-www-form-urlencoded"), 400)
    huge = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'
    assert_error(post_raw(server, huge), 413)

    def chunked():  # no content-length: the limit is enforced while reading
        for _ in range(10):
            yield b"a" * (1 << 20)

    r = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers={**AUTH,
                                                                                "content-type": "application/json"})
    assert_error(r, 413)


_json = st.recursive(st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False,
                     allow_infinity=False) | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_FIELDS = ["model", "prompt", "messages", "n", "temperature", "top_p", "stop", "seed", "logit_bias", "stream",
           "stream_options", "logprobs", "top_logprobs", "top_k", "min_p", "repetition_penalty", "min_tokens",
           "ignore_eos", "stop_token_ids", "priority", "presence_penalty", "frequency_penalty", "echo",
           # the Responses API's, Ollama's, and /score's and /rerank's own
           "input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens", "options",
           "format", "system", "think", "text_1", "text_2", "query", "documents"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/responses",
                             "/v1/embeddings", "/api/chat", "/api/generate", "/api/embed", "/api/show", "/score",
                             "/rerank"]),
       body=st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=6),
       max_tokens=st.one_of(st.integers(-3, 4), _json.filter(lambda v: not isinstance(v, int))))
def test_fuzzed_bodies_never_500(server, path, body, max_tokens):
    body = {**body, "max_tokens": max_tokens}
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4  # keep the fuzz cheap: large n is covered above
    if isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] > 4:
        body["max_output_tokens"] = 4
    if path.startswith("/api/"):  # Ollama streams unless told not to, and counts tokens in its options
        body = {**body, "stream": False, "options": {"num_predict": 4} if not isinstance(body.get("options"), dict)
                else {**body["options"], "num_predict": 4}}
    r = post_raw(server, json.dumps(body).encode(), path)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200 and path.startswith("/api/"):  # Ollama's shape: {"error": "..."}
        assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str) and r.json()["error"]
    elif r.status_code != 200:
        assert_error(r, r.status_code)


def test_a_body_without_sampling_fields_takes_the_models_recommended_ones(model_dir, llm_factory, tmp_path):
    """generation_config.json's fields fill what a body leaves out (vLLM's --generation-config auto): the same
    tokens as the offline API with those fields; a field the body gives wins; max_new_tokens caps a chat that sets
    no max_tokens."""
    import shutil

    model = tmp_path / "recommended"
    shutil.copytree(model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "repetition_penalty": 1.3,
                                                              "max_new_tokens": 6}))
    offline = llm_factory(model)
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=6),
                            use_tqdm=False)[0].outputs[0]
    plain = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6),
                             use_tqdm=False)[0].outputs[0]
    assert want.token_ids != plain.token_ids
    srv = ServerThread(EngineConfig(model=str(model), **TEST_ENGINE_ARGS), ServerSettings()).start()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0, timeout=60)
        name = srv.state.model_name
        got = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6)
        assert got.choices[0].text == want.text
        given = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6,
                                          extra_body={"repetition_penalty": 1.0})
        assert given.choices[0].text == plain.text
        chat = client.chat.completions.create(model=name, messages=MESSAGES)
        assert chat.usage.completion_tokens <= 6 and chat.choices[0].finish_reason in ("length", "stop")
    finally:
        srv.stop()
