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

MODEL_NAMES = ("tiny", "default", "gemma3")
DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names for --dtype
GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file


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
    """argparse type: ``tiny``, ``default``, ``gemma3`` (when its package is installed), an
    existing ``.gguf`` file or a Hugging Face model folder (one holding ``config.json``). Only
    the path is checked; nothing is loaded."""
    if text == "gemma3":
        from compile.models.gguf import gemma3_missing
        missing = gemma3_missing()
        if missing:
            raise argparse.ArgumentTypeError(f"expected an installed model, got 'gemma3' "
                                             f"({missing})")
    if text in MODEL_NAMES:
        return text
    path = Path(text).expanduser()
    if not path.exists():
        why = "no such file or folder"
    elif path.is_file() and path.suffix != ".gguf":
        why = "a file that is not .gguf"
    elif path.is_file() and not _starts_with(path, GGUF_MAGIC):
        why = "not a GGUF file: it does not start with the GGUF magic bytes"
    elif path.is_dir() and not (path / "config.json").is_file():
        why = "a folder without config.json"
    else:
        return text
    raise argparse.ArgumentTypeError(
        f"expected 'tiny', 'default', 'gemma3', a .gguf file or a Hugging Face model folder, got "
        f"{text!r} ({why})")


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def prompt_text(text: str) -> str:
    """argparse type: a prompt with at least one non-blank character."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a prompt with non-blank text, got {text!r}")
    return text


def prompt_lines(text: str) -> list[str]:
    """argparse type: a UTF-8 text file of prompts, one per line; returns its non-blank lines
    (at least one)."""
    try:
        with open(Path(existing_file(text)).expanduser(), encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror or str(e)
        raise argparse.ArgumentTypeError(f"expected a readable UTF-8 file of prompts, got "
                                         f"{text!r} ({why})") from None
    if not lines:
        raise argparse.ArgumentTypeError(f"expected a file with one prompt per line, got "
                                         f"{text!r} (no non-blank line)")
    return lines


def existing_file(text: str) -> str:
    """argparse type: the path of an existing file."""
    if not Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"expected an existing file, got {text!r}")
    return text


__all__ = ["CliParser", "positive_int", "non_negative_int", "temperature", "model_name",
           "existing_file", "prompt_text", "prompt_lines", "MODEL_NAMES", "DTYPES",
           "GGUF_MAGIC"]
