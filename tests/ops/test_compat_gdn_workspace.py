"""The shim's ``gdn_attention`` beyond the float32 call of ``test_compat_gdn.py``: a 16-bit
``ssm_state`` pool (the native op's other state types) against the same float64 oracle, the raw
op's ``workspace`` (used when usable, ignored otherwise) and the wrapper's grow-only workspace
cache ``sgl_kernel.gdn_attn._gdn_ws_cache`` (sgl-kernel-xpu's ``python/sgl_kernel/gdn_attn.py``)."""

from __future__ import annotations

import pytest
import torch

from .test_compat_gdn import HK, HV, K, V, _call, _case, _oracle
from .test_compat_shim import shim  # noqa: F401  (the fixture: the shim, or a skip)

WIDTH_QKV = 2 * HK * K + HV * V


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_ssm_state_matches_float64_oracle(shim, dtype):
    """Extend over a bf16/fp16 state pool: the addressed slots advance as the oracle says (to
    the pool's rounding), the -1 request's and the unaddressed slots are untouched."""
    from sgl_kernel import gdn_attention
    lens, slots, initial = [3, 2, 2], [1, -1, 4], torch.tensor([True, True, False])
    t, parts, qkvz, ba, p, conv_pool, ssm_pool = _case(lens, 7, False, 21)
    ssm_pool = ssm_pool.to(dtype)
    before = conv_pool.clone(), ssm_pool.clone()
    out, zout = torch.full((7, HV, V), torch.nan), torch.full((7, HV, V), torch.nan)
    want = _oracle(*parts[:3], parts[4], parts[5], p, conv_pool, ssm_pool, lens, slots,
                   initial.tolist())
    _call(gdn_attention, out, zout, qkvz, ba, p, conv_pool, ssm_pool, lens, slots, initial, 3,
          0, t, reorder=False)
    torch.testing.assert_close(out.double(), want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(conv_pool.double(), want[1], atol=0, rtol=0)
    torch.testing.assert_close(ssm_pool.double(), want[2], atol=1e-2, rtol=1e-2)
    for slot in (0, 2, 3):
        assert torch.equal(conv_pool[slot], before[0][slot])
        assert torch.equal(ssm_pool[slot], before[1][slot])
    assert not torch.equal(ssm_pool[1], before[1][1]) and ssm_pool.dtype == dtype


def _raw(workspace, seed=31):
    """A decode call of the raw op (two requests) with ``workspace``; returns its outputs, the
    pools after it and the conv input ``q | k | v`` the oracle reads."""
    lens, slots = [1, 1], [2, 0]
    t, parts, qkvz, ba, p, conv_pool, ssm_pool = _case(lens, 2, True, seed)
    out, zout = torch.full((2, HV, V), torch.nan), torch.full((2, HV, V), torch.nan)
    _call(lambda **kw: torch.ops.sgl_kernel.gdn_attention(*kw.values(), workspace), out, zout,
          qkvz, ba, p, conv_pool, ssm_pool, lens, slots, None, 0, 2, t)
    return (out, zout, conv_pool, ssm_pool), torch.cat([x.flatten(1) for x in parts[:3]], 1)


def test_raw_op_stages_its_conv_input_in_a_usable_workspace(shim):
    from xpu_ops.compat_gdn import gdn_workspace_bytes
    nbytes = gdn_workspace_bytes(2, HK, HV, K, V, torch.float32)
    assert nbytes == 2 * WIDTH_QKV * 4
    workspace = torch.full((nbytes + 8,), 0x7F, dtype=torch.uint8)
    got, qkv = _raw(workspace)
    want, _ = _raw(None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(workspace[:nbytes].view(torch.float32).view(2, WIDTH_QKV), qkv)
    assert (workspace[nbytes:] == 0x7F).all()                 # nothing past what it needs


@pytest.mark.parametrize("workspace", [torch.zeros(4, dtype=torch.uint8),
                                       torch.zeros(1 << 12, dtype=torch.float32),
                                       torch.zeros(2, 1 << 11, dtype=torch.uint8)],
                         ids=["undersized", "float32", "2-D"])
def test_raw_op_ignores_an_unusable_workspace(shim, workspace):
    """sgl-kernel-xpu's fallback: a too small, wrongly typed or shaped buffer is not used (and
    not written); the call allocates and gives the same results."""
    before = workspace.clone()
    got, _ = _raw(workspace)
    want, _ = _raw(None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(workspace, before)


def test_raw_op_schema_declares_the_workspace_written(shim):
    op = torch.ops.sgl_kernel.gdn_attention.default
    written = [a.name for a in op._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["core_attn_out", "z", "conv_state", "ssm_state", "workspace"]
    lens, slots = [1, 1], [3, 0]
    t, _, qkvz, ba, p, conv_pool, ssm_pool = _case(lens, 2, True, 5)
    args = _call(lambda **kw: tuple(kw.values()), torch.empty(2, HV, V), torch.empty(2, HV, V),
                 qkvz, ba, p, conv_pool, ssm_pool, lens, slots, None, 0, 2, t)
    workspace = torch.empty(2 * WIDTH_QKV * 4, dtype=torch.uint8)
    torch.library.opcheck(op, (*args, workspace), test_utils=("test_schema", "test_faketensor"))


def test_wrapper_cache_grows_only_and_is_reused(shim):
    """One buffer per device: created with 1.25x headroom, regrown only for a larger call, the
    same storage for a smaller one; a rejected call leaves the cache as it was."""
    import sgl_kernel.gdn_attn as gdn_attn
    from xpu_ops.compat_gdn import gdn_workspace_bytes
    cache = gdn_attn._gdn_ws_cache
    saved = dict(cache)
    cache.clear()
    try:
        t, _, qkvz, ba, p, conv_pool, ssm_pool = _case([1, 1], 2, True, 8)
        with pytest.raises(ValueError, match="gdn_attention: projected_states_qkvz"):
            _call(gdn_attn.gdn_attention, torch.empty(2, HV, V), torch.empty(2, HV, V), qkvz,
                  ba, p, conv_pool, ssm_pool, [1, 1], [0, 1], None, 0, 2, t,
                  projected_states_qkvz=torch.randn(2, WIDTH_QKV))   # rejected inside the op
        assert not cache
        sizes, ptrs = [], []
        for lens, rows in (([1], 1), ([3, 4], 7), ([1, 1], 2)):
            t, _, qkvz, ba, p, conv_pool, ssm_pool = _case(lens, rows, True, 9)
            _call(gdn_attn.gdn_attention, torch.empty(rows, HV, V), torch.empty(rows, HV, V),
                  qkvz, ba, p, conv_pool, ssm_pool, lens, list(range(len(lens))), None,
                  len(lens) if rows > 2 else 0, 0 if rows > 2 else len(lens), t)
            sizes.append(cache[torch.device("cpu")].numel())
            ptrs.append(cache[torch.device("cpu")].data_ptr())
        assert sizes[0] == int(gdn_workspace_bytes(1, HK, HV, K, V, torch.float32) * 1.25)
        assert sizes[1] == int(gdn_workspace_bytes(7, HK, HV, K, V, torch.float32) * 1.25)
        assert sizes[2] == sizes[1] and ptrs[2] == ptrs[1]
    finally:
        cache.clear()
        cache.update(saved)
