"""Glue tests of ``xpu_ops.register_sgl_kernel_fakes`` (``xpu_ops/sgl_kernel_fakes.py``).

The raw ops come from ``tests/ops/native_sgl_kernel.py`` (sgl-kernel-xpu's schemas, no fakes,
reference implementations on CPU); the real library's ops were not available here.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import xpu_ops
from torch._subclasses.fake_tensor import FakeTensorMode

from xpu_ops.sgl_kernel_fakes import has_fake
from xpu_ops.testing import paged_kv_cache

from .native_sgl_kernel import OTHER_SCHEMAS, define_native_library

CONVENTIONS = ("writes", "returns")
NATIVE_OPS = ("fwd", "merge_state_v2", "flash_mla_decode", "flash_mla_sparse_decode",
              "flash_mla_sparse_prefill", "fp8_paged_mqa_logits", "fast_topk", "gdn_attention")


@pytest.fixture(params=CONVENTIONS)
def namespace(request):
    namespace = define_native_library(f"xpu_ops_glue_fakes_{request.param}", request.param)
    xpu_ops.register_sgl_kernel_fakes(namespace)
    return namespace


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _fwd_args(namespace, *, paged, with_out=True):
    """Positional arguments of native ``fwd`` (schema order) for a small bf16 call."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 64, generator=gen).bfloat16()
    cu_q = _i32([0, 1, 5])
    if paged:
        (k, v), page_table, seqlens = paged_kv_cache(gen, (70, 9), 64, [(2, 64), (2, 64)],
                                                     dtype=torch.bfloat16, device="cpu")
        values = dict(cu_seqlens_k=seqlens, page_table=page_table,
                      max_seqlen_k=page_table.shape[1] * 64)
    else:
        k, v = (torch.randn(12, 2, 64, generator=gen).bfloat16() for _ in range(2))
        values = dict(cu_seqlens_k=_i32([0, 4, 12]), page_table=None, max_seqlen_k=8)
    values.update(q=q, k=k, v=v, cu_seqlens_q=cu_q, max_seqlen_q=4, softmax_scale=0.125,
                  is_causal=True, window_size_left=-1, window_size_right=-1, softcap=0.0,
                  is_rotary_interleaved=False, num_kv_splits=0, sm_margin=0)
    if with_out:
        values.update(out=torch.full((5, 4, 64), float("nan"), dtype=torch.bfloat16),
                      softmax_lse=torch.full((4, 5), float("nan")))
    schema = getattr(torch.ops, namespace).fwd.default._schema
    return [values.get(arg.name, arg.default_value if arg.has_default_value() else None)
            for arg in schema.arguments]


def _merge_args():
    gen = torch.Generator().manual_seed(1)
    v_a, v_b = (torch.randn(3, 2, 64, generator=gen).half() for _ in range(2))
    s_a, s_b = (torch.randn(3, 2, generator=gen) for _ in range(2))
    return [v_a, s_a, v_b, s_b, torch.empty_like(v_a), torch.empty_like(s_a)]


def _mla_args(namespace):
    gen = torch.Generator().manual_seed(2)
    (kv,), page_table, seqlens = paged_kv_cache(gen, (70, 3), 64, [(576,)], dtype=torch.bfloat16,
                                                device="cpu", extra_columns=0)
    size = getattr(torch.ops, namespace).flash_mla_get_workspace_size(128, 2, 4, 64, -1)
    return [torch.empty(2, 4, 512, dtype=torch.bfloat16),
            torch.randn(2, 4, 512, generator=gen).bfloat16(),
            torch.randn(2, 4, 64, generator=gen).bfloat16(), kv, seqlens, page_table,
            torch.empty(size, dtype=torch.uint8), 0.07, -1]


def test_glue_register_adds_missing_fakes_once():
    namespace = define_native_library("xpu_ops_glue_fakes_idempotent", "writes")
    qualnames = [f"{namespace}::{name}" for name in NATIVE_OPS]
    assert not any(has_fake(q) for q in qualnames)
    assert sorted(xpu_ops.register_sgl_kernel_fakes(namespace)) == sorted(qualnames)
    assert all(has_fake(q) for q in qualnames)
    assert xpu_ops.register_sgl_kernel_fakes(namespace) == []            # idempotent


def test_glue_register_keeps_an_existing_fake():
    lib = torch.library.Library("xpu_ops_glue_fakes_own", "DEF")
    lib.define(OTHER_SCHEMAS[0])                                            # merge_state_v2

    calls = []

    def own_fake(v_a, s_a, v_b, s_b, v_merged, s_merged):
        calls.append("own")
    torch.library.register_fake("xpu_ops_glue_fakes_own::merge_state_v2", own_fake, lib=lib)
    assert xpu_ops.register_sgl_kernel_fakes("xpu_ops_glue_fakes_own") == []
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in _merge_args()]
        torch.ops.xpu_ops_glue_fakes_own.merge_state_v2(*args)
    assert calls == ["own"]
    lib._destroy()


