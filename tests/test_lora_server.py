"""LoRA adapters on the OpenAI-compatible server (vLLM's --lora-modules), through the official openai client.

One server (a tiny random Llama with two random PEFT adapters) serves every request test; its greedy tokens for
each adapter, and for the base model, are PEFT's own (tests/test_lora.py checks the engine against PEFT in depth).
"""

from __future__ import annotations

import json
import logging
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import TEST_ENGINE_ARGS, ServerThread
from test_lora import make_adapter
from test_parity import hf_greedy

from jserve.cli import build_parser, main
from jserve.config import EngineConfig
from jserve.server.lora_modules import LoraModule, parse_lora_module
from jserve.server.multi_model import ServedModel
from jserve.server.responses import token_string
from jserve.server.settings import ServerSettings
from jserve.server.state import ServerState

PROMPT = [5, 17, 300, 42, 9, 77, 123]
STEPS = 6
ENGINE_ARGS = {**TEST_ENGINE_ARGS, "max_model_len": 256, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """[(directory, PEFT model)] of two adapters with different weights."""
    out = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"adapter{seed}")
        out.append((path, make_adapter(model_dir, path, seed=seed)))
    return out


@pytest.fixture(scope="module")
def server(model_dir, adapters):
    modules = (LoraModule("adapter1", str(adapters[0][0])), LoraModule("adapter2", str(adapters[1][0])))
    srv = ServerThread(EngineConfig(model=str(model_dir), **ENGINE_ARGS),
                       ServerSettings(lora_modules=modules, allow_runtime_lora_updating=True))
    yield srv.start()
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def token_strings(server, ids: list[int]) -> list[str]:
    """The logprobs token strings of these token ids (distinct tokens have distinct strings)."""
    tokenizer = server.state.primary.tokenizer.tokenizer
    return [token_string(tokenizer.token_bytes(i)) for i in ids]


def expected_tokens(adapters, which: int | None, prompt: list[int], steps: int) -> list[int]:
    """PEFT's greedy tokens with adapter `which` (None: the base model)."""
    if which is None:
        with adapters[0][1].disable_adapter():
            return hf_greedy(adapters[0][1], prompt, steps)
    return hf_greedy(adapters[which][1], prompt, steps)


