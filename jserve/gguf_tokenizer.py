"""A GGUF file's tokenizer, built as transformers builds it (its `tokenizer.*` metadata through transformers' own
GGUF tokenizer conversion) but from jserve's reader of the file.

transformers' own path (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) reads the file with a module that
imports torch, which a serving install does not have; the conversion itself does not need it. Where transformers
lacks the conversion module (other versions), its own path is used.
"""

from __future__ import annotations

import os
from typing import Any

from checkpoints.gguf_reader import open_gguf


def gguf_tokenizer(path: str | os.PathLike) -> Any:
    """The Hugging Face tokenizer the GGUF file at `path` describes (vocabulary, merges, special tokens, chat
    template)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        return _transformers_gguf_tokenizer(path)
    from transformers import PreTrainedTokenizerFast

    metadata = open_gguf(path).metadata
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise ValueError("the file has no tokenizer.ggml.tokens (no vocabulary)")
    # As transformers' get_gguf_tokenizer: llama.cpp adds BOS to a sentencepiece vocabulary that does not say
    # otherwise; Gemma 4's chat template writes its own.
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_dict.get("tokenizer_type") == "gemma4":
        tokenizer_config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _transformers_gguf_tokenizer(path: str | os.PathLike) -> Any:
    from transformers import AutoTokenizer

    path = os.path.abspath(path)
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)
