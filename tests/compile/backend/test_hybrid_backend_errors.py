"""The hybrid backend's, the linear layer's and the linear split op's refusals, each naming what
is wrong; and the split op's schema and fake (shapes only, nothing run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from compile.backend import HybridLinearAttnBackend, LinearAttention
from compile.backend.hybrid_backend import state_indices
from compile.batch import ForwardBatch, ForwardMode, SpecInfo
from compile.graphs.forward_context import set_forward_context
from compile.graphs.linear_split_op import unified_linear_attention

CONV = 2 * 2 * 4 + 4 * 4  # 2 Hk K + Hv V with Hk 2, Hv 4, K = V = 4


def linear_layer(layer_id: int = 0) -> LinearAttention:
    p = lambda *shape: nn.Parameter(torch.randn(*shape))  # noqa: E731
    return LinearAttention(layer_id, 2, 4, 4, 4, p(CONV, 1, 4), p(4), p(4))


def test_linear_layer_rejects_bad_heads_and_conv_weight():
    p = lambda *shape: nn.Parameter(torch.randn(*shape))  # noqa: E731
    with pytest.raises(ValueError, match="num_v_heads 3 is not a multiple of num_k_heads"):
        LinearAttention(0, 2, 3, 4, 4, p(CONV, 1, 4), p(3), p(3))
    with pytest.raises(ValueError, match=f"conv_dim = 2 \\* Hk \\* K \\+ Hv \\* V = {CONV}"):
        LinearAttention(0, 2, 4, 4, 4, p(CONV + 1, 1, 4), p(4), p(4))
    layer = linear_layer()
    assert layer.conv_weights.shape == (CONV, 4) and layer.scaling == 4 ** -0.5
    assert not list(layer.parameters())  # the model's parameters, only referenced


def test_backend_needs_a_state_pool():
    runner = SimpleNamespace(device="cpu", page_size=1, req_to_token_pool=SimpleNamespace(
        req_to_token=torch.zeros(1, 4, dtype=torch.int32)), token_to_kv_pool=None,
        kv_cache_dtype=torch.float32, model_config=SimpleNamespace(context_len=4),
        state_pool=None)
    with pytest.raises(ValueError, match="model_runner has no state_pool"):
        HybridLinearAttnBackend(runner)


def _backend_without_init() -> HybridLinearAttnBackend:
    backend = HybridLinearAttnBackend.__new__(HybridLinearAttnBackend)
    backend.linear_metadata, backend.topk, backend.device = None, 0, torch.device("cpu")
    return backend


def _batch(mode: ForwardMode, spec=None) -> ForwardBatch:
    one = torch.ones(1, dtype=torch.int32)
    return ForwardBatch(forward_mode=mode, batch_size=1, req_pool_indices=torch.zeros(1).long(),
                        seq_lens=one, out_cache_loc=torch.zeros(1).long(), spec_info=spec)


def test_unsupported_modes_and_missing_metadata_are_refused():
    backend = _backend_without_init()
    tree = _batch(ForwardMode.TARGET_VERIFY, SpecInfo(topk=2, draft_token_num=2))
    with pytest.raises(NotImplementedError, match="target verify with topk > 1"):
        backend._tokens_per_request(tree)
    draft = _batch(ForwardMode.DECODE, SpecInfo(topk=1, spec_steps=2))
    with pytest.raises(NotImplementedError, match="draft steps \\(DECODE with a draft input\\)"):
        backend._tokens_per_request(draft)
    x = torch.zeros(1, CONV)
    with pytest.raises(RuntimeError, match="no metadata; expected init_forward_metadata"):
        backend.forward_linear(linear_layer(), x, torch.zeros(1, 4), torch.zeros(1, 4),
                               _batch(ForwardMode.DECODE))
    with pytest.raises(RuntimeError, match="the last step was not a TARGET_VERIFY step"):
        backend.update_mamba_state_after_mtp_verify(torch.zeros(1, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match="mamba_track_indices"):
        backend.update_mamba_state_after_mtp_verify(torch.zeros(1), torch.zeros(1))


def test_state_indices_send_padded_requests_to_slot_0():
    req_to_slot = torch.tensor([3, 1, 2], dtype=torch.int32)
    rows, seq_lens = torch.tensor([2, 0, 0]), torch.tensor([9, 5, 1])
    assert state_indices(req_to_slot, rows).tolist() == [2, 3, 3]
    assert state_indices(req_to_slot, rows, seq_lens, 1).tolist() == [2, 3, 0]


def test_split_op_schema_and_shape_checks():
    schema = str(torch.ops.xpu_ops.unified_linear_attention_with_output.default._schema)
    assert schema == ("xpu_ops::unified_linear_attention_with_output(Tensor mixed_qkv, Tensor a, "
                      "Tensor b, Tensor(a!) output, int layer_id) -> ()")
    op = torch.ops.xpu_ops.unified_linear_attention_with_output
    x, ab = torch.zeros(3, CONV), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="a has shape \\(2, 4\\); expected \\[tokens, ...\\]"):
        op(x, ab[:2], ab, torch.zeros(3, 16), 0)
    with pytest.raises(ValueError, match="output has shape \\(3,\\)"):
        op(x, ab, ab, torch.zeros(3), 0)
    with pytest.raises(ValueError, match="output is torch.float64 on cpu; expected mixed_qkv's"):
        op(x, ab, ab, torch.zeros(3, 16, dtype=torch.float64), 0)
    with torch._subclasses.fake_tensor.FakeTensorMode():  # the fake checks the same
        with pytest.raises(ValueError, match="b has shape \\(2, 4\\)"):
            op(torch.empty(3, CONV), torch.empty(3, 4), torch.empty(2, 4), torch.empty(3, 16), 0)


def test_split_op_runs_the_layer_and_zeroes_padded_rows():
    class Layer:
        layer_id, num_v_heads, head_v_dim = 5, 4, 4

        def attend(self, mixed_qkv, a, b, fb):
            assert fb == "batch" and mixed_qkv.shape[0] == 2  # padding sliced off
            return torch.full((2, 4, 4), 7.0)

    layer = Layer()
    with set_forward_context({5: layer}, "batch", num_tokens=2):
        out = unified_linear_attention(layer, torch.randn(3, CONV), torch.randn(3, 4),
                                       torch.randn(3, 4))
    assert out.shape == (3, 4, 4)
    assert torch.all(out[:2] == 7.0) and torch.all(out[2] == 0.0)


def test_tensor_parallel_refuses_linear_attention_layers():
    pytest.importorskip("transformers")
    from compile.backend.parallel_state import ParallelGroup
    from compile.models import from_hf
    from compile.models.tensor_parallel import tensor_parallel
    from tests.models.test_qwen3_next_parity import qwen3_5_hf

    group = ParallelGroup(rank=0, size=2, group=object())  # refused before any collective
    with pytest.raises(NotImplementedError, match="NoneType / LlamaMLP has no tensor-parallel"):
        tensor_parallel(from_hf(qwen3_5_hf()), group)
