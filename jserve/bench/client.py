"""One streaming request to an OpenAI-compatible server, timed chunk by chunk (as vLLM's request functions)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from jserve.bench.metrics import RequestResult

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RequestSpec:
    url: str
    model: str
    prompt: str
    prompt_len: int
    max_tokens: int
    chat: bool
    ignore_eos: bool = False
    temperature: float = 0.0
    response_format: dict | None = None  # OpenAI's, for structured-output workloads


def request_body(spec: RequestSpec) -> dict:
    """Only fields every OpenAI-compatible server knows (plus ignore_eos, which vLLM, SGLang, llama.cpp and jserve
    accept, and which is sent only when asked for)."""
    body: dict = {"model": spec.model, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.response_format is not None:
        body["response_format"] = spec.response_format
    return body


def chunk_text(data: dict, chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, headers: dict | None = None) -> RequestResult:
    """Stream one request; failures are recorded in the result, never raised, so one bad request cannot stop a run."""
    result = RequestResult(prompt_len=spec.prompt_len)
    result.start_time = start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", spec.url, json=request_body(spec), headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                payload = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if not payload or payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if error := data.get("error"):  # the stream began, then the server failed the request in-band
                    message = error.get("message", error) if isinstance(error, dict) else error
                    result.error = f"error event after {len(result.chunk_times)} content chunks: {message}"
                    return result
                if text := chunk_text(data, spec.chat):
                    now = time.perf_counter()
                    if result.chunk_times:
                        result.itl.append(now - last)
                    else:
                        result.ttft = now - start
                    result.chunk_times.append(now)
                    result.generated_text += text
                    last = now
                if usage := data.get("usage"):
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = last - start
    result.success = bool(result.chunk_times)
    if not result.success:
        result.error = "the response carried no content"
    return result
