"""Per-request sampling parameters, vLLM-shaped so users can switch."""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The largest number of top logprobs a request may ask for (OpenAI allows 20).
MAX_LOGPROBS = 20
# Far above any useful temperature (logits / 100 are already near uniform), and far below float32 overflow.
MAX_TEMPERATURE = 100
# The longest cache_salt accepted: salts are keys, not payloads.
MAX_CACHE_SALT_LEN = 256


class RequestOutputKind(enum.Enum):
    """When the engine reports a request (vLLM's names)."""

    CUMULATIVE = "cumulative"  # after every step that changed it: the text and tokens so far (for streaming)
    DELTA = "delta"  # after every step that changed it: only the text, tokens and logprobs new since the last output
    FINAL_ONLY = "final_only"  # once, finished: no per-step outputs, and the text decoded once at the end


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's `structured_outputs`): exactly one of a JSON schema (a dict
    or its JSON text), any JSON object, a regular expression, one of a list of strings, or a Lark/EBNF grammar.
    The engine compiles it with llguidance and masks every token the constraint does not allow."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object is True else []
        _check(len(kinds) == 1, "structured_outputs",
               "structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
               f"got {kinds or 'none'}")
        _check(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs",
               "structured_outputs.json must be a JSON schema (an object or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), "structured_outputs",
                   f"structured_outputs.{name} must be a non-empty string")
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs", "structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))


# StructuredOutputsParams' fields: the keys a `structured_outputs` dict may hold.
STRUCTURED_OUTPUT_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 is greedy. top_k 0 (or -1) means no top-k cut. `seed` makes sampling reproducible
    whatever else shares the batch. `stop` strings are matched on the detokenized text and cut from it (kept with
    include_stop_str_in_output, which keeps a stop_token_ids token's text too). Before min_tokens tokens nothing
    stops a request: EOS and stop_token_ids are banned, and the text those tokens produce is not matched against
    `stop` (vLLM's rules).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # Top logprobs per output / prompt token (vLLM's; True reads as 1). vLLM's -1 (the whole vocabulary) is refused,
    # as vLLM refuses it under its default max_logprobs (20).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # False: no text at all, token ids only (vLLM's); stop strings then cannot be matched and are refused.
    detokenize: bool = True
    skip_special_tokens: bool = True
    # With skip_special_tokens=False: False renders an added token that follows another one as its bare content,
    # where the tokenizer's decoder would put a space before it (vLLM's rule; byte-level and SentencePiece decoders put
    # none, so it changes nothing there).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Prefix-cache isolation: only requests with the same salt share cached KV blocks (vLLM's field).
    cache_salt: str | None = None
    # Constrained decoding (a JSON schema, a regex, a choice, a grammar); a dict is read as its fields.
    structured_outputs: StructuredOutputsParams | None = None
    # Keep only the prompt's last k tokens (left truncation; -1: as many as fit, max_model_len - 1), vLLM's field.
    truncate_prompt_tokens: int | None = None
    # Only these tokens may be generated (vLLM's field); None: any token.
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's field): the last token of each word's tokens is forbidden wherever the output
    # ends in the tokens before it.
    bad_words: list[str] | None = None
    # Arbitrary arguments for custom sampling code (vLLM's field): kept with the request, used by nothing in jserve.
    extra_args: dict[str, Any] | None = None
    # Filled by the engine, not by users: the tokens that end the request besides stop_token_ids.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)
    # Filled by the engine, not by users: the vocabulary outside allowed_token_ids, which the sampler forbids.
    banned_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Filled by the engine, not by users: the token ids of each bad word, as vLLM tokenizes them.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        # vLLM's conveniences: logprobs=True is 1, seed=-1 is no seed, a repeated stop token id counts once.
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Checked before list() so that a bare number names its field instead of failing as "not iterable".
        _check(self.stop is None or isinstance(self.stop, (list, tuple)), "stop",
               f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
               f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if all(_is_int(t) for t in self.stop_token_ids):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))  # once each (vLLM's)
        _check(self.allowed_token_ids is None or isinstance(self.allowed_token_ids, (list, tuple)),
               "allowed_token_ids", f"allowed_token_ids must be a list of token ids, got "
                                    f"{type(self.allowed_token_ids).__name__}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        _check(self.bad_words is None or isinstance(self.bad_words, (list, tuple)), "bad_words",
               f"bad_words must be a list of strings, got {type(self.bad_words).__name__}")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - set(STRUCTURED_OUTPUT_KEYS), key=str)
            _check(not unknown, "structured_outputs",
                   f"structured_outputs got an unexpected keyword {', '.join(map(repr, unknown))}; "
                   f"the allowed keys are {', '.join(STRUCTURED_OUTPUT_KEYS)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad parameter."""
        _check(_is_int(self.n) and self.n >= 1, "n", f"n must be at least 1, got {self.n!r}")
        _check(_is_num(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
               f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 100, "repetition_penalty",
               f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be non-negative, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64), "seed",
               f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            whole = " (-1, the whole vocabulary, is not supported: vLLM also refuses it unless started with " \
                    "--max-logprobs -1)" if _is_int(value) and value == -1 else ""
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                   f"{name} must be between 0 and {MAX_LOGPROBS}, got {value!r}{whole}")
        for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name,
                   f"{name} must be true or false, got {getattr(self, name)!r}")
        _check(self.detokenize or not self.stop, "stop",
               "stop strings are only supported when detokenize is True (they are matched on the text)")
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args",
               f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers")
        _check(self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
            _is_int(t) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
               "allowed_token_ids must be a non-empty list of non-negative integers")
        _check(self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
               "bad_words must be non-blank strings")
        _check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                      and (self.truncate_prompt_tokens >= 1
                                                           or self.truncate_prompt_tokens == -1)),
               "truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or a positive integer, got "
                                         f"{self.truncate_prompt_tokens!r}")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str)
                                           and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_LEN), "cache_salt",
               f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LEN} characters")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "structured_outputs must be a StructuredOutputsParams or a dict of its fields")
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
               f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "logit_bias must map token ids to numbers")
            for token, bias in self.logit_bias.items():
                _check(_is_int(token) and token >= 0 and _is_num(bias) and -100 <= bias <= 100, "logit_bias",
                       f"logit_bias must map token ids to values in [-100, 100], got {token!r}: {bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> SamplingParams:
        """A copy that shares no mutable field with this one (vLLM's clone), with `changes` applied and checked."""
        if self.logit_bias is not None:
            changes.setdefault("logit_bias", dict(self.logit_bias))
        if self.extra_args is not None:
            changes.setdefault("extra_args", copy.deepcopy(self.extra_args))
        return dataclasses.replace(self, **changes)  # __post_init__ copies the lists

    @staticmethod
    def from_optional(**kwargs: Any) -> SamplingParams:
        """vLLM's SamplingParams.from_optional: SamplingParams(**kwargs) where a None for n, presence_penalty,
        frequency_penalty, repetition_penalty, temperature or top_p means that field's default."""
        for name in ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p"):
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]
        return SamplingParams(**kwargs)

    def __repr__(self) -> str:
        """vLLM's format and fields, then the set ones vLLM's repr leaves out."""
        text = (f"SamplingParams(n={self.n}, presence_penalty={self.presence_penalty}, "
                f"frequency_penalty={self.frequency_penalty}, repetition_penalty={self.repetition_penalty}, "
                f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}, "
                f"seed={self.seed}, stop={self.stop}, stop_token_ids={self.stop_token_ids}, "
                f"bad_words={self.bad_words or []}, include_stop_str_in_output={self.include_stop_str_in_output}, "
                f"ignore_eos={self.ignore_eos}, max_tokens={self.max_tokens}, min_tokens={self.min_tokens}, "
                f"logprobs={self.logprobs}, prompt_logprobs={self.prompt_logprobs}, "
                f"skip_special_tokens={self.skip_special_tokens}, "
                f"spaces_between_special_tokens={self.spaces_between_special_tokens}, "
                f"structured_outputs={self.structured_outputs}, extra_args={self.extra_args}")
        default = SamplingParams.__dataclass_fields__
        rest = [f"{name}={getattr(self, name)!r}" for name in _REPR_EXTRA
                if getattr(self, name) != default[name].default]
        return text + "".join(", " + r for r in rest) + ")"


