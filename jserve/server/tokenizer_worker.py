"""The server's own tokenizer, used on one worker thread: prompts are tokenized off the event loop and off
the engine thread, and the engine's tokenizer (busy detokenizing on the engine thread) is never shared."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from jserve.server.protocol import bad_request
from jserve.tokenizer import ChatTemplateError, Tokenizer

T = TypeVar("T")
# apply_chat_template's own arguments (transformers'), which the server sets or which would change what it returns:
# a request's chat_template_kwargs holds the template's variables only. continue_final_message is the body's field.
_RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs"})


class TokenizerWorker:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # ids at or above it are rejected before they reach the tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jserve-tokenizer")

    async def _call(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._call(self.tokenizer.encode, text, add_special_tokens)

    async def chat(self, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of a conversation; template_kwargs: continue_final_message and the template's own
        variables (chat_template_kwargs), which may not set apply_chat_template's other arguments."""
        kwargs = dict(template_kwargs or {})
        taken = sorted(set(kwargs) & _RESERVED_TEMPLATE_ARGS)
        if taken:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets it",
                              "chat_template_kwargs")
        if tools:
            kwargs["tools"] = tools  # the chat template renders the tools where it knows how
        try:
            return await self._call(functools.partial(self.tokenizer.apply_chat_template, **kwargs), messages,
                                    add_generation_prompt)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # a template may raise anything on messages it does not expect (jinja errors)
            raise bad_request(f"the chat template cannot render these messages: {type(e).__name__}: "
                              f"{str(e)[:300]}", "messages") from None

    async def decode(self, ids: list[int]) -> str:
        """The text of the ids, special tokens included (as vLLM's /detokenize): /tokenize's ids of a chat prompt
        come back as the prompt."""
        self.check_ids(ids, "tokens")
        return await self._call(functools.partial(self.tokenizer.decode, skip_special_tokens=False), ids)

    async def token_bytes(self, ids: set[int]) -> dict[int, bytes]:
        """Each token's own bytes, for logprobs (the tokenizer remembers them: the same tokens come back all the
        time)."""
        return await self._call(lambda: {i: self.tokenizer.token_bytes(i) for i in ids})

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
