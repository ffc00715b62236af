"""Models for ``python -m compile``: ``--model tiny`` (random weights, byte tokenizer) or a
GGUF / Hugging Face folder loaded offline by ``compile.models.gguf.load_hf``.

``tiny`` is a 2-layer ``transformers`` Llama with random weights, so every mode of ``generate``
(``--verify`` included: ``transformers``' own ``generate`` runs on the same weights) and
``check`` can be exercised in seconds without any downloaded file.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Iterator, Optional

import torch

from compile.graphs import device as dev

TINY = "tiny"
# A 2-layer GQA Llama over a 256-token byte vocabulary (token id = UTF-8 byte).
TINY_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                   pad_token_id=None)


class ByteTokenizer:
    """A tokenizer for ``tiny``: one token per UTF-8 byte, no chat template.

    There is no end-of-sequence token, so every request runs to ``max_new_tokens``.
    """

    chat_template = None
    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [i for i in ids if not (skip_special_tokens and i == self.eos_token_id)]
        return bytes(ids).decode("utf-8", errors="replace")


def tiny_hf_model(seed: int = 0, std: float = 0.15):
    """A ``transformers`` ``LlamaForCausalLM`` of ``TINY_CONFIG`` shape with N(0, std) weights.

    ``std`` is larger than Hugging Face's 0.02 so greedy argmax margins stay well above float32
    rounding differences between the engine's modes and ``transformers``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_CONFIG)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda, else xpu, else cpu; an explicit device must exist.

    Raises:
        RuntimeError: the requested accelerator is not available.
    """
    has = {kind: dev.is_available(kind) for kind in ("cuda", "xpu", "cpu")}
    if name == "auto":
        return torch.device(next(d for d in ("cuda", "xpu", "cpu") if has[d]))
    if not has[name]:
        available = ", ".join(d for d in ("cpu", "cuda", "xpu") if has[d])
        built = {"cuda": torch.backends.cuda.is_built,
                 "xpu": getattr(torch.xpu, "_is_compiled", lambda: False)}[name]()
        why = (f"this PyTorch build supports {name} but finds no {name} device" if built
               else f"no {name} device in this PyTorch build")
        raise RuntimeError(f"argument --device: expected auto or an available device "
                           f"({available}), got {name!r} ({why})")
    return torch.device(name)


ENGINE_OPS = ("store_kv_cache", "flash_attn_with_kvcache")  # what every attention layer calls


def check_ops_environment(device_type: str) -> None:
    """Check xpu_ops' environment before a model loads: ``XPU_OPS_PROVIDER`` names a provider
    that runs ``ENGINE_OPS`` on ``device_type``, and ``XPU_OPS_TRITON_PATHS`` (read when the
    providers load) names known kernel paths.

    Raises:
        ValueError: naming the variable, what it must be and what it is.
    """
    from xpu_ops import providers

    forced = providers.forced_provider()
    for op in ENGINE_OPS:
        why = dict(providers.candidates(op, device_type))
        if forced is not None and why[forced] is not None:
            raise ValueError(f"XPU_OPS_PROVIDER: expected a provider that runs {op} on "
                             f"{device_type}, got {forced!r} ({why[forced]}). Unset it to use "
                             f"the best available one.")


class ModelLoadError(ValueError):
    """A model the user named (a ``.gguf`` file or a folder) could not be read or converted;
    ``python -m compile`` reports it as a one-line argument error."""


# What reading a malformed or unsupported model raises: missing or unreadable files, a corrupt
# GGUF (struct.error, EOFError, ValueError), absent tensors (KeyError), an architecture or RoPE
# type the zoo lacks (NotImplementedError), a config.json that transformers' config validation
# rejects (huggingface_hub's StrictDataclassError, which is no ValueError: e.g. layer_types
# shorter than num_hidden_layers).
LOAD_ERRORS = (OSError, ValueError, KeyError, EOFError, struct.error, NotImplementedError)
try:
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub: no strict config dataclasses
    pass
else:
    LOAD_ERRORS += (StrictDataclassError,)


@contextlib.contextmanager
def user_model_errors(name: Optional[str]) -> Iterator[None]:
    """Inside the ``with`` block, turn ``LOAD_ERRORS`` raised while loading the user's model
    ``name`` (a path) into ``ModelLoadError``; errors with ``tiny`` or the packaged models
    (default, gemma3) are the project's own and propagate unchanged."""
    try:
        yield
    except LOAD_ERRORS as e:
        if name in (None, "default", TINY, "gemma3"):  # the packaged models
            raise
        kind = type(e).__name__
        if type(e).__module__ != "builtins":  # struct.error, not error
            kind = f"{type(e).__module__}.{kind}"
        reason = " ".join(str(e).split())  # every line of it, on one line
        raise ModelLoadError(f"expected a model that transformers loads and this zoo supports, "
                             f"got {name!r} ({kind}: {reason})") from e


def load_model(name: Optional[str], dtype: torch.dtype = torch.float32):
    """``(hf_model, tokenizer)`` for ``--model``: ``tiny``, None/``default`` (SmolLM2 GGUF),
    ``gemma3`` (Gemma 3 270M GGUF), a ``.gguf`` file or a Hugging Face folder (see
    ``compile.models.gguf.resolve_model``)."""
    if name == TINY:
        return tiny_hf_model().to(dtype), ByteTokenizer()
    from compile.models.gguf import load_hf
    return load_hf(name, dtype=dtype)


__all__ = ["pick_device", "check_ops_environment", "ENGINE_OPS", "TINY", "TINY_CONFIG",
           "ByteTokenizer", "tiny_hf_model", "load_model", "ModelLoadError", "LOAD_ERRORS",
           "user_model_errors"]
