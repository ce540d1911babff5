"""Several models on one server: two copies of the bundled demo model under different names and settings, routed
by the requests' `model` field, each with its own engine, KV budget and metrics label; the fallback model; the
KV-cache split; `jserve serve`'s flags for several models."""

from __future__ import annotations

import json
import logging
import socket
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerThread, wait_until

from checkpoints import DEMO_MODEL_DIR
from jserve.cli import build_parser, main
from jserve.config import EngineConfig
from jserve.server.cli import models_from_args
from jserve.server.multi_model import FALLBACK_HEADER, ServedModel, kv_budgets, plan_kv_budgets
from jserve.server.settings import ServerSettings
from jserve.server.state import ServerState

PROMPT = "def fibonacci(n):"
# A has one seat and no queue (so a second request is over its limit and falls back to B); B runs in bfloat16
# with a shorter context.
COMMON = dict(model=str(DEMO_MODEL_DIR), max_num_batched_tokens=64, warmup=False, compilation_cache_dir="")
SETTINGS = {"demo-a": dict(COMMON, max_model_len=256, max_num_seqs=1, kv_cache_memory_bytes=2 << 20),
            "demo-b": dict(COMMON, max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=1 << 20,
                           dtype="bfloat16")}


@pytest.fixture(scope="module")
def server():
    models = [ServedModel(name, EngineConfig(**kw)) for name, kw in SETTINGS.items()]
    srv = ServerThread(models, ServerSettings(max_queued_requests=0, fallback_model="demo-b")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_model_serves_its_own_greedy_text(server, client, llm_factory, name):
    from jserve import SamplingParams

    settings = {k: v for k, v in SETTINGS[name].items() if k != "model"}
    want = llm_factory(DEMO_MODEL_DIR, **settings).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0)
    assert got.model == name and got.choices[0].text == want
    streamed = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    engine = server.state.models[name].engine.engine
    assert engine.max_model_len == SETTINGS[name]["max_model_len"]
    assert engine.config.kv_cache_memory_bytes == SETTINGS[name]["kv_cache_memory_bytes"]


def test_models_listed_and_unknown_model_is_404(server, client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == set(SETTINGS)
    assert {name: card.max_model_len for name, card in cards.items()} == {"demo-a": 256, "demo-b": 128}
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.code == "model_not_found"
    # tokenize routes by model too, and a request without one goes to the first model
    assert httpx.post(f"{server.url}/tokenize", json={"model": "demo-b", "prompt": "hi"}).json()["max_model_len"] \
        == 128
    assert client.completions.create(model=None, prompt="hi", max_tokens=1).model == "demo-a"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_metrics_carry_each_models_label(server, client):
    for name in SETTINGS:
        client.completions.create(model=name, prompt="x", max_tokens=2)
    families = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # each family once, with every model's samples
    tokens = {s.labels["model_name"]: s.value for f in families if f.name == "jserve:generation_tokens"
              for s in f.samples}
    assert set(tokens) == set(SETTINGS) and all(v >= 2 for v in tokens.values())


def test_over_its_queue_limit_a_request_falls_back(server, client, monkeypatch):
    # A's engine is held before each step, so a first request keeps A's only seat.
    engine, release = server.state.models["demo-a"].engine.engine, threading.Event()
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: release.wait(60) and step())
    try:
        body = {"model": "demo-a", "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60):
            assert wait_until(lambda: server.state.models["demo-a"].engine.num_in_flight == 1, 30)
            raw = client.completions.with_raw_response.create(model="demo-a", prompt=PROMPT, max_tokens=4)
            assert raw.headers[FALLBACK_HEADER] == "demo-a" and raw.parse().model == "demo-b"
            with client.chat.completions.with_streaming_response.create(
                    model="demo-a", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True) as s:
                assert s.headers[FALLBACK_HEADER] == "demo-a"
                assert {chunk.model for chunk in s.parse()} == {"demo-b"}
            release.set()
    finally:
        release.set()
    assert wait_until(lambda: server.state.models["demo-a"].engine.num_in_flight == 0, 10)  # the stream closed
    plain = client.completions.with_raw_response.create(model="demo-a", prompt=PROMPT, max_tokens=2)
    assert FALLBACK_HEADER not in plain.headers and plain.parse().model == "demo-a"


def test_health_is_ready_only_when_every_model_is():
    state = ServerState([ServedModel(name, EngineConfig(**kw)) for name, kw in SETTINGS.items()], ServerSettings())
    assert state.health() == ("loading", "demo-a: the model is still loading")
    for model in state.models.values():
        model.engine, model.tokenizer = SimpleNamespace(error=None, healthy=True), object()
        if model.name == "demo-a":
            assert state.health() == ("loading", "demo-b: the model is still loading")
    assert state.health() == ("ready", None)
    state.models["demo-b"].engine.error = RuntimeError("boom")
    assert state.health() == ("dead", "demo-b: the engine stopped: RuntimeError: boom")


# ----- the KV-cache split -----

def test_kv_budgets_split_check_and_log(caplog):
    with caplog.at_level(logging.INFO, logger="jserve.server.multi_model"):
        assert kv_budgets([None, None], None, 10 << 30, 0.8, 1 << 30) == [1 << 29, 1 << 29]
    assert "split evenly" in caplog.text
    assert kv_budgets([100, None], 1000, 1000, 0.5, 0) == [100, 400]  # 50% of the device's free memory
    with pytest.raises(ValueError, match="need 3000 bytes together"):
        kv_budgets([1000, 2000], None, 2500, 0.8, 1 << 30)
    with pytest.raises(ValueError, match="leaving nothing"):
        kv_budgets([1 << 30, None], None, 10 << 30, 0.8, 1 << 30)
    with pytest.raises(ValueError, match="only .* bytes are available"):
        plan_kv_budgets([ServedModel("a", EngineConfig(kv_cache_memory_bytes=1 << 60)),
                         ServedModel("b", EngineConfig(kv_cache_memory_bytes=1 << 20))])


def test_kv_budgets_over_memory_stop_the_start_up():
    models = [ServedModel(name, EngineConfig(**{**kw, "kv_cache_memory_bytes": 1 << 60})) for name, kw in
              SETTINGS.items()]
    srv = ServerThread(models, ServerSettings())
    try:
        with pytest.raises(RuntimeError, match="KV caches need .* bytes together .* only .* bytes are available"):
            srv.start()
        assert httpx.get(f"{srv.url}/health").json()["status"] == "dead"
    finally:
        srv.stop()


# ----- jserve serve's flags -----

def parse(*argv: str):
    return models_from_args(build_parser().parse_args(["serve", *argv]))


def test_cli_several_models(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="jserve.server.cli"):
        models = parse("--model", "/m/a", "--model", "/m/b/", "--kv-cache-memory-bytes", "1000", "--fallback", "b")
    assert [(m.name, m.config.model, m.config.kv_cache_memory_bytes) for m in models] == \
        [("a", "/m/a", 500), ("b", "/m/b/", 500)]
    assert "split evenly" in caplog.text
    models = parse("--model", "x/demo", "--model", "y/demo", "--served-model-name", "one", "--served-model-name",
                   "two", "--kv-cache-memory-bytes", "10", "--kv-cache-memory-bytes", "20", "--max-model-len", "64")
    assert [(m.name, m.config.kv_cache_memory_bytes, m.config.max_model_len) for m in models] == \
        [("one", 10, 64), ("two", 20, 64)]
    single = parse("--model", "/m/a", "--served-model-name", "x")  # one model: as it always was
    assert isinstance(single, EngineConfig) and single.model == "/m/a"
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"model": "/m/a", "max_model_len": 32},
                                             {"model": "/m/b", "served_model_name": "bee", "dtype": "bfloat16"}]}))
    models = parse("--config", str(config), "--max-num-seqs", "3")
    assert [(m.name, m.config.max_model_len, m.config.dtype, m.config.max_num_seqs) for m in models] == \
        [("a", 32, "float32", 3), ("bee", None, "bfloat16", 3)]
    (tmp_path / "models.yaml").write_text("models:\n  - {model: /m/a, kv_cache_memory_bytes: 1000}\n"
                                          "  - {model: /m/b, served_model_name: bee}\n")
    models = parse("--config", str(tmp_path / "models.yaml"), "--fallback", "bee")
    assert [(m.name, m.config.kv_cache_memory_bytes) for m in models] == [("a", 1000), ("bee", None)]


