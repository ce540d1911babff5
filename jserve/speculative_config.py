"""Speculative decoding's settings (vLLM's `speculative_config`), as EngineConfig takes them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "draft_model")  # how draft tokens are proposed (jserve.engine.speculative)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative.md), vLLM's `speculative_config` keys.

    method: "ngram" (prompt lookup: the tokens that followed the first earlier occurrence of the sequence's last
      n-gram) | "draft_model" (a smaller model with the target's tokenizer, `model`, drafts k tokens a step with its
      own paged KV cache; jserve.engine.draft_model). num_speculative_tokens: the most draft tokens verified per step
      (k). prompt_lookup_min/max: the shortest and longest n-gram matched (the longest that matches wins).
      disable_by_batch_size: no speculation in a step whose running batch holds more sequences than this (None:
      always). model: the draft model (a directory, GGUF file or hub id), for "draft_model" only."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: int | None = None
    model: str | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (`--speculative-config`); ValueError naming the bad field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got {type(value).__name__}")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {method!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config: unknown field {unknown[0]!r} (known: {sorted(fields)})")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        model = value.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config.model must name the draft model for method 'draft_model', "
                             f"got {model!r}")
        if method != "draft_model" and model is not None:
            raise ValueError(f"speculative_config.model is for method 'draft_model', not {method!r}")
        # vLLM: one lookup bound given, the other takes its value
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is not None:
            low = high if _positive(high) else 1
        if high is None and low is not None:
            high = low if _positive(low) else 1
        config = cls(method=method, num_speculative_tokens=value["num_speculative_tokens"],
                     prompt_lookup_min=1 if low is None else low, prompt_lookup_max=3 if high is None else high,
                     disable_by_batch_size=value.get("disable_by_batch_size"), model=model)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            field_value = getattr(config, name)
            if (field_value is not None or name != "disable_by_batch_size") and not _positive(field_value):
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {field_value!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({config.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
