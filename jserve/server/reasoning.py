"""Reasoning models' thinking, split from their answer (vLLM's `--reasoning-parser`): a chat message's
`reasoning_content` beside its `content`, streamed as deltas of either.

- `deepseek_r1`: the reasoning runs up to `</think>`. The chat template opens `<think>` in the prompt, so the output
  may or may not repeat it; output that never closes it is all reasoning (DeepSeek-R1, QwQ, Qwen3's thinking-2507
  models).
- `qwen3`: the same where the output opens with `<think>`; output without it (Qwen3 with `enable_thinking: false`)
  is all content.
- `openai_gptoss`: gpt-oss's harmony messages. A message is `[<|start|>role]<|channel|>name[ to=recipient]
  [<|constrain|>format]<|message|>body`, ended by `<|end|>`, `<|call|>` or `<|return|>`. The `analysis` channel is
  reasoning; `final`, and `commentary` addressed to no tool (the preambles), are content; `commentary` addressed to
  `functions.NAME` is a tool call, whose body is the arguments. The markers are special tokens, so requests served
  with this parser keep special tokens in their text (`skip_special_tokens` false) and the parser takes them out.

A stream feeds each new piece of text to a `ReasoningStream`, which sends what is known: text that may still turn
out to be a marker (`</thi` at the end, a harmony header before its `<|message|>`) is held back until the next
piece or the end says what it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
_HARMONY_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in _HARMONY_MARKERS) + ")")
_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")


@dataclass
class Split:
    """A chat output's parts: reasoning, content, and (gpt-oss) the tool calls its messages address, each
    (function name, arguments text)."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)


def split_reasoning(text: str, parser: str, final: bool = True) -> Split:
    """The parts of `text`; with final False (a stream's text so far), anything that may still become a marker is
    left out of both."""
    if parser == "openai_gptoss":
        return _split_harmony(text, final)
    if parser not in ("deepseek_r1", "qwen3"):
        raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
    if not final and len(text) < len(THINK_OPEN) and THINK_OPEN.startswith(text):
        return Split()  # the output may be opening <think>
    if text.startswith(THINK_OPEN):
        text = text[len(THINK_OPEN):]
    elif parser == "qwen3":
        return Split(content=text)  # thinking off: no reasoning at all
    reasoning, closed, content = text.partition(THINK_CLOSE)
    if closed:
        return Split(reasoning, content)
    return Split(reasoning[:len(reasoning) - (0 if final else _marker_prefix(reasoning, (THINK_CLOSE,)))])


def _marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of text that begins one of the markers (0: none)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _split_harmony(text: str, final: bool) -> Split:
    out = Split()
    held = 0 if final else _marker_prefix(text, _HARMONY_MARKERS)
    pieces = _HARMONY_SPLIT.split(text[:len(text) - held])
    state, header, body = "outside", "", []  # outside a message, in its header, or in its body
    channel, recipient = "", None

    def close() -> None:
        text = "".join(body)
        if channel == "analysis":
            out.reasoning += text
        elif recipient is not None and recipient.startswith("functions."):
            out.calls.append((recipient.removeprefix("functions."), text))
        else:  # final, a preamble on commentary, or text outside any message
            out.content += text
        body.clear()

    for piece in pieces:
        if piece in ("<|start|>", "<|channel|>") and state != "body":
            if state == "outside":
                close()  # any stray text before the message is content
                channel, recipient, header = "", None, ""
            state, header = "header", header + piece
        elif piece == "<|message|>" and state == "header":
            name = re.search(r"<\|channel\|>\s*(\w+)", header)
            channel = name[1] if name else ""
            found = _RECIPIENT.search(header)
            recipient = found[1] if found else None
            state = "body"
        elif piece in _HARMONY_ENDS and state == "body":
            close()
            state, channel, recipient = "outside", "", None
        elif state == "header":
            header += piece
        else:
            body.append(piece)
    if state == "body" and recipient is not None and not final:
        return out  # a call's arguments are whole only at its end
    if state == "header" and final:  # a header the output never finished: what it says is all there is
        body.append(header)
    if state != "header" or final:
        close()
    return out


class ReasoningStream:
    """One streamed choice's text so far, turned piece by piece into reasoning and content deltas."""

    def __init__(self, parser: str):
        self.parser, self.text = parser, ""
        self.sent = Split()

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) after `piece`; final: the choice's last piece."""
        self.text += piece
        now = split_reasoning(self.text, self.parser, final)
        deltas = now.reasoning[len(self.sent.reasoning):], now.content[len(self.sent.content):]
        self.sent = now
        return deltas
