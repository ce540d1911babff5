"""Model registry: Hugging Face `architectures` / `model_type` -> jserve module."""

from __future__ import annotations

from jserve.config import SUPPORTED_MODEL_TYPES, ModelConfig, ModelLoadError
from jserve.models.llama import LlamaForCausalLM

_REGISTRY = {model_type: LlamaForCausalLM for model_type in SUPPORTED_MODEL_TYPES}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[config.model_type]
    except KeyError:
        raise ModelLoadError(f"unsupported model_type {config.model_type!r}; supported: "
                             f"{', '.join(sorted(_REGISTRY))}") from None
