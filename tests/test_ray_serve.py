"""jserve on Ray Serve (jserve/server/ray_serve.py): a local Ray cluster, two replicas of the demo model behind
Ray's HTTP proxy, 64 concurrent streams with the greedy text of the model alone, and a replica killed under load
(no request lost that had not begun streaming; Ray brings the replica back), and a scale-down that drains the
streams running on the replica it stops.

The cluster tests need `pip install -e ".[ray]"` (the test extra has it) and are skipped without Ray; they take
about 80 s on 2 cores. Run them alone: `python3 -m pytest -q -m ray tests/test_ray_serve.py`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import time

import httpx
import pytest

from checkpoints import DEMO_MODEL_DIR
from jserve.config import EngineConfig
from jserve.server.ray_serve import RayOptions, deployment_options, parse_args
from jserve.server.settings import ServerSettings

# Ray is imported by the cluster fixture, not at collection, so a run that leaves these tests out never imports it.
HAVE_RAY = importlib.util.find_spec("ray") is not None


def needs_ray(test):
    skip = pytest.mark.skipif(not HAVE_RAY, reason="Ray is not installed: pip install -e '.[ray]'")
    # Ray Serve's own pydantic models warn on import; not ours to fix.
    quiet = pytest.mark.filterwarnings("ignore::DeprecationWarning")
    return pytest.mark.ray(skip(quiet(test)))

ENGINE = dict(max_model_len=256, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=128, max_num_seqs=16,
              warmup=False, compilation_cache_dir="")
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range("]
MAX_TOKENS = 24
NAME = "demo"
ARGS = {"model": str(DEMO_MODEL_DIR), "served_model_name": NAME, "num_cpus": "1", "health_check_period_s": "2"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(replicas: int) -> dict[str, str]:
    return {**ARGS, "num_replicas": str(replicas), **{k: str(v) for k, v in ENGINE.items()}}


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    from jserve.server.ray_serve import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args(2)), name="jserve", route_prefix="/", blocking=False)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(llm_factory) -> dict[str, str]:
    from jserve import SamplingParams

    llm = llm_factory(DEMO_MODEL_DIR, **ENGINE)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outputs, strict=True)}


class Cut(Exception):
    """The stream broke after it had begun."""


async def stream_once(client: httpx.AsyncClient, url: str, prompt: str) -> str:
    """The streamed text; Cut if it broke after the first chunk, another exception if before."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, started, done = "", False, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                text += "".join(c["text"] for c in event["choices"])
                started = True
    except Exception as e:
        if started:
            raise Cut(str(e)) from e
        raise
    if not done:
        if started:
            raise Cut("the stream ended without [DONE]")
        raise RuntimeError("the stream ended before its first chunk")
    return text


async def run_load(url: str, prompts: list[str], during=None) -> tuple[list[str | None], int, int]:
    """Stream every prompt at once, each retried while it fails before its first chunk; `during` runs once a
    quarter of them have finished. Returns (texts, None where a begun stream was cut; cut count; retries)."""
    results: list[str | None] = [None] * len(prompts)
    finished, retries, cut = 0, 0, 0

    async def one(i: int, client: httpx.AsyncClient) -> None:
        nonlocal finished, retries, cut
        for _ in range(20):
            try:
                results[i] = await stream_once(client, url, prompts[i])
                finished += 1
                return
            except Cut:
                cut += 1
                return
            except Exception:  # noqa: BLE001 - nothing was streamed yet: the client retries
                retries += 1
                await asyncio.sleep(0.5)
        raise AssertionError(f"request {i} failed 20 times before streaming")

    async def trigger() -> None:
        while finished < len(prompts) // 4:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(during)

    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks = [one(i, client) for i in range(len(prompts))] + ([trigger()] if during else [])
        await asyncio.gather(*tasks)
    return results, cut, retries


