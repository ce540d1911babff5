"""A request's inputs checked against the model and made ready to schedule: the prompt as token ids (vLLM's prompt
forms, truncate_prompt_tokens, the context bound) and the sampling parameters resolved (max_tokens within the
context, token ids within the vocabulary, allowed_token_ids and bad_words as token ids)."""

from __future__ import annotations

import numpy as np

from jserve.sampling_params import InvalidParameterError, SamplingParams
from jserve.tokenizer import Tokenizer


def tokenize_prompt(tokenizer: Tokenizer, vocab_size: int, max_model_len: int, prompt: str | list[int] | dict,
                    truncate: int | None = None) -> tuple[str | None, list[int]]:
    """-> (the prompt's text or None, its token ids: the last `truncate` of them where set, as vLLM's
    truncate_prompt_tokens; -1, vLLM's "as many as the model takes", keeps max_model_len - 1, the most a prompt
    may hold here, where a request must have room for a token)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise InvalidParameterError("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        # NumPy integer ids (a tokenizer's array output) become Python ints; anything else is refused below.
        text, ids = None, [int(t) if isinstance(t, np.integer) else t for t in prompt]
        # The model's embedding table bounds the ids, not the tokenizer: an id past the table would be clamped
        # by the gather and silently read another token's row.
        bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size)]
        if bad:
            raise InvalidParameterError("prompt", f"prompt token id {bad[0]!r} is outside the model's vocabulary: "
                                                  f"ids must be integers in [0, {vocab_size})")
    else:
        raise InvalidParameterError("prompt", f"prompt must be a string or a list of token ids, got "
                                              f"{type(prompt).__name__}")
    if truncate is not None:  # before the length checks: truncation is what makes a long prompt fit
        ids = ids[-(max_model_len - 1 if truncate == -1 else truncate):]
    if not ids:
        raise InvalidParameterError("prompt", "the prompt is empty: it must contain at least one token")
    if len(ids) >= max_model_len:
        raise InvalidParameterError(
            "prompt", f"This model's maximum context length is {max_model_len} tokens. However, your "
                      f"request has {len(ids)} input tokens. Please reduce the length of the input messages.")
    return text, ids


def resolve_params(params: SamplingParams, prompt_len: int, *, tokenizer: Tokenizer, vocab_size: int,
                   max_model_len: int, eos_token_ids: list[int], default_max_tokens: int | None,
                   cap_max_tokens: bool = False) -> SamplingParams:
    """The request's parameters as the engine runs them. Without max_tokens: the rest of the context, or the
    model's recommended most where that is fewer (vLLM's). A max_tokens past the context is an error naming both
    lengths (vLLM's OpenAI server), or with cap_max_tokens ends the sequence at the context ("length"), as vLLM's
    offline LLM does."""
    room = max_model_len - prompt_len
    max_tokens = min(room, default_max_tokens or room) if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        if not cap_max_tokens:
            raise InvalidParameterError(
                "max_tokens", f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                              f"{max_tokens} in the completion). Please reduce the length of the messages or "
                              "completion.")
        max_tokens = room
    for name in ("logit_bias", "stop_token_ids", "allowed_token_ids"):
        for token in getattr(params, name) or ():
            if token >= vocab_size:
                raise InvalidParameterError(name, f"token id {token} is outside the vocabulary (size {vocab_size})")
    banned = ()
    if params.allowed_token_ids is not None:  # forbidden by a -inf logit bias, which every sampler path applies
        banned = tuple(np.setdiff1d(np.arange(vocab_size), params.allowed_token_ids).tolist())
    # min_tokens past the context could never be met: the sequence ends at the context.
    min_tokens = min(params.min_tokens, max_tokens)
    return params.clone(max_tokens=max_tokens, min_tokens=min_tokens, eos_token_ids=list(eos_token_ids),
                        banned_token_ids=banned,
                        bad_words_token_ids=bad_words_token_ids(tokenizer, vocab_size, params.bad_words or []))


def bad_words_token_ids(tokenizer: Tokenizer, vocab_size: int, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as vLLM finds them: the word with its leading spaces stripped, and with one space
    before it where that tokenizes into another first token but as many tokens (the word inside text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    if any(t >= vocab_size for ids in out for t in ids):
        raise InvalidParameterError("bad_words", f"a bad word tokenizes to an id outside the model's vocabulary "
                                                 f"(size {vocab_size})")
    return tuple(out)
