"""What generation returns: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from jserve.lora_request import LoRARequest


class Logprob(float):
    """One token's logprob, as vLLM's Logprob (vllm.logprobs.Logprob): .logprob, .rank (the token's rank in the
    vocabulary, 1 for the most likely; None where unknown) and .decoded_token (the token's text alone; None where the
    request set detokenize=False). It is also the float itself, so arithmetic, comparisons and json.dumps treat it as
    the number (code written for jserve's plain-float entries keeps working)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __getnewargs__(self) -> tuple:  # pickle and copy rebuild it whole
        return float(self), self.rank, self.decoded_token

    def __repr__(self) -> str:  # vLLM's (a dataclass's) repr
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    __str__ = float.__repr__  # str(), f-strings and format() print the number, as they did for the float


# One generated position's logprobs: {token_id: Logprob} holding the chosen token and the top-N (vLLM's
# SampleLogprobs entry); each Logprob is a float, so reading them as dict[int, float] still works.
Logprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples (vLLM's)
    text: str  # "" where the request set detokenize=False
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it; None for EOS or the length
    logprobs: list[Logprobs] | None = None
    # The sum of the sampled tokens' logprobs where the request asked for logprobs, else None (vLLM v1's).
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """Whether this sample has ended (a method, as vLLM's CompletionOutput.finished())."""
        return self.finish_reason is not None

    def __repr__(self) -> str:  # vLLM's format, less the fields jserve does not have
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
                f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[Logprobs | None] | None = None  # None for the first prompt token (no context), as vLLM's
    # jserve's: arrival_time, first_token_time, finished_time (time.monotonic() seconds), set once finished. vLLM
    # reports a RequestStateStats object here instead.
    metrics: dict[str, float] = field(default_factory=dict)
    lora_request: LoRARequest | None = None  # the LoRA adapter it ran with

    def __repr__(self) -> str:  # vLLM's format, less the fields jserve does not have
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
                f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
                f"lora_request={self.lora_request}, num_cached_tokens={self.num_cached_tokens})")


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled hidden state (normalized unless the request said not to)


@dataclass
class EmbeddingRequestOutput:
    """What an embedding request returns (vLLM's EmbeddingRequestOutput): the prompt's pooled vector."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float  # the cosine similarity of the pair's embeddings


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns for one pair (vLLM's ScoringRequestOutput)."""

    request_id: str
    prompt_token_ids: list[int]  # the second text's
    outputs: ScoringOutput
    finished: bool = True
