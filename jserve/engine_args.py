"""The engine flags every subcommand that runs a model shares (`generate`, `serve`, `bench throughput|latency`).

A leaf of the CLI: the top-level `jserve.cli` and the subcommands' own `cli` modules import it, never the other
way round.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

from jserve.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser, *, repeatable: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field, so the CLI, the server and the Python API share every knob. The fields named
    in `repeatable` may be given several times (a list, None when absent): `jserve serve`'s one per --model."""
    hints = typing.get_type_hints(EngineConfig)
    docs = field_docs(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = hints[f.name]
        # argparse formats help with %, so the docstring's own % signs are escaped.
        help_text = docs[f.name].replace("%", "%%") + ("" if default is None else " (default: %(default)s)")
        if kind is bool:
            group.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            base = int if "int" in str(kind) else float if "float" in str(kind) else str
            if f.name in repeatable:
                group.add_argument(flag, action="append", default=None, type=base, metavar=f.name.upper(),
                                   help="may be repeated: one per served model, in --model order. " + help_text)
            else:
                group.add_argument(flag, default=default, type=base, metavar=f.name.upper(), help=help_text)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's text from the class docstring's "Attributes:" section (a `name: text` line, then lines indented
    deeper), whitespace collapsed: the flags' help is the Python API's documentation."""
    docs: dict[str, str] = {}
    section = (cls.__doc__ or "").split("Attributes:", 1)[-1]
    for match in re.finditer(r"^( +)(\w+): (.*(?:\n\1 +\S.*)*)", section, flags=re.M):
        docs[match.group(2)] = " ".join(match.group(3).split())
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
    if missing:
        raise AssertionError(f"{cls.__name__}'s docstring documents no {missing}")
    return docs


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The flags' EngineConfig; `overrides` replace fields (a repeatable flag's one value per model)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)} | overrides)
