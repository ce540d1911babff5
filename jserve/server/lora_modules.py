"""LoRA adapters a server serves by name (vLLM's `--lora-modules`): a request whose `model` is an adapter's name
runs on the adapter's base model with that adapter.

Each adapter is `NAME=PATH` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`. Adapters get
lora_int_id 1, 2, ... in the order given, and belong to the first served model unless base_model_name names
another. Light to import (the CLI parses the flag with it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass

_JSON_KEYS = ("name", "path", "base_model_name")


@dataclass(frozen=True)
class LoraModule:
    """One served adapter: the name requests use in `model`, its PEFT directory, and the served model it adapts
    (None: the first)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """`NAME=PATH` or `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError saying what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{text!r} is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{text!r}: expected a JSON object")
        unknown = sorted(set(value) - set(_JSON_KEYS))
        if unknown:
            raise ValueError(f"{text!r}: unknown key {unknown[0]!r} (known: {', '.join(_JSON_KEYS)})")
        for key in ("name", "path"):
            if not isinstance(value.get(key), str) or not value[key]:
                raise ValueError(f"{text!r}: {key!r} must be a non-empty string")
        base = value.get("base_model_name")
        if base is not None and (not isinstance(base, str) or not base):
            raise ValueError(f"{text!r}: 'base_model_name' must be a non-empty string")
        return LoraModule(value["name"], value["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{text!r}: expected NAME=PATH or a JSON object "
                         '{"name": ..., "path": ..., "base_model_name": ...}')
    return LoraModule(name.strip(), path.strip())


def lora_module_arg(text: str) -> LoraModule:
    """parse_lora_module as an argparse type: its message in argparse's error."""
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def assign_adapters(modules: Sequence[LoraModule], models: dict[str, bool]) -> list[tuple[str, LoraModule, int]]:
    """(base model name, adapter, lora_int_id) for each adapter, given the served models' names (in order) and
    whether each runs with enable_lora. Raises ValueError for duplicate names, a name that is a served model's, an
    unknown base_model_name, or a base model without enable_lora."""
    names = list(models)
    seen: set[str] = set()
    out = []
    for lora_int_id, module in enumerate(modules, start=1):
        if module.name in models:
            raise ValueError(f"--lora-modules: {module.name!r} is the name of a served model; give the adapter its "
                             "own name")
        if module.name in seen:
            raise ValueError(f"--lora-modules: several adapters are named {module.name!r}")
        seen.add(module.name)
        base = module.base_model_name or names[0]
        if base not in models:
            raise ValueError(f"--lora-modules: adapter {module.name!r} names base_model_name {base!r}, which is not "
                             f"a served model (served: {', '.join(names)})")
        if not models[base]:
            raise ValueError(f"--lora-modules needs --enable-lora: adapter {module.name!r} is for the model {base!r},"
                             " which is served without LoRA (enable_lora)")
        out.append((base, module, lora_int_id))
    return out