@pytest.mark.parametrize("argv, message", [
    (["--model", "a", "--model", "b", "--served-model-name", "x"], "given 1 times for 2 models"),
    (["--model", "a", "--model", "b", "--kv-cache-memory-bytes", "1", "--kv-cache-memory-bytes", "2",
      "--kv-cache-memory-bytes", "3"], "given 3 times for 2 models"),
    (["--model", "x/demo", "--model", "y/demo"], "several models are served as 'demo'"),
    (["--model", "a", "--model", "b", "--fallback", "c"], "fallback model 'c' is not one of"),
    (["--model", "a", "--fallback", "a"], "--fallback needs several models"),
    (["--config", "models.json", "--model", "a"], "--config lists the models"),
])
def test_cli_errors(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, text, message", [
    ("models.yaml", "models: [\n", "models.yaml: not valid YAML"),
    ("models.json", '{"models": [', "models.json: Expecting value"),
    ("models.yaml", "models:\n  - {model: /m/a, max_model_len: abc}\n", "models.yaml: models[0]: max_model_len"),
])
def test_cli_config_file_errors(name, text, message, tmp_path, capsys):
    """A config file that does not parse, or holds a bad value, is a usage error naming the file (exit 2), as
    unknown settings are; never a traceback."""
    (tmp_path / name).write_text(text)
    assert main(["serve", "--config", str(tmp_path / name)]) == 2
    assert message in capsys.readouterr().err


def test_cli_names_the_model_that_failed_to_load(caplog):
    """On a several-model server the start-up failure names the model whose KV budget is too small."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["serve", "--port", str(port), "--no-warmup", "--compilation-cache-dir", "", "--max-model-len", "64"]
    for name, budget in (("a", 1 << 20), ("b", 1000)):
        argv += ["--model", str(DEMO_MODEL_DIR), "--served-model-name", name, "--kv-cache-memory-bytes", str(budget)]
    with caplog.at_level(logging.ERROR, logger="jserve.server.cli"):
        assert main(argv) == 2
    assert "jserve: the model b failed to load: KV cache budget of 1000 bytes" in caplog.text
