"""Soak the server: many requests with random parameters at a fixed concurrency, some clients going away at random
points and some requests invalid; then report requests/s, the server's RSS at the end of each quarter and every
outcome by kind.

    python -m benchmarks.soak [--requests 20000] [--concurrency 64] [--seed 0] [--json out.json]

starts `jserve serve` on the demo model (checkpoints/demo) in a child process and reads that process's RSS from
/proc. tests/test_soak.py runs the same driver (`run_soak`) against an in-process server.

Outcome kinds: `ok` (a complete answer, checked for its shape), `disconnected` (the client left on purpose),
`rejected` (an invalid request answered 400 with OpenAI's error body), and anything else: `status-<code>`,
`bad-body` (a 200 or 400 whose body is not what it must be), `error-<ExceptionType>`. A healthy server shows
only the first three.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

EXPECTED = ("ok", "disconnected", "rejected")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):",
           "for i in range(10):", "# sort a list of numbers\n", "return x + y"]


@dataclass
class Job:
    route: str  # "completions" or "chat"
    body: dict | bytes  # bytes: sent as is (an invalid JSON body)
    stream: bool
    invalid: bool = False
    cut: float | None = None  # disconnect: after this many seconds (non-streaming) or chunks (streaming)


@dataclass
class SoakReport:
    requests: int
    concurrency: int
    seconds: float = 0.0
    outcomes: Counter = field(default_factory=Counter)
    rss_bytes: list[int] = field(default_factory=list)  # the server's RSS at the end of each quarter
    quarter_ends: list[float] = field(default_factory=list)  # seconds since the start, at the end of each quarter
    samples: list[str] = field(default_factory=list)  # the first few unexpected outcomes, described

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def unexpected(self) -> dict[str, int]:
        return {kind: n for kind, n in self.outcomes.items() if kind not in EXPECTED}

    def rss_growth(self) -> float:
        """Relative RSS growth from the end of the second quarter to the end of the last."""
        return self.rss_bytes[-1] / self.rss_bytes[1] - 1.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "concurrency": self.concurrency, "seconds": round(self.seconds, 2),
                "requests_per_s": round(self.requests_per_s, 1), "outcomes": dict(self.outcomes),
                "rss_mib_by_quarter": [round(r / 2**20, 1) for r in self.rss_bytes],
                "quarter_ends_s": [round(t, 1) for t in self.quarter_ends],
                "rss_growth_q2_to_q4": round(self.rss_growth(), 4), "unexpected_samples": self.samples}


def _invalid(rng: random.Random, vocab: int, max_model_len: int) -> tuple[str, dict | bytes]:
    base = {"prompt": rng.choice(PROMPTS), "max_tokens": 2}
    choices = [
        ("completions", {**base, "temperature": -1}),
        ("completions", {**base, "prompt": [1, vocab]}),  # one past the model's vocabulary
        ("completions", {**base, "prompt": [5] * max_model_len}),  # over the context
        ("completions", {**base, "max_tokens": 0}),
        ("completions", {**base, "n": 0}),
        ("completions", {**base, "logit_bias": {"abc": 1}}),
        ("completions", {**base, "stop": ["x"] * 65}),
        ("completions", {**base, "logprobs": 21}),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}),
        ("chat", {"messages": []}),
        ("completions", b'{"prompt": "unterminated'),
    ]
    return rng.choice(choices)


def make_job(rng: random.Random, vocab: int, max_model_len: int, *, disconnect_rate: float,
             invalid_rate: float) -> Job:
    """One request with random parameters (small outputs: a soak is about the server, not the model)."""
    draw = rng.random()
    if draw < invalid_rate:
        route, body = _invalid(rng, vocab, max_model_len)
        return Job(route, body, stream=False, invalid=True)
    stream = rng.random() < 0.5
    params: dict = {"max_tokens": rng.randint(1, 8), "temperature": rng.choice([0.0, 0.7, 1.0, 1.3]),
                    "stream": stream, "n": rng.choice([1, 1, 1, 2])}
    if rng.random() < 0.3:
        params["top_p"] = rng.uniform(0.5, 1.0)
    if rng.random() < 0.3:
        params["top_k"] = rng.choice([0, 5, 40])
    if rng.random() < 0.3:
        params["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        params["stop"] = ["\n"]
    if rng.random() < 0.2:
        params["presence_penalty"] = rng.uniform(-1, 1)
    if stream and rng.random() < 0.3:
        params["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        route = "completions"
        if rng.random() < 0.5:
            prompt: str | list[int] = rng.choice(PROMPTS) * rng.randint(1, 4)  # shared prefixes: the prefix cache
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 48))]
        params["prompt"] = prompt
        if rng.random() < 0.2:
            params["logprobs"] = rng.randint(0, 3)
    else:
        route = "chat"
        params["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        if rng.random() < 0.2:
            params["logprobs"], params["top_logprobs"] = True, rng.randint(0, 3)
    cut = None
    if draw < invalid_rate + disconnect_rate:
        cut = float(rng.randint(0, 3)) if stream else rng.uniform(0.0, 0.3)
    return Job(route, params, stream=stream, cut=cut)


def _error_shaped(body: object) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} \
        and isinstance(error["message"], str)


async def _send(client: httpx.AsyncClient, job: Job) -> str:
    url = "/v1/completions" if job.route == "completions" else "/v1/chat/completions"
    kwargs = {"content": job.body, "headers": {"content-type": "application/json"}} \
        if isinstance(job.body, bytes) else {"json": job.body}
    if job.stream:
        async with client.stream("POST", url, **kwargs) as response:
            if response.status_code != 200:
                await response.aread()
                return _judge_error(job, response.status_code, response.content)
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if job.cut is not None and chunks >= job.cut:
                    return "disconnected"  # leaving the block closes the connection mid-stream
                chunks += 1
                if line == "data: [DONE]":
                    return "ok" if chunks > 1 else "bad-body"
                if "error" in json.loads(line[6:]):
                    return "bad-body"
            return "bad-body"  # the stream ended without [DONE]
    request = client.post(url, **kwargs)
    if job.cut is not None:
        try:
            response = await asyncio.wait_for(request, job.cut)
        except TimeoutError:
            return "disconnected"
    else:
        response = await request
    if response.status_code != 200:
        return _judge_error(job, response.status_code, response.content)
    body = response.json()
    n = job.body.get("n", 1)
    ok = isinstance(body.get("choices"), list) and len(body["choices"]) == n and "usage" in body
    return "ok" if ok else "bad-body"


def _judge_error(job: Job, status: int, content: bytes) -> str:
    if status != 400 or not job.invalid:
        return f"status-{status}"
    try:
        return "rejected" if _error_shaped(json.loads(content)) else "bad-body"
    except ValueError:
        return "bad-body"


async def run_soak(url: str, *, requests: int = 1000, concurrency: int = 64, vocab: int, max_model_len: int,
                   disconnect_rate: float = 0.2, invalid_rate: float = 0.05, seed: int = 0,
                   rss: Callable[[], int], on_quarter: Callable[[int], None] | None = None,
                   timeout: float = 120.0) -> SoakReport:
    """Send `requests` jobs from `concurrency` clients; rss() is sampled (and on_quarter(q) called) at the end of
    each quarter of the jobs."""
    rng = random.Random(seed)
    jobs = [make_job(rng, vocab, max_model_len, disconnect_rate=disconnect_rate, invalid_rate=invalid_rate)
            for _ in range(requests)]
    report = SoakReport(requests, concurrency)
    quarters = {requests * q // 4: q for q in range(1, 5)}
    done, next_job = 0, 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done, next_job
        while next_job < len(jobs):
            job = jobs[next_job]
            next_job += 1
            try:
                kind = await _send(client, job)
            except Exception as e:  # a transport error or an unparsable body: the server misbehaved
                kind = f"error-{type(e).__name__}"
                if len(report.samples) < 10:
                    report.samples.append(f"{kind}: {e!s:.200} for {job.body!r:.200}")
            else:
                if kind not in EXPECTED and len(report.samples) < 10:
                    report.samples.append(f"{kind} for {job.body!r:.300}")
            report.outcomes[kind] += 1
            done += 1
            if done in quarters:
                report.rss_bytes.append(rss())
                report.quarter_ends.append(time.perf_counter() - start)
                if on_quarter is not None:
                    on_quarter(quarters[done])

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    report.seconds = time.perf_counter() - start
    return report


def rss_of(pid: int | str = "self") -> int:
    """Resident set size of a process in bytes (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _serve(port: int, max_num_seqs: int) -> subprocess.Popen:
    demo = Path(__file__).resolve().parent.parent / "checkpoints" / "demo"
    cmd = [sys.executable, "-m", "jserve", "serve", "--model", str(demo), "--port", str(port), "--log-level",
           "warning", "--max-num-seqs", str(max_num_seqs)]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not become healthy in 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--disconnect-rate", type=float, default=0.2)
    parser.add_argument("--invalid-rate", type=float, default=0.05)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    if args.requests < 4 or args.concurrency < 1:
        parser.error("--requests must be at least 4 and --concurrency at least 1")
    proc = _serve(args.port, args.max_num_seqs)
    try:
        url = f"http://127.0.0.1:{args.port}"
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        config = json.loads((Path(models["root"]) / "config.json").read_text())
        report = asyncio.run(run_soak(url, requests=args.requests, concurrency=args.concurrency,
                                      vocab=config["vocab_size"], max_model_len=models["max_model_len"],
                                      disconnect_rate=args.disconnect_rate, invalid_rate=args.invalid_rate,
                                      seed=args.seed, rss=lambda: rss_of(proc.pid)))
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith(("jserve:num_requests_running", "jserve:num_requests_waiting"))}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    result = {**report.as_dict(), "after": gauges}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if report.unexpected:
        sys.exit(1)


if __name__ == "__main__":
    main()
