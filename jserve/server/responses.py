"""OpenAI response objects, built from the engine's RequestOutputs: full responses and streaming chunks.

A `ChoiceTracker` remembers how much of each choice a stream has already sent, so every chunk carries only
the new text and logprobs; the non-streaming response is the same bookkeeping read once at the end.
"""

from __future__ import annotations

import base64
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jserve.outputs import CompletionOutput, Logprobs, RequestOutput

# JSON has no -Infinity: a logprob of a token that cannot be sampled is reported as this (as vLLM does).
MIN_LOGPROB = -9999.0
TokenBytes = Callable[[int], bytes]  # a token id's own bytes (Tokenizer.token_bytes)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict | str) -> bytes:
    """One Server-Sent Event carrying a JSON object (or the literal [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def finish_reason(output: CompletionOutput) -> str | None:
    # "abort" only happens when the client is gone or the server stops; report it as the stream ending early.
    return None if output.finish_reason is None else ("length" if output.finish_reason == "length" else "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _top(entry: Logprobs, k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def token_string(raw: bytes) -> str:
    """A token's text for logprobs: its bytes as UTF-8, or, for part of a multi-byte character (not valid UTF-8 on
    its own), "bytes:" and each byte as \\xNN, as OpenAI writes such tokens; so distinct byte tokens stay distinct."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _starts(raw: bytes) -> int:
    """How many characters the bytes start (UTF-8 continuation bytes, 0b10xxxxxx, start none)."""
    return sum((b & 0xC0) != 0x80 for b in raw)


def completion_logprobs(entries: list[Logprobs | int], token_bytes: TokenBytes, k: int, state: ChoiceState) -> dict:
    """The legacy completions logprobs object for consecutive positions of one choice; `state.text_offset` counts
    the characters the tokens before them start. A token's text_offset is the index of the character its first
    byte belongs to (the character it finishes, when that byte continues one an earlier token started). An entry
    that is a token id alone is an echoed prompt's first token: it has no logprob (null, as OpenAI's)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry in entries:
        unscored = not isinstance(entry, dict)
        token_id, logprob = (entry, None) if unscored else next(iter(entry.items()))  # the chosen token first
        raw = token_bytes(token_id)
        tokens.append(token_string(raw))
        token_lps.append(None if unscored else _lp(logprob))
        top: dict[str, float] | None = None if unscored else {}
        for t, lp in () if unscored else _top(entry, k):
            top.setdefault(token_string(token_bytes(t)), _lp(lp))  # same text, same key: the likelier one stays
        tops.append(top)
        continues = bool(raw) and (raw[0] & 0xC0) == 0x80
        offsets.append(max(0, state.text_offset - continues))
        state.text_offset += _starts(raw)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _token_logprob(raw: bytes, logprob: float) -> dict:
    return {"token": token_string(raw), "logprob": _lp(logprob), "bytes": list(raw)}


def chat_logprobs(entries: list[Logprobs], token_bytes: TokenBytes, k: int) -> dict:
    content = []
    for entry in entries:
        token_id, logprob = next(iter(entry.items()))
        content.append({**_token_logprob(token_bytes(token_id), logprob),
                        "top_logprobs": [_token_logprob(token_bytes(t), lp) for t, lp in _top(entry, k)]})
    return {"content": content, "refusal": None}


@dataclass
class ChoiceState:
    text_len: int = 0
    num_logprobs: int = 0
    text_offset: int = 0
    started: bool = False
    finished: bool = False


@dataclass
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[Logprobs]
    finish_reason: str | None
    first: bool  # this choice's first delta (chat sends the role before it)
    stop_reason: int | str | None = None  # the stop string or stop_token_ids id that ended it (vLLM's field)


@dataclass
class ChoiceTracker:
    """Per-request bookkeeping: choice index = prompt index * n + sample index, as vLLM numbers them."""

    n: int
    stop_token_ids: frozenset[int] = frozenset()  # the request's: an EOS (or a grammar's end) is no stop_reason
    # completions' echo: each prompt's text, put before its choices' text (with their logprobs, the prompt's first);
    # echo_only: the prompt alone, the token generated to score it left out (max_tokens 0)
    echo: list[str] | None = None
    echo_only: bool = False
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    finals: dict[int, CompletionOutput] = field(default_factory=dict)

    def update(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        """What changed in each choice since the last update (choices with nothing new are left out)."""
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        if output.prompt_logprobs is not None:  # a request's first output carries them
            self.prompt_logprobs[prompt_index] = [output.prompt_token_ids[0], *output.prompt_logprobs[1:]]
        deltas = []
        for out in output.outputs:
            index = prompt_index * self.n + out.index
            state = self.choices.setdefault(index, ChoiceState())
            self.completion_tokens[index] = 0 if self.echo_only else len(out.token_ids)
            if state.finished:
                continue
            text = "" if self.echo_only else out.text[state.text_len:]
            logprobs = [] if self.echo_only else (out.logprobs or [])[state.num_logprobs:]
            reason = finish_reason(out)
            reason = "length" if self.echo_only and reason is not None else reason  # max_tokens 0 reached
            generated = len(logprobs)
            if self.echo is not None and not state.started:
                text = self.echo[prompt_index] + text
                logprobs = self.prompt_logprobs.get(prompt_index, []) + logprobs
            if not (text or logprobs or reason):
                continue
            deltas.append(ChoiceDelta(index, text, logprobs, reason, first=not state.started,
                                      stop_reason=self._stop_reason(out)))
            state.text_len, state.num_logprobs = len(out.text), state.num_logprobs + generated
            state.started, state.finished = True, reason is not None
            if reason is not None:
                self.finals[index] = out
        return deltas

    def _stop_reason(self, out: CompletionOutput) -> int | str | None:
        reason = out.stop_reason if out.finish_reason == "stop" else None
        return reason if isinstance(reason, str) or reason in self.stop_token_ids else None

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()),
                     sum(self.cached_tokens.values()))


@dataclass
class ResponseHeader:
    """The fields every object of one response shares."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def obj(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: the numbers, or ("base64") their float32 little-endian bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector


