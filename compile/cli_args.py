"""Argument types and the parser class of ``python -m compile``: user errors are caught at parse
time, before any model loads, and reported as one line.

Every type raises ``argparse.ArgumentTypeError`` with ``expected <rule>, got <value>``; argparse
prefixes the flag (``argument --temperature: ...``) and ``CliParser.error`` prints that single
line to stderr and exits with status 2. Errors raised later, while a command runs, are internal
and keep their traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NoReturn

MODEL_NAMES = ("tiny", "default")


class CliParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line: ``prog: error: message (see prog --help)``.

    Subparsers inherit the class, so every subcommand reports the same way.
    """

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _int(text: str, rule: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _int(text, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _int(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def temperature(text: str) -> float:
    """argparse type: a finite number >= 0 (0 samples greedily)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 = greedy), "
                                         f"got {text!r}")
    return value


def model_name(text: str) -> str:
    """argparse type: ``tiny``, ``default``, an existing ``.gguf`` file or a Hugging Face model
    folder (one holding ``config.json``). Only the path is checked; nothing is loaded."""
    if text in MODEL_NAMES:
        return text
    path = Path(text).expanduser()
    if not path.exists():
        why = "no such file or folder"
    elif path.is_file() and path.suffix != ".gguf":
        why = "a file that is not .gguf"
    elif path.is_dir() and not (path / "config.json").is_file():
        why = "a folder without config.json"
    else:
        return text
    raise argparse.ArgumentTypeError(
        f"expected 'tiny', 'default', a .gguf file or a Hugging Face model folder, got {text!r} "
        f"({why})")


def existing_file(text: str) -> str:
    """argparse type: the path of an existing file."""
    if not Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"expected an existing file, got {text!r}")
    return text


__all__ = ["CliParser", "positive_int", "non_negative_int", "temperature", "model_name",
           "existing_file", "MODEL_NAMES"]
