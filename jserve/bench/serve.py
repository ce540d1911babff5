"""`jserve bench serve`: an async load generator for any OpenAI-compatible streaming server.

Requests leave at the times arrivals.py draws (all at once, Poisson or gamma), at most --max-concurrency in
flight; each is streamed and timed by client.py, and metrics.py turns the timings into the vLLM-style report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from argparse import Namespace
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

from jserve.bench.arrivals import arrival_offsets
from jserve.bench.client import RequestSpec, send_request
from jserve.bench.datasets import SampleRequest, TokenizerLike, build_requests, for_server, ordinary_token_ids
from jserve.bench.metrics import LATENCY_METRICS, RequestResult, compute_metrics, parse_goodput

# No request is cut short by the client: a slow server is what is being measured.
REQUEST_TIMEOUT_S = 6 * 3600


async def discover_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    """The first model GET /v1/models lists. A server that is down, refuses the key or does not answer as an
    OpenAI-compatible one is a ValueError (one line from the CLI, exit status 2), not a traceback."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = await client.get(url, headers=headers)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {url} ({type(e).__name__}: {e}); is the server running?") from None
    if response.status_code != 200:
        raise ValueError(f"{url} answered HTTP {response.status_code}: {response.text[:300]}"
                         + (" (pass the server's key with --api-key)" if response.status_code == 401 else ""))
    try:
        models = response.json().get("data") or []
    except (ValueError, AttributeError):
        raise ValueError(f"{url} did not answer as an OpenAI-compatible server: {response.text[:300]}") from None
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --served-model-name")
    return models[0]["id"]


# --structured-output json-schema: every request asks for JSON of this schema (OpenAI's response_format), a record
# of bounded fields and a list, so the constraint stays active for a good share of a 128-token output.
BENCH_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 40}, "tags": {"type": "array", "maxItems": 8,
                                                          "items": {"type": "string", "maxLength": 12}},
    "active": {"type": "boolean"}}, "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False}


def make_specs(requests: list[SampleRequest], url: str, model: str, args: Namespace) -> list[RequestSpec]:
    chat = args.endpoint.endswith("/chat/completions")
    fmt = None
    if getattr(args, "structured_output", "none") == "json-schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": BENCH_SCHEMA, "strict": True}}
    return [RequestSpec(url=url, model=model, prompt=r.prompt or "", prompt_len=r.prompt_len,
                        max_tokens=r.output_len, chat=chat, ignore_eos=args.ignore_eos,
                        temperature=args.temperature, response_format=fmt) for r in requests]


async def run_requests(client: httpx.AsyncClient, specs: list[RequestSpec], offsets: np.ndarray,
                       max_concurrency: int | None, headers: dict, progress: bool) -> tuple[list[RequestResult], float,
                                                                                           float]:
    """Send every spec at its offset; returns the results in spec order, the start time and the duration."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc="requests", disable=not progress)

    async def one(spec: RequestSpec) -> RequestResult:
        if limit is None:
            result = await send_request(client, spec, headers)
        else:
            async with limit:
                result = await send_request(client, spec, headers)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for spec, offset in zip(specs, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), start, duration


def fill_output_tokens(results: list[RequestResult], tokenizer: TokenizerLike) -> None:
    """Servers that send no usage chunk: count the generated text's tokens, as vLLM does."""
    for r in results:
        if r.success and r.output_tokens == 0:
            r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False))


async def benchmark(args: Namespace, tokenizer: TokenizerLike, special_ids: frozenset[int]) -> dict:
    slos = parse_goodput(args.goodput)  # checked before any request is sent
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    vocab = ordinary_token_ids(tokenizer, special_ids)
    fit_rng = np.random.default_rng(args.seed + 1)  # its own stream, so the requests match bench throughput's
    requests = for_server(build_requests(args, tokenizer, special_ids), tokenizer, fit_rng, vocab)
    offsets = arrival_offsets(np.random.default_rng(args.seed), len(requests), args.request_rate, args.burstiness)
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    url = args.base_url.rstrip("/") + args.endpoint
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        model = args.served_model_name or args.model or await discover_model(client, args.base_url, headers)
        specs = make_specs(requests, url, model, args)
        probe = await send_request(client, specs[0], headers)  # also warms the server up, as vLLM's test prompt
        if not probe.success:
            raise ValueError(f"the test request to {url} failed: {probe.error}")
        results, start, duration = await run_requests(client, specs, offsets, args.max_concurrency, headers,
                                                      progress=not args.disable_tqdm)
    fill_output_tokens(results, tokenizer)
    metrics = compute_metrics(results, duration, slos)
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "base_url": args.base_url,
              "endpoint": args.endpoint, "model": model, "dataset": args.dataset, "num_prompts": len(requests),
              # JSON has no infinity: an unlimited rate is the string "inf", as vLLM writes it.
              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
              "burstiness": args.burstiness,
              "max_concurrency": args.max_concurrency, "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()},
              **metrics, **per_request_fields(results, start)}
    if args.plot:
        from jserve.bench.plot import plot_serve

        plot_serve(results, start, Path(args.plot), title=f"{model} @ {args.base_url}")
    return report


def per_request_fields(results: list[RequestResult], start: float) -> dict:
    return {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "start_times": [r.start_time - start for r in results], "errors": [r.error for r in results]}


def format_report(report: dict) -> str:
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    row = lambda name, value: lines.append(f"{name:<44}{value:>16}")
    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    row("Maximum request concurrency:", str(report["max_concurrency"]))
    row("Benchmark duration (s):", f"{report['duration']:.2f}")
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", f"{report['request_throughput']:.2f}")
    if "request_goodput" in report:
        row("Request goodput (req/s):", f"{report['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{report['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{report['total_token_throughput']:.2f}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in LATENCY_METRICS:
        lines.append(f"{titles[name]:-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()} {name.upper()} (ms):", f"{report[f'{stat}_{name}_ms']:.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def run_serve(args: Namespace) -> int:
    from checkpoints import is_gguf_file
    from jserve.tokenizer import load_tokenizer

    if args.plot:  # matplotlib is checked now, not after every request has run
        from jserve.bench.plot import _pyplot

        _pyplot()
    tokenizer_path = args.tokenizer or args.model
    local = Path(tokenizer_path).expanduser() if tokenizer_path else None
    if local is None or not (local.is_dir() or is_gguf_file(local)):
        raise ValueError("bench serve needs a local tokenizer (a directory or a GGUF file) to build prompts: pass "
                         "--tokenizer PATH (or a --model that is a local checkpoint)")
    tokenizer = load_tokenizer(local)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the progress bar
    report = asyncio.run(benchmark(args, tokenizer, tokenizer.special_token_ids))
    print(format_report(report))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return 0 if report["failed"] == 0 else 1
