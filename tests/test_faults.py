"""Fault containment: a failed engine step fails only the requests it held (OpenAI-shaped 500s, in-band for streams),
the engine rebuilds its KV cache and serves on; repeated failures or a failed recovery fail everything with 503s, mark
the server dead and make `jserve serve` exit non-zero; the offline LLM raises EngineStepError and then works; a
multi-host follower exits when its leader fails.

Faults are injected by monkeypatching the engine's executor (or tokenizer) of a running server."""

from __future__ import annotations

import json
import subprocess
import threading

import httpx
import jax
import openai
import pytest
from jax.errors import JaxRuntimeError
from server_helpers import TEST_ENGINE_ARGS, ServerThread, metric_values, wait_until

from jserve.config import EngineConfig
from jserve.sampling_params import SamplingParams
from jserve.server.settings import ServerSettings

# Several KV blocks long, so a later request finds its blocks in the prefix cache (until a recovery forgets them).
PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n" * 3
BODY = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(EngineConfig(model=str(model_dir), **TEST_ENGINE_ARGS),
                       ServerSettings(max_step_failures=1000)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(server) -> str:
    """The greedy completion of BODY before any fault (it also leaves PROMPT's blocks in the prefix cache, which
    a recovery must forget: they point into the cache it replaces)."""
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def fail_device_call(monkeypatch, engine, at_call: int, error: Exception, *, consume_cache: bool = True) -> list:
    """Make the executor's at_call-th device call from now (a step or a decode burst) raise `error` after the device
    ran it; with consume_cache its KV cache is gone, as after a donated call that failed. Returns the call log."""
    executor, calls = engine.executor, []

    def wrap(real):
        def call(*args, **kwargs):
            calls.append(real.__name__)
            out = real(*args, **kwargs)
            if len(calls) == at_call:
                if consume_cache:
                    for array in jax.tree.leaves(executor.kv_cache):
                        array.delete()
                raise error
            return out
        return call

    monkeypatch.setattr(executor, "execute", wrap(executor.execute))
    monkeypatch.setattr(executor, "execute_burst", wrap(executor.execute_burst))
    return calls


def openai_client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, _strict_response_validation=True)


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def assert_serves(srv: ServerThread, reference: str) -> None:
    """Healthy, and the next request gets exactly the greedy text a fault-free server gave."""
    health = httpx.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    out = openai_client(srv).completions.create(model=srv.state.model_name, **{k: v for k, v in BODY.items()
                                                                               if k != "ignore_eos"},
                                                 extra_body={"ignore_eos": True})
    assert out.choices[0].text == reference and out.usage.completion_tokens == BODY["max_tokens"]
    # Nothing is left behind: no request, no KV block (the prompt's blocks stay cached, and free).
    assert wait_until(lambda: srv.state.engine.snapshot.num_unfinished_requests == 0, 10)
    snapshot = srv.state.engine.snapshot
    assert snapshot.num_free_blocks == snapshot.num_blocks, snapshot


def test_failed_step_is_a_500_and_the_server_goes_on(server, reference, monkeypatch):
    engine = server.state.engine.engine
    failures = metric_values(server.url).get("jserve:engine_step_failures_total", 0)
    calls = fail_device_call(monkeypatch, engine, 3, RuntimeError("injected step failure"))
    with pytest.raises(openai.InternalServerError) as info:
        openai_client(server).chat.completions.create(model=server.state.model_name, max_tokens=40,
                                                      messages=[{"role": "user", "content": "hi"}],
                                                      extra_body={"ignore_eos": True})
    assert len(calls) == 3
    error = info.value.response.json()["error"]
    assert info.value.status_code == 500 and error["type"] == "internal_error"
    assert error["code"] == "engine_step_failed" and "injected step failure" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert metric_values(server.url)["jserve:engine_step_failures_total"] == failures + 1
    monkeypatch.undo()
    assert_serves(server, reference)