def test_completions_with_each_adapter_and_the_base_model_match_peft(server, client, adapters):
    names = ["adapter1", "adapter2", server.state.model_name]
    expected = [expected_tokens(adapters, which, PROMPT, STEPS) for which in (0, 1, None)]
    assert len({tuple(e) for e in expected}) == 3  # the adapters change the greedy tokens

    def complete(name: str):
        return client.completions.create(model=name, prompt=PROMPT, max_tokens=STEPS, temperature=0, logprobs=1,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(3) as pool:  # concurrent: one batch may mix the adapters and the base model
        responses = list(pool.map(complete, names))
    for name, want, response in zip(names, expected, responses, strict=True):
        assert response.model == name  # vLLM's: the adapter's name
        assert response.choices[0].logprobs.tokens == token_strings(server, want), name
    streamed = client.completions.create(model="adapter2", prompt=PROMPT, max_tokens=STEPS, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == responses[1].choices[0].text


def test_chat_with_an_adapter_matches_peft(server, client, adapters):
    messages = [{"role": "user", "content": "Hello there"}]
    prompt = httpx.post(f"{server.url}/tokenize", json={"model": "adapter2", "messages": messages},
                        timeout=30).json()["tokens"]
    want = expected_tokens(adapters, 1, prompt, 4)
    response = client.chat.completions.create(model="adapter2", messages=messages, max_tokens=4, temperature=0,
                                              logprobs=True, extra_body={"ignore_eos": True})
    assert response.model == "adapter2"
    tokenizer = server.state.primary.tokenizer.tokenizer
    assert [bytes(t.bytes) for t in response.choices[0].logprobs.content] == [tokenizer.token_bytes(i)
                                                                                 for i in want]


def test_models_lists_the_adapters_after_the_base_model(server, client, adapters):
    base = server.state.model_name
    cards = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == [base, "adapter1", "adapter2"]
    assert cards[0]["parent"] is None
    for card, (path, _) in zip(cards[1:], adapters, strict=True):
        assert (card["object"], card["root"], card["parent"]) == ("model", str(path), base)
    assert [m.id for m in client.models.list()] == [base, "adapter1", "adapter2"]
    with pytest.raises(openai.NotFoundError, match="adapter3"):
        client.completions.create(model="adapter3", prompt=PROMPT, max_tokens=1)


def test_adapters_load_and_unload_at_run_time(server, client, adapters, tmp_path):
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating): a loaded
    adapter serves PEFT's tokens under its name until it is unloaded; the name can then load another adapter."""
    def post(route: str, **body) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{route}_lora_adapter", json=body, timeout=60)

    def complete(name: str) -> list[str]:
        response = client.completions.create(model=name, prompt=PROMPT, max_tokens=STEPS, temperature=0,
                                             logprobs=1, extra_body={"ignore_eos": True})
        assert response.model == name
        return response.choices[0].logprobs.tokens

    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(spec["paths"])
    r = post("load", lora_name="runtime", lora_path=str(adapters[1][0]))
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'runtime' added successfully.")
    assert complete("runtime") == token_strings(server, expected_tokens(adapters, 1, PROMPT, STEPS))
    assert [m.id for m in client.models.list()][-1] == "runtime"
    for body, status, message in [
        (dict(lora_name="runtime", lora_path=str(adapters[0][0])), 400, "The lora adapter 'runtime' has already"),
        (dict(lora_name="adapter1", lora_path=str(adapters[0][0])), 400, "'adapter1' has already been loaded"),
        (dict(lora_name="bad", lora_path=str(tmp_path)), 400, "not a LoRA adapter directory"),
        (dict(lora_name="bad"), 400, "'lora_path' is a required field"),
        (dict(lora_name="bad", lora_path=str(adapters[0][0]), base_model_name="nope"), 404, "`nope` does not exist"),
    ]:
        r = post("load", **body)
        assert r.status_code == status and message in r.json()["error"]["message"], (body, r.text)
    assert "bad" not in [m.id for m in client.models.list()]
    r = post("unload", lora_name="runtime")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'runtime' removed successfully.")
    with pytest.raises(openai.NotFoundError, match="runtime"):
        complete("runtime")
    r = post("unload", lora_name="runtime")
    assert r.status_code == 404 and "The lora adapter 'runtime' cannot be found." in r.json()["error"]["message"]
    assert post("load", lora_name="runtime", lora_path=str(adapters[0][0])).status_code == 200  # another adapter
    assert complete("runtime") == token_strings(server, expected_tokens(adapters, 0, PROMPT, STEPS))
    assert post("unload", lora_name="runtime").status_code == 200


def test_lora_module_forms():
    assert parse_lora_module("sql=/a/b=c") == LoraModule("sql", "/a/b=c")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoraModule("x", "/p", "m")
    assert parse_lora_module('{"name": "x", "path": "/p"}') == LoraModule("x", "/p")
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/p", '{"name": "b", "path": "/q"}',
                                      "--lora-modules", "c=/r"])
    assert [m.name for m in args.lora_modules] == ["a", "b", "c"]


