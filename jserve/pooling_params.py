"""What an embedding request asks for (vLLM's PoolingParams)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """normalize: scale the pooled vector to unit length (what cosine similarity expects; sentence-transformers'
    Normalize module). dimensions: keep only the first this many values (a Matryoshka model's shorter embedding),
    then normalize. truncate_prompt_tokens: keep only the prompt's last this many tokens."""

    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    n = 1  # one vector a prompt (the server counts sequences by n)

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
