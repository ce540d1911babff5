"""Benchmark requests: what is sent (prompt tokens and text) and how many tokens each should generate.

Every dataset yields SampleRequest objects from a seeded numpy Generator, so the same flags give the same
requests to every backend. Prompts are made as token ids (exact lengths, used as-is offline); `prompt_text`
decodes them for servers, which re-tokenize, so `prompt_len` of a served request is its re-encoded length.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jserve.bench import DATASETS

# The ShareGPT-like mix: log-uniform lengths, so short chats dominate but long prompts and answers occur
# (mean about 242 prompt and 143 output tokens), the same ranges as the offline workload.
MIXED_PROMPT_RANGE = (16, 1024)
MIXED_OUTPUT_RANGE = (16, 512)

# vLLM's ShareGPT filters: drop conversations too short to time, or too long for a 2k-context model.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None  # text for servers; None means decode prompt_token_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """vLLM's random lengths: uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def log_uniform_lengths(rng: np.random.Generator, n: int, low: int, high: int) -> np.ndarray:
    lengths = np.exp(rng.uniform(math.log(low), math.log(high + 1), size=n)).astype(np.int64)
    return np.clip(lengths, low, high)


def ordinary_token_ids(tokenizer: TokenizerLike, special_ids: Sequence[int] = ()) -> np.ndarray:
    """Ids a random prompt may use: the vocabulary less the special tokens (which would end or reshape it)."""
    ids = np.arange(tokenizer.vocab_size)
    return np.setdiff1d(ids, np.asarray(list(special_ids), dtype=np.int64))


def random_prompt(rng: np.random.Generator, vocab: np.ndarray, length: int) -> list[int]:
    return rng.choice(vocab, size=length).tolist()


def random_requests(rng: np.random.Generator, vocab: np.ndarray, num: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0) -> list[SampleRequest]:
    inputs = random_lengths(rng, num, input_len, range_ratio)
    outputs = random_lengths(rng, num, output_len, range_ratio)
    return [SampleRequest(random_prompt(rng, vocab, int(i)), int(o)) for i, o in zip(inputs, outputs, strict=True)]


def prefix_repetition_requests(rng: np.random.Generator, vocab: np.ndarray, num: int, prefix_len: int,
                               suffix_len: int, num_prefixes: int, output_len: int) -> list[SampleRequest]:
    """num_prefixes shared prefixes, each followed by a fresh random suffix: exercises prefix caching."""
    prefixes = [random_prompt(rng, vocab, prefix_len) for _ in range(num_prefixes)]
    requests = [SampleRequest(prefixes[i % num_prefixes] + random_prompt(rng, vocab, suffix_len), output_len)
                for i in range(num)]
    order = rng.permutation(num)  # interleave the prefixes as independent users would
    return [requests[i] for i in order]


def mixed_requests(rng: np.random.Generator, vocab: np.ndarray, num: int) -> list[SampleRequest]:
    """The ShareGPT-like synthetic mix (no data set can be downloaded here)."""
    inputs = log_uniform_lengths(rng, num, *MIXED_PROMPT_RANGE)
    outputs = log_uniform_lengths(rng, num, *MIXED_OUTPUT_RANGE)
    return [SampleRequest(random_prompt(rng, vocab, int(i)), int(o)) for i, o in zip(inputs, outputs, strict=True)]


def sharegpt_requests(rng: np.random.Generator, tokenizer: TokenizerLike, path: Path, num: int,
                      output_len: int | None = None) -> list[SampleRequest]:
    """ShareGPT-format JSON: the first human turn is the prompt, the first answer's length the output length."""
    data = json.loads(Path(path).read_text())
    pairs = [_first_turns(entry) for entry in data]
    pairs = [p for p in pairs if p is not None]
    rng.shuffle(pairs)
    requests: list[SampleRequest] = []
    for prompt, answer in pairs:
        if len(requests) == num:
            break
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        # vLLM's is_valid_sequence: a fixed output length (--sharegpt-output-len) skips only the check of the
        # answer's own length; the prompt's bounds and the total still apply.
        if (len(ids) < SHAREGPT_MIN_LEN or (output_len is None and out < SHAREGPT_MIN_LEN)
                or len(ids) > SHAREGPT_MAX_PROMPT or len(ids) + out > SHAREGPT_MAX_TOTAL):
            continue
        requests.append(SampleRequest(ids, out, prompt=prompt))
    if len(requests) < num:
        raise ValueError(f"{path}: only {len(requests)} usable conversations, {num} requested")
    return requests


def _first_turns(entry: Any) -> tuple[str, str] | None:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in (first, second)):
        return None
    return first["value"], second["value"]


def fit_text(tokenizer: TokenizerLike, ids: list[int], rng: np.random.Generator, vocab: np.ndarray,
             tries: int = 8) -> tuple[str, list[int]]:
    """Text that re-encodes to len(ids) tokens where a few rounds can find it: decoded random ids re-encode to
    a different count (neighbours merge or split), so the re-encoding is cut or topped up and decoded again."""
    target = len(ids)
    for _ in range(tries):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            break
        ids = encoded[:target] if len(encoded) > target else encoded + random_prompt(rng, vocab, target - len(encoded))
    return text, encoded


def for_server(requests: list[SampleRequest], tokenizer: TokenizerLike, rng: np.random.Generator,
               vocab: np.ndarray) -> list[SampleRequest]:
    """Text prompts, with prompt_token_ids re-encoded from the text so prompt_len is what the server sees."""
    served = []
    for r in requests:
        if r.prompt is None:
            text, ids = fit_text(tokenizer, r.prompt_token_ids, rng, vocab)
        else:
            text, ids = r.prompt, tokenizer.encode(r.prompt, add_special_tokens=False)
        served.append(SampleRequest(ids, r.output_len, prompt=text))
    return served


def build_requests(args: Any, tokenizer: TokenizerLike, special_ids: Sequence[int] = ()) -> list[SampleRequest]:
    """The requests the parsed dataset flags (see cli.add_dataset_args) describe."""
    rng = np.random.default_rng(args.seed)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path (or use --dataset mixed, its synthetic twin)")
        return sharegpt_requests(rng, tokenizer, Path(args.dataset_path), args.num_prompts, args.sharegpt_output_len)
    vocab = ordinary_token_ids(tokenizer, special_ids)
    if args.dataset == "random":
        return random_requests(rng, vocab, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio)
    if args.dataset == "prefix-repetition":
        return prefix_repetition_requests(rng, vocab, args.num_prompts, args.prefix_repetition_prefix_len,
                                          args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                          args.prefix_repetition_output_len)
    if args.dataset == "mixed":
        return mixed_requests(rng, vocab, args.num_prompts)
    raise ValueError(f"unknown dataset {args.dataset!r}; choose from {', '.join(DATASETS)}")
