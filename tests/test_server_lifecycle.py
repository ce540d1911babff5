"""Server life: overload (429), a model that fails to load, an engine that dies mid-stream, and `jserve serve`
draining running requests on SIGTERM. Each uses its own small server (the shared one must stay healthy)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from server_helpers import TEST_ENGINE_ARGS, ServerThread, wait_until

from jserve.config import EngineConfig
from jserve.server.settings import ServerSettings

LONG = {"prompt": "def fibonacci(n):", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def tiny_server(model_dir):
    # One running sequence and no queue: a second concurrent request is over capacity.
    config = EngineConfig(model=str(model_dir), **{**TEST_ENGINE_ARGS, "max_num_seqs": 1})
    srv = ServerThread(config, ServerSettings(max_queued_requests=0)).start()
    yield srv
    srv.stop()


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_queue_full_is_429_with_retry_after(tiny_server, monkeypatch):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0,
                           _strict_response_validation=True)
    # The engine is held before each step until the over-capacity requests have been answered: the first request
    # keeps the only place however fast the model runs (on a busy machine its 400 tokens could end first).
    engine, release = tiny_server.state.engine.engine, threading.Event()
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: release.wait(60) and step())
    try:
        with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=LONG, timeout=60) as running:
            assert wait_until(lambda: tiny_server.state.engine.num_in_flight == 1, 30.0)  # the only place is taken
            raw = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert raw.status_code == 429 and raw.headers["retry-after"] == "1"
            assert raw.json()["error"]["code"] == "rate_limit_exceeded"
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model=tiny_server.state.model_name, max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
            release.set()
            events = sse_events(running)  # kept alive: dropping the iterator would close the connection
            assert next(events)  # the first request runs once the engine steps again
    finally:
        release.set()
    # Closing the stream aborted it, which frees the place again.
    assert wait_until(lambda: tiny_server.state.engine.num_in_flight == 0, 2.0)
    done = client.completions.create(model=tiny_server.state.model_name, prompt="hi", max_tokens=2)
    assert done.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="admits at most 1"):
        client.completions.create(model=tiny_server.state.model_name, prompt="hi", max_tokens=2, n=2)


def test_engine_failure_mid_stream_is_reported_in_band(tiny_server, monkeypatch):
    engine = tiny_server.state.engine.engine
    real_step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) > 3:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    monkeypatch.setattr(tiny_server.state.engine, "max_step_failures", 0)  # no recovery: the first failure is fatal
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "device lost" in error["message"] and error["type"] == "service_unavailable"
    health = httpx.get(f"{tiny_server.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "dead" and "device lost" in health.json()["reason"]
    after = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"


def test_health_is_503_while_the_model_loads(model_dir, monkeypatch):
    import jserve.engine.data_parallel as engine_module

    release, real_engine = threading.Event(), engine_module.create_engine

    def slow_engine(config):
        release.wait(60)
        return real_engine(config)

    monkeypatch.setattr(engine_module, "create_engine", slow_engine)
    srv = ServerThread(EngineConfig(model=str(model_dir), **TEST_ENGINE_ARGS), ServerSettings())
    srv.thread.start()
    try:
        assert wait_until(lambda: srv.server.started, 30)
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "loading" in health.json()["reason"]
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "model_loading"
        release.set()
        assert wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 200, 60)
    finally:
        release.set()
        srv.stop()


def test_model_that_fails_to_load_gives_503(tmp_path):
    srv = ServerThread(EngineConfig(model=str(tmp_path / "missing"), **TEST_ENGINE_ARGS), ServerSettings())
    srv.thread.start()
    try:
        assert wait_until(lambda: srv.state.load_error is not None, 30)
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    finally:
        srv.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_drains_running_requests_on_sigterm(model_dir):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "jserve", "serve", "--model", str(model_dir), "--port", str(port),
            "--max-model-len", "512", "--kv-cache-memory-bytes", str(4 << 20), "--max-num-batched-tokens", "128",
            "--no-warmup", "--compilation-cache-dir", "", "--shutdown-timeout", "60"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        assert wait_until(lambda: _healthy(url), 120), "jserve serve did not become healthy"
        events, first = [], threading.Event()

        def consume():
            body = {**LONG, "max_tokens": 40}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for event in sse_events(r):
                    events.append(event)
                    first.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: not _accepting(port), 10), "still accepting connections after SIGTERM"
        reader.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert '"POST /v1/completions" 200' in log  # the access log line, written when the stream ended


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
