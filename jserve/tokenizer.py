"""Tokenizer loading, chat templates, streaming detokenization and stop-string matching.

`Tokenizer` wraps a Hugging Face tokenizer read from a local directory. `IncrementalDetokenizer` turns one
output stream's token ids into text deltas that are always complete characters, and `StopStringMatcher`
cuts a stream of text deltas at the first stop string without ever emitting part of one.

Text is decoded without `clean_up_tokenization_spaces` everywhere (as vLLM does): that clean-up rewrites
text across token boundaries, so a stream could not agree with a one-shot decode if it were applied.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

from checkpoints import is_gguf_file
from jserve.config import ModelLoadError
from jserve.sampling_params import InvalidParameterError

# Prompt tokens decoded ahead of the first generated token so it gets the leading space it has in context.
PROMPT_CONTEXT_TOKENS = 5
# How far back into the prompt we look for context that decodes to some text (skipped specials decode to "").
MAX_PROMPT_CONTEXT_TOKENS = 64
# Held tokens after which an incomplete character is emitted anyway: only a malformed byte stream gets here,
# and the bound keeps the cost of one add() independent of the output's length.
MAX_HELD_TOKENS = 128
REPLACEMENT_CHAR = "\ufffd"
# SentencePiece's space and byte-fallback tokens (<0x00>..<0xFF>), as vocabularies spell them.
SENTENCEPIECE_SPACE = "\u2581"

# Files that hold a vocabulary; a directory with only tokenizer_config.json would load as an empty tokenizer.
_VOCAB_FILES = frozenset({"tokenizer.json", "vocab.json", "vocab.txt", "tekken.json"})
_VOCAB_SUFFIXES = (".model", ".tiktoken")  # SentencePiece and tiktoken vocabularies


class TokenizerLoadError(ModelLoadError):
    """There is no usable tokenizer at the given path; the message names the path."""


class ChatTemplateError(ValueError):
    """The model's tokenizer has no chat template, so chat messages cannot be turned into a prompt."""


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Tokenizer:
    """Load the Hugging Face tokenizer stored in the local directory `path`, or the one a GGUF file's metadata
    describes (`path` the file, or a directory whose only tokenizer is one .gguf file); never touches the network."""
    path = os.fspath(path)
    gguf_file = _gguf_file(path)
    if gguf_file is not None:
        return _load_gguf_tokenizer(gguf_file)
    if not os.path.isdir(path):
        raise TokenizerLoadError(f"no tokenizer at {path!r}: not a directory or a .gguf file")
    if not any(name in _VOCAB_FILES or name.endswith(_VOCAB_SUFFIXES) for name in os.listdir(path)):
        raise TokenizerLoadError(f"no tokenizer at {path!r}: expected tokenizer.json, tokenizer.model, "
                                 "vocab.json or one .gguf file in the directory")
    from transformers import AutoTokenizer  # imported here so that importing jserve stays fast

    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code,
                                           config=_model_type_only_config(path))
    except Exception as e:  # transformers raises OSError, ValueError or KeyError depending on what is wrong
        raise TokenizerLoadError(f"cannot load the tokenizer at {path!r}: {e}") from e
    return _wrap(hf)


def _gguf_file(path: str) -> str | None:
    """The GGUF file whose metadata holds the tokenizer: path itself (named .gguf, or an Ollama blob), or a
    directory's one .gguf file where the directory has no tokenizer files of its own."""
    if os.path.isfile(path):
        return path if is_gguf_file(path) else None
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if any(name in _VOCAB_FILES or name.endswith(_VOCAB_SUFFIXES) for name in names):
        return None
    ggufs = [name for name in names if name.endswith(".gguf")]
    return os.path.join(path, ggufs[0]) if len(ggufs) == 1 else None


def _load_gguf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of the file's tokenizer.* metadata (vocabulary, merges, special tokens, chat template), built by
    transformers' GGUF tokenizer conversion (jserve.gguf_tokenizer)."""
    from jserve.gguf_tokenizer import gguf_tokenizer

    try:
        hf = gguf_tokenizer(path)
    except Exception as e:  # transformers raises ValueError, KeyError, ImportError, ... on what it cannot convert
        raise TokenizerLoadError(f"cannot build a tokenizer from the GGUF file {path!r}: {e}") from e
    return _wrap(hf)


def _wrap(hf: Any) -> Tokenizer:
    # The engine checks a prompt against max_model_len itself; transformers' own limit would only log a misleading
    # "indexing errors" warning for every long prompt (and bench serve builds its prompts from long random texts).
    hf.model_max_length = int(1e30)
    return Tokenizer(hf)


