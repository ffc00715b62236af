"""The aten ops one eager decode call of ``flash_attn_with_kvcache`` dispatches besides the op.

On a GPU every aten op on a device tensor is a kernel launch (plus an allocation) and each costs
host time, so the decode forms (packed ``q [b, Hq, D]`` with ``cu_seqlens_q``, and a 4-D
``q [b, s, Hq, D]``) may allocate the output when the caller gives none, and take views of q,
the output and the LSE; nothing else (the 4-D form's ``cu_seqlens_q``, ``arange(b + 1) * s``,
is kept per (device, b, s), not built per call). Inside the op, the ``triton`` provider's entry
(its launch stubbed) allocates only the LSE it returns (``[Hq, total_q]``, or the empty
``[Hq, 0]`` of a call without it), its split-KV workspace kept between calls. The kept
``cu_seqlens_q`` is built fresh while tracing and while a graph is being captured, and is a
plain tensor whatever mode the first call runs in.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import xpu_ops
from xpu_ops import _value_checks, provider_table
from xpu_ops.ops import kvcache_layout
from xpu_ops.testing import counted_ops

from ..markers import GPU_DEVICE, requires_gpu_graphs

I32 = dict(dtype=torch.int32)
# metadata-only ops (no device memory, no launch)
VIEWS = {"view", "_reshape_alias", "_unsafe_view", "transpose", "unsqueeze", "squeeze",
         "as_strided", "alias", "expand", "slice", "select", "permute", "t"}
ALLOCATIONS = {"new_empty", "empty", "empty_like", "empty_strided"}
VIEW_BUDGET = 4  # q packed, the output unpacked, the LSE's [b, Hq, s] (a view and a transpose)


def _decode(b=2, hq=4, hkv=2, d=16, page=16, context=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages_per_req = -(-context // page)
    k_cache = torch.randn(b * pages_per_req + 1, page, hkv, d, generator=g)
    page_table = torch.randperm(b * pages_per_req, generator=g).to(torch.int32)
    return dict(q=torch.randn(b, 1, hq, d, generator=g), k_cache=k_cache,
                v_cache=torch.randn(k_cache.shape, generator=g),
                page_table=page_table.reshape(b, pages_per_req),
                cache_seqlens=torch.tensor([context - 3 * r for r in range(b)], **I32),
                cu_seqlens_q=torch.arange(b + 1, **I32))


def _call(t, form, lse, out):
    """The decode call: 4-D ``q [b, 1, Hq, D]``, or packed ``[b, Hq, D]`` with the caller's
    ``cu_seqlens_q``."""
    q = t["q"] if form == "4d" else t["q"][:, 0]
    packed = {} if form == "4d" else dict(cu_seqlens_q=t["cu_seqlens_q"], max_seqlen_q=1)
    return xpu_ops.flash_attn_with_kvcache(
        q, t["k_cache"], t["v_cache"], page_table=t["page_table"],
        cache_seqlens=t["cache_seqlens"], causal=True, return_softmax_lse=lse,
        out=None if out is None else (out if form == "4d" else out[:, 0]), **packed)


def _split(counts: collections.Counter) -> tuple[dict, int, int]:
    """``(other ops, allocations, views)`` of a call's counts, the op itself dropped."""
    other = {k: v for k, v in counts.items()
             if k not in VIEWS and k not in ALLOCATIONS and k != "flash_attn_with_kvcache"}
    return (other, sum(counts[k] for k in ALLOCATIONS), sum(counts[k] for k in VIEWS))


