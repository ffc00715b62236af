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
import os
import sys
from pathlib import Path
from typing import NoReturn

MODEL_NAMES = ("tiny", "default", "gemma3")
DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names for --dtype
GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file
MAX_PAGE_SIZE = 4096  # tokens per KV page; sglang's page sizes are 1-256, FlashMLA's 64
# Files from which transformers builds a tokenizer offline; a model folder needs one of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "tokenizer_config.json")


class CliParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line: ``prog: error: message (see prog --help)``.

    Subparsers inherit the class, so every subcommand reports the same way.
    """

    def error(self, message: str) -> NoReturn:
        """Print the one line (under ``torchrun``, from rank 0 only: every rank parses the same
        arguments) and exit with status 2 (every rank)."""
        if int(os.environ.get("RANK", "0")) == 0:
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


def page_size(text: str) -> int:
    """argparse type: tokens per KV page, an integer in ``[1, MAX_PAGE_SIZE]``."""
    value = _int(text, f"an integer in [1, {MAX_PAGE_SIZE}]")
    if not 1 <= value <= MAX_PAGE_SIZE:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_PAGE_SIZE}] (tokens "
                                         f"per KV page), got {value}")
    return value


def cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """PyTorch CPU threads for ``generate`` when ``--threads`` is not given: half the cores
    this process may use (at least 1, at most 8). Decode of a small model is bound by memory
    and synchronisation, and every thread of an OpenMP team waits for the slowest: on a shared
    or small machine all cores lose most when another process takes one of them."""
    return max(1, min(8, cpu_count() // 2))


def threads(text: str) -> int:
    """argparse type: CPU threads, an integer in ``[0, cpu_count()]`` (0: PyTorch's default)."""
    most = cpu_count()
    value = _int(text, f"an integer in [0, {most}]")
    if not 0 <= value <= most:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {most}] (0: PyTorch's "
                                         f"default; at most the {most} cores this process may "
                                         f"use), got {value}")
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
    elif path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        why = f"a folder without tokenizer files: expected one of {', '.join(TOKENIZER_FILES)}"
    else:
        return text
    raise argparse.ArgumentTypeError(
        f"expected 'tiny', 'default', 'gemma3', a .gguf file or a Hugging Face model folder, got "
        f"{text!r} ({why})")


def packaged_model_missing(name) -> str | None:
    """Why the packaged model ``name`` (None or ``default``: SmolLM2; ``gemma3``) cannot load
    (its distribution is not installed), or None; only package metadata is read."""
    from compile.models.gguf import default_missing, gemma3_missing
    if name == "gemma3":
        return gemma3_missing()
    return default_missing() if name in (None, "default") else None


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
           "existing_file", "prompt_text", "prompt_lines", "page_size", "threads", "cpu_count",
           "default_threads", "packaged_model_missing", "MODEL_NAMES", "DTYPES", "GGUF_MAGIC",
           "MAX_PAGE_SIZE", "TOKENIZER_FILES"]