def _model_type_only_config(path: str) -> Any | None:
    """What AutoTokenizer needs of the model's config when tokenizer_config.json names the tokenizer class: the model
    type (for its per-family exceptions) and any tokenizer_class. Left to load the config itself, AutoTokenizer
    imports the model family's config class and with it transformers' modeling stack: 2 s of the 135M model's start-
    up here. None (AutoTokenizer loads the config as usual) where the class is not named or comes from remote code."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            tokenizer_config = json.load(f)
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model_config = json.load(f)
    except (OSError, ValueError):
        return None
    if not (isinstance(tokenizer_config, dict) and isinstance(model_config, dict)
            and isinstance(tokenizer_config.get("tokenizer_class"), str) and "auto_map" not in tokenizer_config
            and isinstance(model_config.get("model_type"), str)):
        return None
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.model_type = model_config["model_type"]
    config.tokenizer_class = model_config.get("tokenizer_class")
    config._name_or_path = path
    return config


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character a byte-level BPE vocabulary spells each byte with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(unprintable)}}


_BYTE_DECODER = {char: byte for byte, char in _bytes_to_unicode().items()}


def _decoder_types(state: Any) -> set[str]:
    """The types of a `tokenizers` decoder's JSON state, Sequence members included."""
    if not isinstance(state, dict):
        return set()
    types = {state.get("type")}
    for member in state.get("decoders") or []:
        types |= _decoder_types(member)
    return types