def replicas() -> set[str]:
    """The live replicas' actor names (in the "serve" namespace)."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::jserve#")}


def test_serve_run_arguments_become_settings():
    config, settings, options = parse_args({"model": "/m", "max_model_len": "512", "enable_prefix_caching": "false",
                                            "served_model_name": "m", "max_queued_requests": "8",
                                            "num_replicas": "auto", "max_replicas": 3, "num_gpus": "1",
                                            "resources": '{"TPU": 4}', "shutdown_timeout": "12"})
    assert (config.model, config.max_model_len, config.enable_prefix_caching) == ("/m", 512, False)
    assert (settings.served_model_name, settings.max_queued_requests) == ("m", 8)
    assert (options.num_replicas, options.max_replicas, options.resources) == ("auto", 3, {"TPU": 4})
    deployment = deployment_options(config, settings, options)
    assert deployment["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 32}
    assert deployment["max_ongoing_requests"] == 32 + 8  # what one replica's engine admits
    assert deployment["graceful_shutdown_timeout_s"] == 12.0  # the server's drain
    actor = deployment["ray_actor_options"]
    assert (actor["num_cpus"], actor["num_gpus"], actor["resources"]) == (1.0, 1.0, {"TPU": 4})
    fixed = deployment_options(EngineConfig(), ServerSettings(), RayOptions(num_replicas=2))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    with pytest.raises(ValueError, match="unknown argument 'replicas'"):
        parse_args({"replicas": "2"})


def test_serve_run_arguments_take_dashes_for_every_name():
    # Every name is read with `_` for `-`, as `jserve serve`'s flags spell them; shutdown_timeout too.
    config, _, options = parse_args({"max-model-len": "256", "shutdown-timeout": "7", "num-replicas": "2"})
    assert (config.max_model_len, options.num_replicas, options.graceful_shutdown_timeout_s) == (256, 2, 7.0)


@needs_ray
def test_64_streams_through_the_proxy_match_the_model_alone(cluster, expected):
    assert httpx.get(f"{cluster}/health").json() == {"status": "ok"}
    # One stream alone: OpenAI's SSE framing through the proxy, a chunk per decode burst (at most 8 tokens).
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as response:
        raw = b"".join(response.iter_raw()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    assert len(events) - 2 >= MAX_TOKENS // 8 and response.headers["x-request-id"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    texts, cut, _ = asyncio.run(run_load(cluster, prompts))
    assert cut == 0 and texts == [expected[p] for p in prompts]


@needs_ray
def test_a_replica_killed_under_load_loses_no_unstarted_request(cluster, expected):
    import ray
    from ray import serve

    before = replicas()
    assert len(before) == 2
    victim = sorted(before)[0]

    def kill() -> None:
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    texts, cut, retries = asyncio.run(run_load(cluster, prompts, during=kill))
    # Every request completed with the model's text, except streams cut mid-way on the killed replica.
    assert sum(t is None for t in texts) == cut <= 32
    assert all(t == expected[p] for t, p in zip(texts, prompts, strict=True) if t is not None)
    # Ray replaces the killed replica; the new one serves.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = replicas()
        status = serve.status().applications["jserve"].deployments["jserve"].replica_states
        if len(now) == 2 and victim not in now and status.get("RUNNING") == 2:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the killed replica was not replaced: {replicas()}")
    texts, cut, _ = asyncio.run(run_load(cluster, prompts[:8]))
    assert cut == 0 and texts == [expected[p] for p in prompts[:8]]
    print(f"\nkilled {victim}: {cut} begun streams cut, {retries} retries before streaming")


@needs_ray
def test_scale_down_drains_running_streams(cluster):
    """Runs last: the cluster keeps one replica. 8 streams, spread over both replicas by Ray's router, are running
    when the deployment goes from 2 replicas to 1: each finishes whole, the stopped replica's included (Ray's
    graceful_shutdown_timeout_s, the server's drain)."""
    from ray import serve

    from jserve.server.ray_serve import build_app

    before = replicas()
    long = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def stream(client: httpx.AsyncClient, begun: asyncio.Event) -> int:
        tokens = 0
        async with client.stream("POST", f"{cluster}/v1/completions", json=long) as response:
            async for line in response.aiter_lines():
                begun.set()
                if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                    tokens = usage["completion_tokens"]
                if line == "data: [DONE]":
                    return tokens
        raise AssertionError("the stream ended without [DONE]")

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            begun = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.ensure_future(stream(client, b)) for b in begun]
            await asyncio.gather(*(b.wait() for b in begun))
            await asyncio.to_thread(serve.run, build_app(app_args(1)), name="jserve", route_prefix="/",
                                    blocking=False)
            return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == [200] * 8
    deadline = time.monotonic() + 60  # the drained replicas stop once their streams are done
    while len(replicas()) != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(replicas()) == 1 and len(before) == 2
