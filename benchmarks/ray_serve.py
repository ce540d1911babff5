"""Throughput of jserve replicas behind Ray Serve's HTTP proxy (jserve/server/ray_serve.py), for each replica count.

    python -m benchmarks.ray_serve --replicas 1 2 --requests 256 --concurrency 64 --max-tokens 64

Starts a local Ray cluster (`--num-cpus`, default: every core), deploys the demo model (or `--model`) with N
replicas of one CPU each, sends one untimed wave of `--concurrency` requests (compiles, caches), then times
`--requests` streaming completions at `--concurrency` at once and prints generated tokens per second. `--direct`
first measures one plain `jserve serve` process with the same settings and load (no Ray: the proxy's cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx

from checkpoints import DEMO_MODEL_DIR

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(", "The quick brown fox"]


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def _load(url: str, requests: int, concurrency: int, max_tokens: int) -> tuple[float, int]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, client: httpx.AsyncClient) -> int:
        async with gate:
            return await _one(client, url, PROMPTS[i % len(PROMPTS)], max_tokens)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, client) for i in range(requests)))
        return time.perf_counter() - start, sum(tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(url: str, args: argparse.Namespace, label: dict) -> dict:
    asyncio.run(_load(url, args.concurrency, args.concurrency, args.max_tokens))  # untimed: compiles, caches
    seconds, tokens = asyncio.run(_load(url, args.requests, args.concurrency, args.max_tokens))
    result = {**label, "seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
              "requests_per_s": round(args.requests / seconds, 2)}
    print(json.dumps(result), flush=True)
    return result


def _direct(args: argparse.Namespace) -> dict:
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "jserve", "serve", "--model", args.model, "--port", str(port),
                               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512",
                               "--log-level", "warning"])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        return _measure(url, args, {"replicas": "direct"})
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=str(DEMO_MODEL_DIR))
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--direct", action="store_true", help="also measure one plain `jserve serve` (no Ray)")
    args = parser.parse_args()
    results = [_direct(args)] if args.direct else []

    import ray
    from ray import serve

    from jserve.server.ray_serve import build_app

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    for replicas in args.replicas:
        app = build_app({"model": args.model, "num_replicas": str(replicas), "num_cpus": "1",
                         "max_num_seqs": str(args.max_num_seqs), "max_model_len": "512"})
        serve.run(app, name="jserve", route_prefix="/", blocking=False)
        results.append(_measure(url, args, {"replicas": replicas}))
        serve.delete("jserve")
    ray_runs = [r for r in results if r["replicas"] != "direct"]
    if len(ray_runs) > 1:
        print(f"speed-up of {ray_runs[-1]['replicas']} replicas over {ray_runs[0]['replicas']}: "
              f"{ray_runs[-1]['tokens_per_s'] / ray_runs[0]['tokens_per_s']:.2f}x")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