# Fields a user sets that vLLM's SamplingParams.__repr__ does not show: shown after them where not the default.
_REPR_EXTRA = ("logit_bias", "allowed_token_ids", "detokenize", "output_kind", "cache_salt", "truncate_prompt_tokens")


# The fields a user sets (a dict of sampling fields, a JSONL line): all but the engine's own ones.
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {
    "eos_token_ids", "banned_token_ids", "bad_words_token_ids"}


def default_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """vLLM's default sampling parameters: SamplingParams with the model's recommended fields (defaults:
    jserve.config.generation_defaults). Its max_tokens, where the model recommends one, is left None: the engine
    then generates at most that many, or what the context has left where that is fewer."""
    fields = {k: v for k, v in defaults.items() if k != "max_tokens"}
    if "max_tokens" in defaults:
        fields["max_tokens"] = None
    return SamplingParams(**fields)


def with_defaults(params: SamplingParams, given: Iterable[str], defaults: Mapping[str, Any]) -> SamplingParams:
    """params with each of the model's recommended fields that its request (an HTTP body, a JSONL line) left out, as
    vLLM fills them; max_tokens excepted (the engine caps a request without one at the model's)."""
    given = set(given)
    changes = {k: v for k, v in defaults.items() if k != "max_tokens" and k not in given}
    return params.clone(**changes) if changes else params


class InvalidParameterError(ValueError):
    """A ValueError that remembers which request parameter was wrong (the server reports it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # rejects NaN