def completion_choice(delta: ChoiceDelta, token_bytes: TokenBytes, k: int | None, state: ChoiceState) -> dict:
    logprobs = None if k is None else completion_logprobs(delta.logprobs, token_bytes, k, state)
    return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason}


def chat_message_choice(delta: ChoiceDelta, token_bytes: TokenBytes, k: int | None) -> dict:
    logprobs = None if k is None else chat_logprobs(delta.logprobs, token_bytes, k)
    return {"index": delta.index, "message": {"role": "assistant", "content": delta.text}, "logprobs": logprobs,
            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}


def chat_chunk_choices(delta: ChoiceDelta, token_bytes: TokenBytes, k: int | None,
                       parts: tuple[str, str] | None = None) -> list[dict]:
    """A chat delta as stream choices: the role on its own first (OpenAI's shape), then the content; parts: the
    delta's (reasoning, content) where a reasoning parser splits them."""
    choices = []
    if delta.first:
        choices.append({"index": delta.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
    logprobs = None if k is None else chat_logprobs(delta.logprobs, token_bytes, k)
    reasoning, content = ("", delta.text) if parts is None else parts
    body = {"reasoning_content": reasoning} if reasoning else {}
    body |= {"content": content} if content else {}
    choices.append({"index": delta.index, "delta": body, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                    **_stop_reason(delta)})
    return choices


def _stop_reason(delta: ChoiceDelta) -> dict:
    """A chunk's stop_reason: on the chunk that finishes its choice, as vLLM streams it."""
    return {"stop_reason": delta.stop_reason} if delta.finish_reason is not None else {}


def tool_chunk_choices(choice: dict) -> list[dict]:
    """A finished chat choice (a message that may hold tool_calls) as stream choices: the role, then the content or
    each call (its id, type and name with the whole arguments), then the finish reason, as OpenAI streams them. The
    choice's logprobs ride on the chunk after the role, so the stream carries what the whole message does."""
    index, message = choice["index"], choice["message"]
    chunks = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    if message.get("reasoning_content"):
        chunks.append({"index": index, "delta": {"reasoning_content": message["reasoning_content"]},
                       "logprobs": None, "finish_reason": None})
    if message.get("content"):
        chunks.append({"index": index, "delta": {"content": message["content"]}, "logprobs": None,
                       "finish_reason": None})
    chunks += tool_call_chunks(index, message.get("tool_calls") or [], choice["finish_reason"],
                               choice.get("stop_reason"))
    chunks[1]["logprobs"] = choice.get("logprobs")
    return chunks


def tool_call_chunks(index: int, calls: list[dict], finish_reason: str, stop_reason: int | str | None) -> list[dict]:
    """Each call (its id, type and name with the whole arguments) as a stream choice, then the finish reason."""
    chunks = [{"index": index, "delta": {"tool_calls": [{"index": i, **call}]}, "logprobs": None,
               "finish_reason": None} for i, call in enumerate(calls)]
    return chunks + [{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}]


def merge_deltas(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """Join the deltas a non-streaming request collected into one per choice."""
    merged: dict[int, ChoiceDelta] = {}
    for d in deltas:
        if d.index in merged:
            m = merged[d.index]
            m.text += d.text
            m.logprobs = m.logprobs + d.logprobs
            m.finish_reason = d.finish_reason or m.finish_reason
            m.stop_reason = d.stop_reason if d.finish_reason is not None else m.stop_reason
        else:
            merged[d.index] = ChoiceDelta(d.index, d.text, list(d.logprobs), d.finish_reason, d.first, d.stop_reason)
    return [merged[i] for i in sorted(merged)]
