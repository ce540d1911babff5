"""Running a real uvicorn server on 127.0.0.1 in a background thread, and reading its metrics."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from jserve.config import EngineConfig
from jserve.server.app import build_app
from jserve.server.settings import ServerSettings

# The engine settings of llm_factory's default LLM, so the offline reference runs the very same engine.
TEST_ENGINE_ARGS = dict(max_model_len=512, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=128,
                        max_num_seqs=16, warmup=False, compilation_cache_dir="")


class ServerThread:
    """build_app + uvicorn on a socket bound here (so the port is ours before the thread starts)."""

    def __init__(self, config: EngineConfig, settings: ServerSettings, *, shutdown_timeout: float = 10.0):
        self.app = build_app(config, settings)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=shutdown_timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def start(self, timeout: float = 180.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.load_error is not None:
                raise RuntimeError(f"the model failed to load: {self.state.load_error}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the server did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def metric_values(url: str) -> dict[str, float]:
    """Every sample of GET /metrics by name (labels dropped; each test server serves one model)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples}


def metric_total(url: str, name: str) -> float:
    """The sum of a metric's samples over all its label values (e.g. a counter's every finish reason)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
