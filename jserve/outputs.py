"""What generation returns: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

# One generated position's logprobs: {token_id: logprob} holding the chosen token and the top-N.
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
