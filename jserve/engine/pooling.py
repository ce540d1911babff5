"""Embeddings: an engine of runner "pooling" turns each prompt into one vector.

The model is loaded without its LM head (config.pooling): a step's output rows are the final norm's hidden states
at the batch's logits rows. A request is a sequence that prefills its prompt (in chunks, preempted and recomputed
like any other) and finishes when the prompt is computed, sampling nothing. Its vector is the last token's hidden
state (LAST, what decoder embedding models such as Qwen3-Embedding and e5-mistral use), the mean over the prompt
(MEAN) or the first token's (CLS); MEAN and CLS read every token's row, so their steps take one logits row a token.
Prefix caching is off for a pooling engine: a prompt's cached tokens would be skipped, and their rows with them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jserve.engine.request_inputs import tokenize_prompt
from jserve.engine.scheduler import Scheduler, SchedulerOutput
from jserve.engine.sequence import Sequence
from jserve.outputs import EmbeddingOutput, EmbeddingRequestOutput
from jserve.pooling_params import PoolingParams
from jserve.sampling_params import InvalidParameterError, SamplingParams

# sentence-transformers' Pooling module flags (its config.json) -> pooling_type
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}


def checkpoint_pooling_type(model_dir: str | Path) -> str:
    """The pooling a checkpoint's sentence-transformers configuration names (modules.json's Pooling module), else
    LAST. ValueError for a mode jserve does not pool by (max, weighted mean)."""
    model_dir = Path(model_dir)
    modules = model_dir / "modules.json"
    if not model_dir.is_dir() or not modules.is_file():
        return "LAST"
    try:
        entries = json.loads(modules.read_text())
        path = next((m.get("path", "") for m in entries if str(m.get("type", "")).endswith("models.Pooling")), None)
        if path is None:
            return "LAST"
        config = json.loads((model_dir / path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, AttributeError, TypeError) as e:
        raise ValueError(f"{modules}: cannot read its Pooling module's config ({e}); set pooling_type") from None
    chosen = [mode for flag, mode in _SENTENCE_TRANSFORMERS_MODES.items() if config.get(flag)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in
              _SENTENCE_TRANSFORMERS_MODES]
    if others or len(chosen) > 1:
        raise ValueError(f"{model_dir / path}: pooling {others or chosen} is not supported (jserve pools by one of "
                         f"{sorted(set(_SENTENCE_TRANSFORMERS_MODES.values()))}); set pooling_type")
    return chosen[0] if chosen else "LAST"


@dataclass
class _Pooled:
    seq: Sequence
    prompt: str | None
    params: PoolingParams
    total: np.ndarray | None = None  # MEAN: the rows summed so far; CLS: the first token's row


class Pooler:
    """The embedding requests of one engine, from admission to their vectors."""

    def __init__(self, pooling_type: str, width: int):
        self.pooling_type, self.width = pooling_type, width  # width: the hidden states' (the model's hidden size)
        self.requests: dict[str, _Pooled] = {}

    @property
    def all_rows(self) -> bool:
        """Whether a step needs every token's row (MEAN, CLS), not only each sequence's last."""
        return self.pooling_type != "LAST"

    def add_request(self, scheduler: Scheduler, tokenizer, vocab_size: int, max_model_len: int, request_id: str,
                    prompt, params: PoolingParams, priority: int = 0, arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.dimensions is not None and params.dimensions > self.width:
            raise InvalidParameterError("dimensions", f"dimensions {params.dimensions} exceeds the model's embedding "
                                                      f"size {self.width}")
        # a prompt may fill the context: nothing is generated after it
        text, ids = tokenize_prompt(tokenizer, vocab_size, max_model_len + 1, prompt, params.truncate_prompt_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(request_id, ids, SamplingParams(max_tokens=1), priority=priority, arrival_time=arrival)
        scheduler.check_fits(seq)
        self.requests[request_id] = _Pooled(seq, text, params)
        scheduler.add(seq)

    def abort(self, scheduler: Scheduler, request_id: str) -> EmbeddingRequestOutput | None:
        pooled = self.requests.pop(request_id, None)
        if pooled is None:
            return None
        scheduler.abort(request_id)
        return EmbeddingRequestOutput(request_id, pooled.prompt, pooled.seq.prompt_token_ids, EmbeddingOutput([]),
                                      finished=True)

    def step(self, plan: SchedulerOutput, scheduler: Scheduler, executor,
             fetch: Callable[[object], np.ndarray]) -> list[EmbeddingRequestOutput]:
        """Run the plan's prompt chunks, pool their rows and finish the requests whose prompts are computed."""
        batch = executor.prepare(plan.scheduled, all_logits=self.all_rows)
        rows = fetch(executor.run(batch))
        outputs, finished = [], []
        for i, chunk in enumerate(plan.scheduled):
            pooled = self.requests[chunk.seq.request_id]
            start = chunk.seq.num_computed_tokens  # a recompute after preemption starts over at 0
            if self.all_rows:
                chunk_rows = rows[batch.query_start[i]:batch.query_start[i + 1]]
                if self.pooling_type == "MEAN":
                    part = chunk_rows.sum(axis=0, dtype=np.float64)
                    pooled.total = part if start == 0 else pooled.total + part
                elif start == 0:
                    pooled.total = chunk_rows[0]
            if start + chunk.num_new_tokens < chunk.seq.num_tokens:
                continue
            if self.pooling_type == "LAST":
                vector = rows[i]
            else:
                vector = pooled.total / (chunk.seq.num_tokens if self.pooling_type == "MEAN" else 1)
            outputs.append(self._output(chunk.seq.request_id, np.asarray(vector, np.float64)))
            finished.append((chunk.seq, "stop"))
        scheduler.update(plan, [0] * len(plan.scheduled), finished)
        return outputs

    def _output(self, request_id: str, vector: np.ndarray) -> EmbeddingRequestOutput:
        pooled = self.requests.pop(request_id)
        params = pooled.params
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        if params.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return EmbeddingRequestOutput(request_id, pooled.prompt, pooled.seq.prompt_token_ids,
                                      EmbeddingOutput(vector.astype(np.float32).tolist()))
