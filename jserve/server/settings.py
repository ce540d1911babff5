"""The server's own settings (the engine's are in EngineConfig); light to import, so the CLI can use it."""

from __future__ import annotations

from dataclasses import dataclass

# Request bodies above this many bytes get a 413 (a 4 MiB body is a prompt of roughly a million tokens).
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 256
DEMO_MODEL_NAME = "jserve-demo"


@dataclass
class ServerSettings:
    """The server's own knobs (the engine's are in EngineConfig)."""

    served_model_name: str | None = None  # None: the --model argument, or the default model's name
    api_key: str | None = None  # None: no authentication
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be non-negative, got {self.max_queued_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