@pytest.mark.parametrize("value, message", [
    ("adapter", "expected NAME=PATH or a JSON object"),
    ("=/p", "expected NAME=PATH"),
    ("a=", "expected NAME=PATH"),
    ('{"name": "x"', "is not valid JSON"),
    ('{"name": "x"}', "'path' must be a non-empty string"),
    ('{"name": "x", "path": "/p", "rank": 4}', "unknown key 'rank'"),
])
def test_lora_module_parse_errors(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--lora-modules", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lora-modules" in err and message in err


@pytest.mark.parametrize("models, modules, message", [
    ([("m", False)], [LoraModule("a", "/p")], "--lora-modules needs --enable-lora: adapter 'a' is for the model 'm'"),
    ([("m", True)], [LoraModule("a", "/p"), LoraModule("a", "/q")], "several adapters are named 'a'"),
    ([("m", True)], [LoraModule("m", "/p")], "'m' is the name of a served model"),
    ([("m", True)], [LoraModule("a", "/p", "other")], "base_model_name 'other', which is not a served model"),
    ([("m", True), ("n", False)], [LoraModule("a", "/p", "n")], "adapter 'a' is for the model 'n'"),
])
def test_adapter_assignment_errors(models, modules, message):
    served = [ServedModel(name, EngineConfig(model="/x", enable_lora=lora)) for name, lora in models]
    with pytest.raises(ValueError, match=message):
        ServerState(served, ServerSettings(lora_modules=tuple(modules)))


def test_adapters_belong_to_the_first_model_unless_named():
    served = [ServedModel(name, EngineConfig(model="/x", enable_lora=True)) for name in ("m", "n")]
    state = ServerState(served, ServerSettings(lora_modules=(LoraModule("a", "/p"), LoraModule("b", "/q", "n"))))
    assert state.adapters["a"] is state.models["m"] and state.adapters["b"] is state.models["n"]
    assert (state.models["m"].loras["a"].lora_int_id, state.models["n"].loras["b"].lora_int_id) == (1, 2)


def test_cli_without_enable_lora_is_an_error(capsys):
    assert main(["serve", "--model", "/m", "--lora-modules", "a=/p"]) == 2
    assert "jserve: error: --lora-modules needs --enable-lora" in capsys.readouterr().err
    assert main(["serve", "--model", "/m", "--allow-runtime-lora-updating"]) == 2
    assert "jserve: error: --allow-runtime-lora-updating needs --enable-lora" in capsys.readouterr().err


def test_generate_runs_each_line_with_the_adapter_it_names(model_dir, adapters, tmp_path, capsys):
    """`jserve generate --lora-modules`: a line's `model` picks its adapter (none: the base model); the results are
    PEFT's greedy tokens and name the adapter; a line naming no such adapter is skipped with the reason."""
    lines = [{"id": "one", "prompt": PROMPT, "model": "adapter1"}, {"id": "two", "prompt": PROMPT, "model": "adapter2"},
             {"id": "base", "prompt": PROMPT}, {"id": "nope", "prompt": PROMPT, "model": "adapter3"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({**line, "temperature": 0, "max_tokens": STEPS,
                                                            "ignore_eos": True}) + "\n" for line in lines))
    flags = ["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
             "--no-warmup", "--compilation-cache-dir", "", "--max-model-len", "256", "--kv-cache-memory-bytes",
             str(4 << 20), "--lora-modules", f"adapter1={adapters[0][0]}", f"adapter2={adapters[1][0]}"]
    assert main(["generate", *flags]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert main(["generate", *flags, "--enable-lora", "--max-lora-rank", "8"]) == 0
    assert "skipping request nope: model 'adapter3' is not a LoRA adapter of --lora-modules" in capsys.readouterr().err
    results = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert set(results) == {"one", "two", "base"}
    for key, which in (("one", 0), ("two", 1), ("base", None)):
        assert results[key]["choices"][0]["token_ids"] == expected_tokens(adapters, which, PROMPT, STEPS), key
        assert results[key].get("model") == (None if which is None else f"adapter{which + 1}")


def test_cli_bad_adapter_fails_start_up(model_dir, tmp_path, caplog):
    """An adapter that cannot load stops `jserve serve` at start-up (exit 2) with the LoRAError's message."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["serve", "--model", str(model_dir), "--port", str(port), "--no-warmup", "--compilation-cache-dir", "",
            "--max-model-len", "256", "--kv-cache-memory-bytes", str(4 << 20), "--enable-lora", "--max-lora-rank", "8",
            "--lora-modules", f"bad={bad}"]
    with caplog.at_level(logging.ERROR, logger="jserve.server.cli"):
        assert main(argv) == 2
    assert f"LoRA adapter 'bad': {bad}: no adapter_model.safetensors" in caplog.text