@pytest.mark.parametrize("form", ["4d", "packed"])
@pytest.mark.parametrize("lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("given_out", [False, True], ids=["new", "given"])
def test_decode_call_dispatches_only_the_op_its_output_and_views(form, lse, given_out):
    t = _decode()
    out = torch.full((2, 1, 4, 16), float("nan")) if given_out else None
    expected = _call(t, "packed", lse, None)         # cu_seqlens_q built by the caller
    _call(t, form, lse, out)                         # warm: kept tensors made once
    with counted_ops() as counts:
        got = _call(t, form, lse, out)
    assert counts["flash_attn_with_kvcache"] == 1
    other, allocations, views = _split(counts)
    assert other == {}, f"device work besides the op per call: {dict(counts)}"
    assert allocations == (0 if given_out else 1), dict(counts)
    assert views <= VIEW_BUDGET, dict(counts)
    got, expected = (got, expected) if lse else ((got,), (expected,))
    if form == "4d":
        expected = (expected[0].unsqueeze(1),) + ((expected[1].t().unsqueeze(-1),) if lse else ())
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    if given_out:
        assert got[0].data_ptr() == out.data_ptr()


@pytest.mark.parametrize("lse", [False, True])
def test_triton_entry_allocates_only_its_lse(monkeypatch, lse):
    pa = pytest.importorskip("xpu_ops.triton.paged_attention")
    launches = []
    monkeypatch.setattr(pa, "launch", lambda *a, **k: launches.append(k))
    t = _decode(b=1, context=1024)
    q = t["q"][:, 0]
    args = (q, t["k_cache"], t["v_cache"], t["cache_seqlens"], t["page_table"],
            torch.arange(2, **I32), torch.empty_like(q), *[None] * 7, 1, 0.25, True, -1, 0, 0.0,
            0, lse)
    pa.flash_attn_with_kvcache(*args)                # warm: the split-KV workspace
    with counted_ops() as counts:
        result = pa.flash_attn_with_kvcache(*args)
    assert len(launches) == 2 and launches[-1]["NUM_SPLITS"] > 1  # the split-KV decode launch
    other, allocations, views = _split(counts)
    assert (other, allocations, views) == ({}, 1, 0), dict(counts)
    assert result.shape == ((4, 1) if lse else (4, 0))


def test_4d_cu_seqlens_is_kept_outside_capture_and_fresh_inside(monkeypatch):
    q = torch.empty(3, 2, 4, 8)
    kept = kvcache_layout.uniform_cu_seqlens(q, 3, 2)
    assert kvcache_layout.uniform_cu_seqlens(q, 3, 2) is kept and kept.tolist() == [0, 2, 4, 6]
    meta = torch.empty(3, 2, 4, 8, device="meta")   # another device: its own tensor
    assert kvcache_layout.uniform_cu_seqlens(meta, 3, 2).device.type == "meta"
    monkeypatch.setattr(kvcache_layout, "_cu_seqlens_key", lambda device: None)  # capturing
    with counted_ops() as counts:
        fresh = kvcache_layout.uniform_cu_seqlens(q, 3, 2)
    assert fresh is not kept and counts["arange"] == 1 and fresh.tolist() == [0, 2, 4, 6]


def test_cu_seqlens_key_is_the_device_off_gpus_and_none_while_capturing(monkeypatch):
    assert kvcache_layout._cu_seqlens_key(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(_value_checks, "_capturing", lambda device: True)
    assert kvcache_layout._cu_seqlens_key(torch.device("cuda", 0)) is None
    assert kvcache_layout._cu_seqlens_key(torch.device("xpu", 0)) is None


@requires_gpu_graphs
def test_4d_cu_seqlens_per_stream_and_fresh_in_a_graph_capture():
    """On a GPU the kept tensor is per stream; a captured call builds its own, which the cache
    never keeps, and the graph's replays give the eager result."""
    from compile.graphs import device as dev
    device = torch.device(GPU_DEVICE)
    q = torch.empty(5, 1, 4, 8, device=device)
    kept = kvcache_layout.uniform_cu_seqlens(q, 5, 1)
    side = dev._module(device).Stream()
    with dev._module(device).stream(side):
        other = kvcache_layout.uniform_cu_seqlens(q, 5, 1)
    dev.synchronize(device)
    assert other is not kept and other.tolist() == kept.tolist() == [0, 1, 2, 3, 4, 5]
    t = {k: v.to(device) for k, v in _decode(b=5).items()}
    eager = _call(t, "4d", False, None)
    graph = dev.new_graph(device)
    side.wait_stream(dev._module(device).current_stream())
    with dev._module(device).stream(side):            # warm up off the capture
        _call(t, "4d", False, None)
    dev._module(device).current_stream().wait_stream(side)
    entries = dict(kvcache_layout._UNIFORM_CU_SEQLENS)
    with dev.graph_capture(graph, device):
        captured = _call(t, "4d", False, None)
    kept_now = kvcache_layout._UNIFORM_CU_SEQLENS                # nothing kept from the capture
    assert kept_now.keys() == entries.keys() and all(kept_now[k] is v for k, v in entries.items())
    graph.replay()
    dev.synchronize(device)
    assert torch.equal(captured, eager)


def test_4d_cu_seqlens_made_under_a_mode_is_a_plain_tensor():
    q = torch.empty(5, 3, 4, 8)
    with torch.inference_mode(), counted_ops():
        cu = kvcache_layout.uniform_cu_seqlens(q, 5, 3)
    assert type(cu) is torch.Tensor and not cu.is_inference()
    assert cu.tolist() == [0, 3, 6, 9, 12, 15] and cu.dtype == torch.int32
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        fq = torch.empty(7, 3, 4, 8)
        cu = kvcache_layout.uniform_cu_seqlens(fq, 7, 3)
    assert (torch.device("cpu"), 7, 3) not in kvcache_layout._UNIFORM_CU_SEQLENS


def test_4d_call_compiles_without_keeping_a_traced_tensor():
    t = _decode(b=3, seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: _call(t, "4d", False, None), backend="eager",
                             fullgraph=True)
    got = compiled(t)
    assert torch.equal(got, _call(t, "packed", False, None).unsqueeze(1))
    assert all(type(cu) is torch.Tensor for cu in kvcache_layout._UNIFORM_CU_SEQLENS.values())



def test_kernel_runs_the_provider_with_grad_off_and_restores_grad_mode():
    """The op's kernel runs its provider with grad mode off (nothing differentiable) and leaves
    grad mode as it found it, whether the call returns, its checks raise or the provider does."""
    impls = provider_table._registry["flash_attn_with_kvcache"]
    real, seen, boom = impls["reference"], [], []

    def spy(*args):
        seen.append(torch.is_grad_enabled())
        if boom:
            raise RuntimeError("boom")
        return real.fn(*args)
    t = _decode()
    q3 = t["q"][:, 0]
    bad = (q3, t["k_cache"], t["v_cache"], t["cache_seqlens"], t["page_table"],
           t["cu_seqlens_q"], torch.empty(2, 4, 15), *[None] * 7, 1, 0.25, True, -1, 0, 0.0, 0,
           False)
    impls["reference"] = dataclasses.replace(real, fn=spy)
    xpu_ops.refresh()
    try:
        with xpu_ops.use_provider("reference"):
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    assert not _call(t, "4d", False, None).requires_grad
                    with pytest.raises(ValueError, match="out"):
                        torch.ops.xpu_ops.flash_attn_with_kvcache.default(*bad)
                    assert torch.is_grad_enabled() is grad
                    boom.append(1)
                    with pytest.raises(RuntimeError, match="boom"):
                        _call(t, "4d", False, None)
                    boom.clear()
                    assert torch.is_grad_enabled() is grad
    finally:
        impls["reference"] = real
        xpu_ops.refresh()
    assert seen == [False] * 4


def _mutations(t):
    """``(name, form, keyword changes)`` of decode calls, valid and not, for the plain paths."""
    q4, kc = t["q"], t["k_cache"]
    yield "valid", "4d", {}
    yield "valid-lse-nocausal", "4d", dict(return_softmax_lse=True, causal=False)
    yield "valid-scale-softcap", "4d", dict(softmax_scale=-0.3, softcap=2.5)
    yield "strided-out", "4d", dict(out=torch.empty(1, 2, 4, 16).transpose(0, 1))
    q2 = torch.randn(2, 2, 4, 16, generator=torch.Generator().manual_seed(3))   # s = 2
    yield "valid-s2", "4d", dict(q=q2)
    yield "strided-out-s2", "4d", dict(q=q2, out=torch.empty(2, 2, 4, 16).transpose(0, 1))
    yield "strided-out-s2-lse", "4d", dict(q=q2, out=torch.empty(2, 2, 4, 16).transpose(0, 1),
                                           return_softmax_lse=True)
    yield "valid-b0-lse", "4d", dict(q=q4[:0], cache_seqlens=t["cache_seqlens"][:0],
                                     page_table=t["page_table"][:0], return_softmax_lse=True)
    yield "valid-s0-lse", "4d", dict(q=q4[:, :0], return_softmax_lse=True)
    yield "out-shape", "4d", dict(out=torch.empty(2, 1, 4, 15))
    yield "out-dtype", "4d", dict(out=torch.empty(2, 1, 4, 16, dtype=torch.float64))
    yield "out-packed", "4d", dict(out=torch.empty(2, 4, 16))
    yield "nan-scale", "4d", dict(softmax_scale=float("nan"))
    yield "inf-scale", "4d", dict(softmax_scale=float("inf"))
    yield "q-head-dim-0", "4d", dict(q=q4[..., :0])
    yield "q-int", "4d", dict(q=q4.to(torch.int32))
    yield "q-5d", "4d", dict(q=q4.unsqueeze(0))
    yield "q-meta", "4d", dict(q=q4.to("meta"))
    yield "v-3d", "4d", dict(v_cache=t["v_cache"][0])
    yield "v-heads", "4d", dict(v_cache=t["v_cache"][:, :, :1])
    yield "v-dtype", "4d", dict(v_cache=t["v_cache"].double())
    yield "k-page-0", "4d", dict(k_cache=kc[:, :0], v_cache=t["v_cache"][:, :0])
    yield "k-3d", "4d", dict(k_cache=kc[0])
    yield "seqlens-int64", "4d", dict(cache_seqlens=t["cache_seqlens"].long())
    yield "seqlens-rows", "4d", dict(cache_seqlens=t["cache_seqlens"][:1])
    yield "table-rows", "4d", dict(page_table=t["page_table"][:1])
    yield "q-batch", "4d", dict(q=q4[:1])
    yield "cu-with-4d", "4d", dict(cu_seqlens_q=t["cu_seqlens_q"])
    yield "valid", "packed", {}
    yield "out-shape", "packed", dict(out=torch.empty(2, 4, 15))
    yield "nan-scale", "packed", dict(softmax_scale=float("nan"))
    yield "v-3d", "packed", dict(v_cache=t["v_cache"][0])


def _outcome(fn):
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 (the outcome compared is the exception itself)
        return type(e), str(e)
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("name,form,change", [pytest.param(*m, id=f"{m[1]}-{m[0]}")
                                               for m in _mutations(_decode())])
def test_plain_paths_match_the_general_path(name, form, change):
    """The wrapper's plain paths (``window_size=(-1, -1)``) and its general path (the same
    window as a list) give the same results and raise the same exceptions, messages included."""
    def call(window):
        t = _decode()
        kw = dict(k_cache=t["k_cache"], v_cache=t["v_cache"], page_table=t["page_table"],
                  cache_seqlens=t["cache_seqlens"], causal=True, window_size=window)
        kw["q"] = t["q"] if form == "4d" else t["q"][:, 0]
        if form == "packed":
            kw.update(cu_seqlens_q=t["cu_seqlens_q"], max_seqlen_q=1)
        kw.update(change)
        if "out" in change:  # a buffer of this call, of the same strides
            kw["out"] = torch.empty_strided(change["out"].shape, change["out"].stride(),
                                             dtype=change["out"].dtype)
            kw["out"].fill_(float("nan"))
        return kw["out"] if "out" in kw else None, _outcome(
            lambda: xpu_ops.flash_attn_with_kvcache(**kw))
    (plain_out, plain), (_, general) = call((-1, -1)), call([-1, -1])
    if isinstance(general[0], type):
        assert plain == general
        return
    assert name.startswith(("valid", "strided")) and not isinstance(plain[0], type), plain
    for p, g in zip(plain, general, strict=True):
        assert torch.equal(p, g) and p.shape == g.shape and p.stride() == g.stride()
    if plain_out is not None:
        assert plain[0] is plain_out
