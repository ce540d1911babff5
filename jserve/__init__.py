"""jserve: LLM serving on JAX/XLA."""

from jserve.config import EngineConfig, ModelConfig
from jserve.lora_request import LoRARequest
from jserve.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jserve.pooling_params import PoolingParams
from jserve.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in JAX and the model code; import it lazily so `jserve --help` and config use stay fast.
    if name == "LLM":
        from jserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput", "CompletionOutput",
           "Logprob", "PoolingParams", "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput",
           "ScoringRequestOutput"]