def _plain_rust_decode(hf: Any):
    """The `tokenizers` decode that hf.decode(ids, clean_up_tokenization_spaces=False) comes down to, when hf is a
    fast tokenizer whose class changes neither step (transformers' TokenizersBackend); else None."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(hf)
    if not isinstance(hf, TokenizersBackend) or cls._decode is not TokenizersBackend._decode or \
            cls.decode is not TokenizersBackend.decode:
        return None
    return hf.backend_tokenizer.decode


class Tokenizer:
    """A Hugging Face tokenizer with the few operations serving needs; `.hf` is the tokenizer itself."""

    def __init__(self, hf: Any):
        self.hf = hf
        self._rust_decode = _plain_rust_decode(hf)
        self._token_text: dict[bool, dict[int, str]] = {True: {}, False: {}}  # decode_token's, by skip_special_tokens
        self._token_bytes: dict[int, bytes] = {}

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    @cached_property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte-fallback tokens (<0x00>..<0xFF>)."""
        names = [f"<0x{b:02X}>" for b in range(256)]
        ids = self.hf.convert_tokens_to_ids(names)
        return frozenset(i for name, i in zip(names, ids, strict=True)
                         if i is not None and self.hf.convert_ids_to_tokens(i) == name)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that decode(skip_special_tokens=True) may drop (a superset is safe: it only delays text)."""
        added = self.hf.added_tokens_decoder.items()
        return frozenset(i for i, token in added if token.special) | frozenset(self.hf.all_special_ids)

    @cached_property
    def added_token_ids(self) -> frozenset[int]:
        """Ids of added tokens, whose vocabulary entry is their literal text (not spelled in bytes or with ▁)."""
        return frozenset(self.hf.added_tokens_decoder)

    @cached_property
    def token_spelling(self) -> str:
        """How the vocabulary spells a token's bytes: "byte_level" (GPT-2's byte alphabet), "sentencepiece" (▁ for a
        space, <0xNN> byte-fallback tokens) or "text" (neither: a token's bytes are its decoded text's)."""
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        if decoder is None:  # a slow (Python) tokenizer
            if hasattr(self.hf, "byte_decoder"):
                return "byte_level"
            return "sentencepiece" if hasattr(self.hf, "sp_model") else "text"
        types = _decoder_types(json.loads(decoder.__getstate__()))
        if "ByteLevel" in types:
            return "byte_level"
        return "sentencepiece" if types & {"Metaspace", "ByteFallback", "Replace"} else "text"

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, remembered: for a token that is part of a multi-byte character (a byte-level BPE
        byte, a <0xE2> byte-fallback token) not valid UTF-8 on its own, where decode([token_id]) gives U+FFFD. The
        bytes of an output's tokens, joined, are its text's UTF-8; a SentencePiece word's ▁ is its space."""
        token_id = int(token_id)
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = self._spelled_bytes(token_id)
        return raw

    def _spelled_bytes(self, token_id: int) -> bytes:
        spelling = self.token_spelling
        token = None if spelling == "text" or token_id in self.added_token_ids else \
            self.hf.convert_ids_to_tokens(token_id)
        if isinstance(token, str) and token:
            if spelling == "byte_level" and all(char in _BYTE_DECODER for char in token):
                return bytes(_BYTE_DECODER[char] for char in token)
            if spelling == "sentencepiece":
                if token_id in self.byte_token_ids:
                    return bytes([int(token[3:5], 16)])
                return token.replace(SENTENCEPIECE_SPACE, " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._rust_decode is not None:  # what hf.decode does here, without ~3 us of Python (twice a token)
            return self._rust_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """decode([token_id]), remembered: a function of the token alone, and a stream asks for it once a token."""
        known = self._token_text[skip_special_tokens]
        text = known.get(token_id)
        if text is None:
            text = known[token_id] = self.decode([token_id], skip_special_tokens)
        return text

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> str:
        """The prompt text the chat template makes of `messages` (OpenAI-style role/content dicts)."""
        return self.hf.apply_chat_template(self._chat_messages(messages, kwargs), tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        """The prompt token ids the chat template makes of `messages`, as Hugging Face tokenizes them."""
        messages = self._chat_messages(messages, kwargs)
        ids = self.hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                          add_generation_prompt=add_generation_prompt, **kwargs)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # BatchEncoding is a Mapping

    def _chat_messages(self, messages: Any, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.has_chat_template and not kwargs.get("chat_template"):
            name = getattr(self.hf, "name_or_path", "") or type(self.hf).__name__
            raise ChatTemplateError(f"the model's tokenizer ({name}) has no chat template; use a completion "
                                    "prompt instead of chat messages, or pass a chat_template")
        return normalize_messages(messages)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style chat messages and return copies whose content is a plain string.

    A content list of {"type": "text", "text": ...} parts is joined with newlines, as vLLM does. Raises
    InvalidParameterError (a ValueError) naming the first bad message.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidParameterError("messages", "messages must be a non-empty list of role/content objects")
    return [_normalize_message(message, i) for i, message in enumerate(messages)]


def _normalize_message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidParameterError("messages", f"{where} must be an object with 'role' and 'content', "
                                                f"got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidParameterError("messages", f"{where}.role must be a non-empty string, got {role!r}")
    content = message.get("content")
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [_template_tool_call(call) for call in message["tool_calls"]]}
        if content is None:  # an assistant turn that only calls tools: templates that know no tools still render it
            return {**message, "content": ""}
    return {**message, "content": _content_text(content, where)}


def _template_tool_call(call: Any) -> Any:
    """An OpenAI tool call with its arguments as an object: OpenAI sends them as JSON text, chat templates (Hermes,
    Qwen, Llama 3) render them from a mapping."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass
    return call


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameterError("messages", f"{where}.content must be a string or a list of text parts, "
                                                f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidParameterError("messages", f"{where}.content[{j}] must be "
                                                    f'{{"type": "text", "text": <string>}}, got {part!r}')
        texts.append(part["text"])
    return "\n".join(texts)


class IncrementalDetokenizer:
    """Turns one output stream's token ids into text deltas, a token at a time.

    Each add() decodes only a small window: the tokens of the last emitted delta (whose text is subtracted)
    plus the tokens not yet emitted (vLLM's prefix_offset/read_offset). The window starts inside the prompt,
    so the first generated token keeps the leading space it has after the prompt (SentencePiece decoders
    drop a leading space at the start of a sequence). Text is held back while it ends in an incomplete
    multi-byte character, or in a run of byte-fallback tokens (decoded as a whole), so a stream of valid
    UTF-8 never shows U+FFFD.

    Everything returned by add() and finish() together is the text the generated tokens add to the decoded
    prompt: `decode(prompt + output)` minus `decode(prompt)`. For byte-level BPE that is exactly
    `decode(output)`; for SentencePiece it is `decode(output)` with its stripped leading space kept.

    With streaming=False add() only records the token and returns "", and finish() returns that whole text in
    one decode: for outputs nobody reads before they finish (two decodes a token saved).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, streaming: bool = True,
                 spaces_between_special_tokens: bool = True):
        # A bare Hugging Face tokenizer works too, but a shared Tokenizer computes byte_token_ids only once.
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.streaming = streaming
        # vLLM's rule (its FastIncrementalDetokenizer): only with special tokens kept, an added token right after
        # another generated added token is its bare content, whatever space the tokenizer's decoder puts before it.
        self._bare_added = not (skip_special_tokens or spaces_between_special_tokens) and \
            bool(self.tokenizer.added_token_ids)
        self.token_ids: list[int] = []
        self._context_len = 1 << 62  # while the prompt context is chosen: no split rule inside it
        self._ids = self._prompt_context([int(i) for i in prompt_token_ids])  # context + output ids
        self._context_len = len(self._ids)
        self._prefix_offset = 0  # start of the window: the tokens of the last delta (or the context)
        self._read_offset = len(self._ids)  # tokens from here on are not emitted yet
        self._context_text = self._prefix_text = self._decode(self._ids)
        self._pieces: list[str] = []
        self._in_byte_run = False  # the last token that reaches the decoder is a byte-fallback token
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]  # join once, so repeated reads stay linear
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Take the next generated token; return the text it completes (often "", never half a character)."""
        if self._finished:
            raise RuntimeError("add() after finish()")
        token_id = int(token_id)
        self._ids.append(token_id)
        self.token_ids.append(token_id)
        if not self.streaming:
            return ""
        held = len(self._ids) - self._read_offset
        if not (self.skip_special_tokens and token_id in self.tokenizer.special_token_ids):
            self._in_byte_run = token_id in self.tokenizer.byte_token_ids  # skipped tokens do not end a run
        if self._in_byte_run and held < MAX_HELD_TOKENS:
            return ""  # a byte-fallback run is decoded as a whole, so wait until it ends
        new_text = self._decode(self._ids[self._prefix_offset:], self._prefix_offset)
        if not self._is_complete(new_text, held):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._read_offset - self._prefix_offset == 1:  # the usual delta: one token, whose text is remembered
            self._prefix_text = self.tokenizer.decode_token(token_id, self.skip_special_tokens)
        else:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset], self._prefix_offset)
        return self._emit(delta)

    def finish(self) -> str:
        """Flush what is held back; afterwards `text` is the output's full text (see the class doc)."""
        if self._finished:
            return ""
        self._finished = True
        emitted = self.text
        for reference in self._references():
            if reference.startswith(emitted):
                return self._emit(reference[len(emitted):])
        new_text = self._decode(self._ids[self._prefix_offset:], self._prefix_offset)  # only a malformed stream
        return self._emit(new_text[len(self._prefix_text):])

    def _is_complete(self, new_text: str, held: int) -> bool:
        if len(new_text) <= len(self._prefix_text) or not new_text.startswith(self._prefix_text):
            return False  # no new text yet (e.g. a skipped special token)
        return not new_text.endswith(REPLACEMENT_CHAR) or held >= MAX_HELD_TOKENS

    def _references(self) -> Iterator[str]:
        """The full output text, decoded in one go: in its prompt context first, else on its own."""
        in_context = self._decode(self._ids)
        if in_context.startswith(self._context_text):
            yield in_context[len(self._context_text):]
        yield self._decode(self.token_ids, self._context_len)

    def _prompt_context(self, prompt: list[int]) -> list[int]:
        start = max(0, len(prompt) - PROMPT_CONTEXT_TOKENS)
        limit = max(0, len(prompt) - MAX_PROMPT_CONTEXT_TOKENS)
        while start > limit and not self._decode(prompt[start:]):
            start = max(limit, start - PROMPT_CONTEXT_TOKENS)
        return prompt[start:]

    def _decode(self, ids: list[int], start: int = 0) -> str:
        """The text of ids, which begin at self._ids[start]."""
        if not self._bare_added:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        added = self.tokenizer.added_token_ids
        first = max(1, self._context_len - start + 1)  # a split needs a generated added token before it
        cuts = [i for i in range(first, len(ids)) if ids[i] in added and ids[i - 1] in added]
        if not cuts:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        pieces = [self.tokenizer.decode(ids[:cuts[0]], skip_special_tokens=False)]
        for cut, end in zip(cuts, [*cuts[1:], len(ids)], strict=True):
            text = self.tokenizer.decode(ids[cut:end], skip_special_tokens=False)
            token_text = self.tokenizer.decode_token(ids[cut], skip_special_tokens=False)
            content = self.tokenizer.hf.added_tokens_decoder[ids[cut]].content
            pieces.append(content + text[len(token_text):] if text.startswith(token_text) else text)
        return "".join(pieces)

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta


class StopStringMatcher:
    """Cuts a stream of text deltas at the first stop string, never emitting any part of one.

    The first stop string to *complete* wins (it is the one a character-by-character stream would see
    first); of those completing at the same character, the longest. Text that could still become the
    start of a stop string is held back until it is decided. Feed it IncrementalDetokenizer's deltas (finish()
    included); when the stream ends without a match, flush() releases what is still held.
    """

    def __init__(self, stops: Iterable[str], include_stop_str: bool = False):
        self.stops = [stops] if isinstance(stops, str) else list(dict.fromkeys(stops))
        if not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stops!r}")
        self.include_stop_str = include_stop_str
        self.matched: str | None = None
        self._held = ""
        # Every proper prefix of a stop string: the text that may have to be held back.
        self._prefixes = {s[:k] for s in self.stops for k in range(1, len(s))}
        self._max_held = max((len(s) - 1 for s in self.stops), default=0)

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Take the next delta; return (text safe to emit now, the stop string matched or None)."""
        if self.matched is not None:
            return "", self.matched
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.matched, self._held = stop, ""
            return text[:start + len(stop) if self.include_stop_str else start], stop
        keep = self._held_suffix_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """The held-back text, at the end of a stream that did not stop on a string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop): earliest end, then longest
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), -len(stop)) < best[:2]):
                best = (start + len(stop), -len(stop), stop)
        return None if best is None else (best[0] + best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        for k in range(min(len(text), self._max_held), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
