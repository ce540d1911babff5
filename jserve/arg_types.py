"""argparse value types that refuse a bad value when the command line is parsed, before a model loads or a request
is sent (argparse then prints "argument --flag: <message>" and exits 2)."""

from __future__ import annotations

import argparse
import math
import os


def _parse(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def integer(minimum: int, maximum: float = math.inf):
    """An integer in [minimum, maximum]."""
    def parse(text: str) -> int:
        value = _parse(text, int, "an integer")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    value = _parse(text, float, "a number")
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _parse(text, float, "a number")
    if not 0 <= value < math.inf:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def range_ratio(text: str) -> float:
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def output_file(text: str) -> str:
    """A file the command writes at its end: its folder must exist and be writable now, not after the run."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {folder} is not writable")
    return text
