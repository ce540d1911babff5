"""The server's own settings (the engine's are in EngineConfig); light to import, so the CLI can use it."""

from __future__ import annotations

from dataclasses import dataclass

from jserve.server.lora_modules import LoraModule
from jserve.server.reasoning import REASONING_PARSERS

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "openai", "deepseek_v3", "deepseek_v31", "mistral",
                     "pythonic")  # server/tools.py

# Request bodies above this many bytes get a 413 (a 4 MiB body is a prompt of roughly a million tokens).
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 256
DEMO_MODEL_NAME = "jserve-demo"
DEFAULT_MAX_STEP_FAILURES = 3
DEFAULT_STEP_FAILURE_WINDOW_S = 60.0


@dataclass
class ServerSettings:
    """The server's own knobs (the engine's are in EngineConfig)."""

    served_model_name: str | None = None  # None: the --model argument, or the default model's name
    api_key: str | None = None  # None: no authentication
    api_keys_file: str | None = None  # JSON or TOML keys with limits and priorities (jserve/server/auth.py)
    prefix_cache_salt_by_key: bool = False  # salt each keyed request's prefix cache by its key id
    max_queue_delay: float | None = None  # refuse requests whose estimated queue wait is longer (seconds)
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    tool_call_parser: str | None = None  # how tool_choice "auto" reads calls out of the output (server/tools.py)
    # how a chat output's reasoning is split from its answer (server/reasoning.py): message.reasoning_content
    reasoning_parser: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Failed engine steps the server recovers from within any step_failure_window_s seconds; one more and it
    # exits non-zero (so a supervisor restarts it).
    max_step_failures: int = DEFAULT_MAX_STEP_FAILURES
    step_failure_window_s: float = DEFAULT_STEP_FAILURE_WINDOW_S
    # On a several-model server: the model that serves a request whose own model's queue is over its limit.
    fallback_model: str | None = None
    # LoRA adapters served by name (--lora-modules): lora_int_id 1, 2, ... in this order (server/lora_modules.py).
    lora_modules: tuple[LoraModule, ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): off by
    # default, since a load reads whatever server path a client names.
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be non-negative, got {self.max_queued_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.max_step_failures < 0:
            raise ValueError(f"max_step_failures must be non-negative, got {self.max_step_failures}")
        if not self.step_failure_window_s > 0:
            raise ValueError(f"step_failure_window_s must be positive, got {self.step_failure_window_s}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            raise ValueError("tool_call_parser openai reads gpt-oss's harmony messages: it needs reasoning_parser "
                             "openai_gptoss")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.max_queue_delay is not None and not self.max_queue_delay > 0:
            raise ValueError(f"max_queue_delay must be positive, got {self.max_queue_delay}")
