"""OpenAI response objects, built from the engine's RequestOutputs: full responses and streaming chunks.

A `ChoiceTracker` remembers how much of each choice a stream has already sent, so every chunk carries only
the new text and logprobs; the non-streaming response is the same bookkeeping read once at the end.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from jserve.outputs import CompletionOutput, Logprobs, RequestOutput

# JSON has no -Infinity: a logprob of a token that cannot be sampled is reported as this (as vLLM does).
MIN_LOGPROB = -9999.0
TokenText = Callable[[int], str]


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


def completion_logprobs(entries: list[Logprobs], text: TokenText, k: int, offset: int) -> dict:
    """The legacy completions logprobs object for consecutive positions; offset is the text before them."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry in entries:
        token_id, logprob = next(iter(entry.items()))  # the chosen token comes first
        tokens.append(text(token_id))
        token_lps.append(_lp(logprob))
        top: dict[str, float] = {}
        for t, lp in _top(entry, k):
            top.setdefault(text(t), _lp(lp))  # tokens with the same text share a key: keep the likelier one
        tops.append(top)
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _token_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[Logprobs], text: TokenText, k: int) -> dict:
    content = []
    for entry in entries:
        token_id, logprob = next(iter(entry.items()))
        content.append({**_token_logprob(text(token_id), logprob),
                        "top_logprobs": [_token_logprob(text(t), lp) for t, lp in _top(entry, k)]})
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


@dataclass
class ChoiceTracker:
    """Per-request bookkeeping: choice index = prompt index * n + sample index, as vLLM numbers them."""

    n: int
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    finals: dict[int, CompletionOutput] = field(default_factory=dict)

    def update(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        """What changed in each choice since the last update (choices with nothing new are left out)."""
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        deltas = []
        for out in output.outputs:
            index = prompt_index * self.n + out.index
            state = self.choices.setdefault(index, ChoiceState())
            self.completion_tokens[index] = len(out.token_ids)
            if state.finished:
                continue
            text = out.text[state.text_len:]
            logprobs = (out.logprobs or [])[state.num_logprobs:]
            reason = finish_reason(out)
            if not (text or logprobs or reason):
                continue
            deltas.append(ChoiceDelta(index, text, logprobs, reason, first=not state.started))
            state.text_len, state.num_logprobs = len(out.text), state.num_logprobs + len(logprobs)
            state.started, state.finished = True, reason is not None
            if reason is not None:
                self.finals[index] = out
        return deltas

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


def completion_choice(delta: ChoiceDelta, text: TokenText, k: int | None, state: ChoiceState) -> dict:
    logprobs = None
    if k is not None:
        logprobs = completion_logprobs(delta.logprobs, text, k, state.text_offset)
        state.text_offset += sum(len(t) for t in logprobs["tokens"])
    return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}


def chat_message_choice(delta: ChoiceDelta, text: TokenText, k: int | None) -> dict:
    logprobs = None if k is None else chat_logprobs(delta.logprobs, text, k)
    return {"index": delta.index, "message": {"role": "assistant", "content": delta.text}, "logprobs": logprobs,
            "finish_reason": delta.finish_reason}


def chat_chunk_choices(delta: ChoiceDelta, text: TokenText, k: int | None) -> list[dict]:
    """A chat delta as stream choices: the role on its own first (OpenAI's shape), then the content."""
    choices = []
    if delta.first:
        choices.append({"index": delta.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
    logprobs = None if k is None else chat_logprobs(delta.logprobs, text, k)
    body = {"content": delta.text} if delta.text else {}
    choices.append({"index": delta.index, "delta": body, "logprobs": logprobs, "finish_reason": delta.finish_reason})
    return choices


def tool_chunk_choices(choice: dict) -> list[dict]:
    """A finished chat choice (a message that may hold tool_calls) as stream choices: the role, then the content or
    each call (its id, type and name with the whole arguments), then the finish reason, as OpenAI streams them."""
    index, message = choice["index"], choice["message"]
    chunks = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    if message.get("content"):
        chunks.append({"index": index, "delta": {"content": message["content"]}, "logprobs": None,
                       "finish_reason": None})
    for i, call in enumerate(message.get("tool_calls") or []):
        chunks.append({"index": index, "delta": {"tool_calls": [{"index": i, **call}]}, "logprobs": None,
                       "finish_reason": None})
    chunks.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]})
    return chunks


def merge_deltas(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """Join the deltas a non-streaming request collected into one per choice."""
    merged: dict[int, ChoiceDelta] = {}
    for d in deltas:
        if d.index in merged:
            m = merged[d.index]
            m.text += d.text
            m.logprobs = m.logprobs + d.logprobs
            m.finish_reason = d.finish_reason or m.finish_reason
        else:
            merged[d.index] = ChoiceDelta(d.index, d.text, list(d.logprobs), d.finish_reason, d.first)
    return [merged[i] for i in sorted(merged)]