def test_failed_step_ends_a_stream_in_band(server, reference, monkeypatch):
    fail_device_call(monkeypatch, server.state.engine.engine, 4, RuntimeError("injected mid-stream"))
    body = {**BODY, "max_tokens": 60, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("choices" in c for c in chunks[:-1]) and len(chunks) > 1  # tokens streamed before the failure
    error = chunks[-1]["error"]
    assert error["type"] == "internal_error" and "injected mid-stream" in error["message"]
    # The official client raises the in-band error.
    fail_device_call(monkeypatch, server.state.engine.engine, 2, RuntimeError("injected again"))
    stream = openai_client(server).completions.create(model=server.state.model_name, prompt=PROMPT, max_tokens=60,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError, match="injected again"):
        for _ in stream:
            pass
    monkeypatch.undo()
    assert_serves(server, reference)


def test_device_out_of_memory_is_recovered(server, reference, monkeypatch):
    oom = JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.")
    old_cache = jax.tree.leaves(server.state.engine.engine.executor.kv_cache)
    fail_device_call(monkeypatch, server.state.engine.engine, 1, oom)
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 500 and "RESOURCE_EXHAUSTED" in r.json()["error"]["message"]
    new_cache = jax.tree.leaves(server.state.engine.engine.executor.kv_cache)
    assert all(a.is_deleted() for a in old_cache) and not any(a.is_deleted() for a in new_cache)
    assert [(a.shape, a.dtype, a.sharding) for a in new_cache] == [(a.shape, a.dtype, a.sharding) for a in old_cache]
    monkeypatch.undo()
    assert_serves(server, reference)


def test_tokenizer_failing_to_detokenize_fails_only_that_request(server, reference, monkeypatch):
    tokenizer, armed = server.state.engine.engine.tokenizer, threading.Event()
    real_decode = tokenizer.decode

    def decode(*args, **kwargs):
        if armed.is_set():
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", decode)
    events = []
    body = {**BODY, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                armed.set()  # the request is generating: its next detokenization fails
    assert len(events) >= 3 and "choices" in json.loads(events[0]) and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_error" and "UnicodeDecodeError" in error["message"]
    monkeypatch.undo()
    assert_serves(server, reference)


def test_failure_limit_and_failed_recovery_make_the_server_dead(model_dir, monkeypatch):
    srv = ServerThread(EngineConfig(model=str(model_dir), **TEST_ENGINE_ARGS),
                       ServerSettings(max_step_failures=1, step_failure_window_s=600)).start()
    fatal = []
    srv.state.on_fatal = fatal.append
    try:
        engine = srv.state.engine.engine
        fail_device_call(monkeypatch, engine, 1, RuntimeError("first"))
        assert httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=60).status_code == 500
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}  # one failure: recovered
        fail_device_call(monkeypatch, engine, 1, RuntimeError("second"))
        r = httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "2 engine steps failed" in r.json()["error"]["message"]
        assert wait_until(lambda: fatal, 10) and "second" in str(fatal[0])
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert "2 engine steps failed" in health.json()["reason"]
        after = httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=60)
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
    finally:
        srv.stop()


def test_cli_serve_exits_non_zero_when_recovery_fails(model_dir, monkeypatch):
    """`jserve serve` itself (in a thread: uvicorn leaves signals alone off the main thread): a failed step whose
    recovery fails too ends the process's server with EXIT_ENGINE_FAILED."""
    import jserve.engine.data_parallel as engine_module
    from jserve.cli import build_parser
    from jserve.server.cli import EXIT_ENGINE_FAILED

    real_create, engines = engine_module.create_engine, []

    def create(config):
        engine = real_create(config)
        engines.append(engine)
        return engine

    def no_recovery(error):
        raise RuntimeError("cannot rebuild the cache")

    monkeypatch.setattr(engine_module, "create_engine", create)
    port = _free_port()
    args = build_parser().parse_args(
        ["serve", "--model", str(model_dir), "--port", str(port), "--max-model-len", "512", "--kv-cache-memory-bytes",
         str(4 << 20), "--max-num-batched-tokens", "128", "--no-warmup", "--compilation-cache-dir", "",
         "--log-level", "warning"])
    result = []
    thread = threading.Thread(target=lambda: result.append(args.run(args)), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _healthy(url), 120)
        fail_device_call(monkeypatch, engines[0], 1, RuntimeError("device lost"))
        monkeypatch.setattr(engines[0], "recover", no_recovery)
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 503 and "cannot rebuild the cache" in r.json()["error"]["message"]
        thread.join(60)
        assert result == [EXIT_ENGINE_FAILED]
    finally:
        thread.join(60)


