"""``python -m compile check`` on a tiny Qwen3-Next: one full graph (no break), a piecewise split
at both attention kinds, and the memory of the two pools (KV per token, state per request)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from compile.engine.cli_check import check_model, format_result  # noqa: E402
from compile.models import from_hf  # noqa: E402
from tests.models.test_qwen3_next_parity import qwen3_next_hf  # noqa: E402


def test_check_traces_whole_and_splits_at_linear_and_full_layers():
    torch._dynamo.reset()
    result = check_model(from_hf(qwen3_next_hf()))
    assert result.ok, result
    assert result.graph_breaks == 0
    assert result.split_ops == 4 and result.pieces_per_graph == 5  # 3 linear + 1 full layers
    assert result.attention == ["linear (gated delta net)"] * 3 + ["global"]
    # layer 3 only: 2 KV heads x (16 + 16) features x 4 bytes
    assert result.kv_bytes_per_token == 2 * 32 * 4
    conv_dim = 2 * 2 * 8 + 4 * 8  # 2 Hk K + Hv V; width 4 keeps 3 inputs; states [4, 8, 8]
    assert result.state_bytes_per_request == 3 * (conv_dim * 3 + 4 * 8 * 8) * 4
    text = format_result("q3n", result, "eager")
    assert "3 x linear (gated delta net) (layers 0-2), 1 x global (layers 3)" in text
    assert (f"KV cache 256 bytes per token (full-attention layers); linear-attention state "
            f"{result.state_bytes_per_request} bytes per request") in text