# The older schema returns an alias of ``out`` (``-> (Tensor(a!), ...)``), which torch cannot
# functionalize (AOT dispatch refuses custom ops with aliased outputs), whatever the fake does.
FWD_OPCHECK = {"writes": ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
               "returns": ("test_schema", "test_faketensor")}
COMPILE_BACKEND = {"writes": "aot_eager", "returns": "eager"}


def _convention(namespace):
    return namespace.rsplit("_", 1)[-1]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "varlen"])
def test_glue_fwd_fake_passes_opcheck(namespace, paged):
    op = getattr(torch.ops, namespace).fwd.default
    opcheck(op, tuple(_fwd_args(namespace, paged=paged)),
            test_utils=FWD_OPCHECK[_convention(namespace)])


def test_glue_returning_fwd_without_out_passes_opcheck():
    namespace = define_native_library("xpu_ops_glue_fakes_returns", "returns")
    xpu_ops.register_sgl_kernel_fakes(namespace)
    op = getattr(torch.ops, namespace).fwd.default
    opcheck(op, tuple(_fwd_args(namespace, paged=True, with_out=False)),
            test_utils=("test_schema", "test_faketensor"))


def test_glue_merge_and_mla_fakes_pass_opcheck(namespace):
    ops = getattr(torch.ops, namespace)
    for op, args in ((ops.merge_state_v2.default, _merge_args()),
                     (ops.flash_mla_decode.default, _mla_args(namespace))):
        opcheck(op, tuple(args), test_utils=("test_schema", "test_faketensor"))


def test_glue_direct_native_call_compiles_fullgraph(namespace):
    op = getattr(torch.ops, namespace).fwd.default
    args = _fwd_args(namespace, paged=True)
    names = [arg.name for arg in op._schema.arguments]
    out_index = names.index("out")

    def step(*call_args):
        result = op(*call_args)
        out = call_args[out_index] if result is None else result[0]
        return out.float() * 2

    expected = step(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    compiled = torch.compile(step, fullgraph=True, backend=COMPILE_BACKEND[_convention(namespace)])
    torch.testing.assert_close(compiled(*args), expected, rtol=0, atol=0)


# sgl-kernel-xpu's fused gated-delta-net op (``sgl-kernel-xpu/src/...gdn...``, the non-spec
# form sglang 0.5.23's XpuGDNAttnBackend calls): it writes core_attn_out, z and both states.
GDN_ATTENTION_SCHEMA = (
    "gdn_attention(Tensor! core_attn_out, Tensor! z, Tensor projected_states_qkvz, "
    "Tensor projected_states_ba, int num_k_heads, int num_v_heads, int head_k_dim, "
    "int head_v_dim, Tensor! conv_state, Tensor! ssm_state, Tensor conv_weights, "
    "Tensor? conv_bias, str activation, Tensor A_log, Tensor dt_bias, int num_prefills, "
    "int num_decodes, Tensor? has_initial_state, Tensor non_spec_query_start_loc, "
    "Tensor non_spec_state_indices_tensor, int num_actual_tokens, int tp_size) -> ()")


def test_glue_gdn_attention_gets_a_fake_and_traces_fake():
    namespace = "xpu_ops_glue_fakes_gdn"
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(GDN_ATTENTION_SCHEMA)
    assert not has_fake(f"{namespace}::gdn_attention")
    assert xpu_ops.register_sgl_kernel_fakes(namespace) == [f"{namespace}::gdn_attention"]
    assert has_fake(f"{namespace}::gdn_attention")
    hk, hv, k, v, width, tokens = 2, 4, 8, 8, 4, 3
    dim = 2 * hk * k + hv * v
    mode = FakeTensorMode()
    with mode:
        out, z = torch.empty(tokens, hv, v), torch.empty(tokens, hv, v)
        result = getattr(torch.ops, namespace).gdn_attention(
            out, z, torch.empty(tokens, dim + hv * v), torch.empty(tokens, 2 * hv), hk, hv, k, v,
            torch.empty(5, width - 1, dim), torch.empty(5, hv, v, k), torch.empty(dim, width),
            None, "silu", torch.empty(hv), torch.empty(hv), 0, tokens, None,
            torch.arange(tokens + 1, dtype=torch.int32), torch.arange(tokens, dtype=torch.int32),
            tokens, 1)
    assert result is None