@pytest.mark.parametrize("executor", ["auto", "xla"])  # the CPU layer executor's stacked cache, XLA's per layer
def test_offline_llm_raises_then_works(model_dir, llm_factory, monkeypatch, executor):
    from jserve.llm import EngineStepError

    llm = llm_factory(model_dir, max_num_seqs=8, executor=executor)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [PROMPT, "import numpy as np"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    fail_device_call(monkeypatch, llm.engine, 2, JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"))
    with pytest.raises(EngineStepError, match="RESOURCE_EXHAUSTED") as info:
        llm.generate(prompts, params, use_tqdm=False)
    assert isinstance(info.value.__cause__, JaxRuntimeError)
    assert not llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_offline_llm_survives_a_tokenizer_that_fails(model_dir, llm_factory, monkeypatch):
    """The offline API decodes each text once, when its request ends: a decode that raises there fails the step, and
    dropping the request (whose text cannot be decoded either) must not fail the recovery."""
    from jserve.llm import EngineStepError

    llm = llm_factory(model_dir, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([PROMPT, "x = 1"], params, use_tqdm=False)

    tokenizer, engine, armed = llm.engine.tokenizer, llm.engine, threading.Event()
    real_decode, real_step = tokenizer.decode, engine.step

    def decode(*args, **kwargs):
        if armed.is_set():  # not while the requests are added (a prompt that cannot be decoded is rejected)
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_decode(*args, **kwargs)

    def step():
        armed.set()
        return real_step()

    monkeypatch.setattr(tokenizer, "decode", decode)
    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(EngineStepError, match="UnicodeDecodeError"):
        llm.generate([PROMPT, "x = 1"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    again = llm.generate([PROMPT, "x = 1"], params, use_tqdm=False)
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in expected]


def test_recovery_keeps_the_requests_outside_the_failed_step(model_dir, llm_factory, monkeypatch):
    """A request running beside the failed step (not in it) is preempted, recomputes into the new cache and ends
    with exactly its fault-free tokens; the failed step's request is dropped."""
    llm = llm_factory(model_dir, max_num_seqs=8)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = llm.generate(["import numpy as np"], params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("kept", "import numpy as np", params)
    engine.add_request("failed", PROMPT, params)
    for _ in range(3):
        engine.step()
    engine._step_requests = {"failed"}  # as if the step that raised held only "failed"
    assert engine.recover(RuntimeError("injected")) == ["failed"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.block_manager.hash_to_block == {}
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(outputs) == ["kept"] and outputs["kept"].outputs[0].token_ids == expected


def test_follower_exits_when_the_leader_fails():
    from jserve.distributed import LEADER_FAILED, LeaderFailedError, MultiHostExecutor

    class Channel:
        def __init__(self, messages):
            self.messages = list(messages)

        def receive(self):
            message = self.messages.pop(0)
            if isinstance(message, Exception):
                raise message
            return message

    ran = []
    follower = MultiHostExecutor.__new__(MultiHostExecutor)  # no runtime to join: only the follow loop runs
    follower.run = ran.append
    follower.channel = Channel([LEADER_FAILED + b"out of memory"])
    with pytest.raises(LeaderFailedError, match="the leader failed: out of memory"):
        follower.follow()
    follower.channel = Channel([RuntimeError("UNAVAILABLE: the coordination service is gone")])
    with pytest.raises(LeaderFailedError, match="coordination service is gone"):
        follower.follow()
    follower.channel = Channel([None])
    follower.follow()  # the leader's orderly stop
    assert ran == []

    published = []
    leader = MultiHostExecutor.__new__(MultiHostExecutor)
    leader.is_leader, leader.channel = True, type("C", (), {"publish": lambda self, m: published.append(m)})()
    with pytest.raises(LeaderFailedError):
        leader.reset_kv_cache()  # followers may be stuck in the failed step's collectives: no recovery
    assert published and published[0].startswith(LEADER_FAILED) and not leader.is_leader


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_follower_exits_when_a_real_leader_fails(hf_model_dir):
    """Two jax.distributed processes (tests/multihost_worker.py): the leader's step fails, which multi-host serving
    does not recover from; the follower is told and exits non-zero at once, not after the heartbeat timeout."""
    from test_sharding import _start_pair  # the two-process harness of the multi-host tests

    procs = _start_pair(hf_model_dir("llama", num_attention_heads=8), "fail")
    try:
        leader_out, leader_err = procs[0].communicate(timeout=240)
        assert procs[0].returncode == 1 and "LEADER FAILED" in leader_out, leader_err[-3000:]
        assert "multi-host serving does not recover" in leader_out
        try:
            _, follower_err = procs[1].communicate(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the follower kept waiting after its leader failed") from None
        assert procs[1].returncode != 0
        assert "LeaderFailedError: the leader failed: a step failed" in follower_err, follower_err[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_failure_limit_settings_are_validated():
    from jserve.cli import build_parser

    with pytest.raises(ValueError, match="max_step_failures"):
        ServerSettings(max_step_failures=-1)
    with pytest.raises(ValueError, match="step_failure_window_s"):
        ServerSettings(step_failure_window_s=0)
    args = build_parser().parse_args(["serve", "--max-step-failures", "0", "--step-failure-window", "5"])
    assert (args.max_step_failures, args.step_failure_window) == (0, 5.0)
    for bad in (["--max-step-failures", "-1"], ["--step-failure-window", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
