"""Hostile fuzzing of ``flash_attn_with_kvcache``'s append path (FA3's in-call ``k``/``v``),
with int32 extremes and loose bounds (hypothesis, derandomized; bounded for a 2-core CI,
``XPU_OPS_HYPOTHESIS_EXAMPLES=500`` explores more, randomly).

A small valid append (packed new keys, paged cache, GQA) gets some of its metadata replaced by
drawn values: ``INT32_MIN``/``INT32_MAX``/-1/past-the-end entries in ``cu_seqlens_q``,
``cu_seqlens_k_new``, ``cache_seqlens``, ``page_table`` and ``cache_leftpad``, a loose
(``2**31 - 1``) or understated ``max_seqlen_q``. With value checks off, the reference and Triton
(each on its own copy of every tensor, inside NaN guard regions) must survive, leave the guards
intact, store the same cache bytes, and agree on every output row exactly one request describes
(rows none describes keep their NaN). With ``debug_checks()``, a call either runs or raises
``ValueError`` before writing anything. ``test_fuzzed_append_on_gpu`` runs the same compiled.
"""

from __future__ import annotations

import math
import os

import pytest

from .triton_mode import INTERPRETED, rerun_in_subprocess, running  # first

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import xpu_ops  # noqa: E402

from . import oracle  # noqa: E402
from .utils import bitwise_equal  # noqa: E402

I32 = torch.int32
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
GUARD = 2
_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


def _settings(examples: int):
    return settings(max_examples=_EXAMPLES or examples, deadline=None,
                    derandomize=not _EXAMPLES, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(I32)


def _corrupt(data, name: str, t: torch.Tensor, extremes: list[int]) -> None:
    index = tuple(data.draw(st.integers(0, n - 1), label=f"{name} index") for n in t.shape)
    t[index] = data.draw(st.sampled_from(extremes), label=f"{name} value")


def _append_call(data, gen) -> dict:
    """A valid packed append over distinct pages, then 0-3 corruptions (int32 extremes)."""
    b = data.draw(st.integers(1, 3), label="b")
    page_size = data.draw(st.sampled_from([1, 3, 4]), label="page_size")
    hq, hkv = data.draw(st.sampled_from([(2, 1), (4, 2), (2, 2)]), label="heads")
    d = 8
    prefix = [data.draw(st.integers(0, 5)) for _ in range(b)]
    s_new = [data.draw(st.integers(0, 3)) for _ in range(b)]
    q_lens = [data.draw(st.integers(0, 2)) for _ in range(b)]
    width = max(-(-(p + s) // page_size) for p, s in zip(prefix, s_new)) + 1
    num_pages = b * width + 1
    table = torch.randperm(num_pages, generator=gen)[:b * width].view(b, width).to(I32)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    call = dict(q=torch.randn(sum(q_lens), hq, d, generator=gen), k_cache=k_cache,
                v_cache=v_cache, k=torch.randn(sum(s_new), hkv, d, generator=gen),
                v=torch.randn(sum(s_new), hkv, d, generator=gen),
                cache_seqlens=torch.tensor(prefix, dtype=I32), page_table=table,
                cu_seqlens_q=_cu(q_lens), cu_seqlens_k_new=_cu(s_new),
                max_seqlen_q=max(max(q_lens), 1), cache_leftpad=None,
                causal=data.draw(st.booleans(), label="causal"), return_softmax_lse=True)
    capacity = width * page_size
    for _ in range(data.draw(st.integers(0, 3), label="corruptions")):
        what = data.draw(st.sampled_from(["cu_q", "cu_k", "lens", "page", "max_q", "leftpad"]))
        if what == "cu_q":
            _corrupt(data, what, call["cu_seqlens_q"], [INT32_MIN, -1, sum(q_lens) + 1,
                                                        INT32_MAX])
        elif what == "cu_k":
            _corrupt(data, what, call["cu_seqlens_k_new"], [INT32_MIN, -1, sum(s_new) + 1,
                                                            INT32_MAX])
        elif what == "lens":
            _corrupt(data, what, call["cache_seqlens"], [INT32_MIN, -1, capacity + 1,
                                                         INT32_MAX - 8])
        elif what == "page":
            _corrupt(data, what, table, [INT32_MIN, -1, num_pages, INT32_MAX])
        elif what == "max_q":
            call["max_seqlen_q"] = data.draw(st.sampled_from([1, INT32_MAX]))
        else:
            call["cache_leftpad"] = torch.tensor(
                [data.draw(st.sampled_from([INT32_MIN, -1, 0, 2, INT32_MAX])) for _ in range(b)],
                dtype=I32)
    return call


def _guarded(t: torch.Tensor):
    """``t`` inside a NaN buffer with GUARD rows on each side: ``(buffer, view)``."""
    buffer = torch.full((t.shape[0] + 2 * GUARD, *t.shape[1:]), math.nan, dtype=t.dtype,
                        device=t.device)
    view = buffer[GUARD:GUARD + t.shape[0]]
    view.copy_(t)
    return buffer, view


def _run(call: dict, device, using) -> tuple:
    """The call on ``device`` with its caches and ``out`` inside NaN guards: ``(k buffer,
    v buffer, out buffer, lse)`` on the CPU."""
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    k_buf, moved["k_cache"] = _guarded(moved["k_cache"])
    v_buf, moved["v_cache"] = _guarded(moved["v_cache"])
    q = moved["q"]
    out_buf, moved["out"] = _guarded(torch.full((q.shape[0], q.shape[1], q.shape[2]), math.nan,
                                                device=device))
    with using(), xpu_ops.debug_checks(False):
        _, lse = xpu_ops.flash_attn_with_kvcache(**moved)
    return k_buf.cpu(), v_buf.cpu(), out_buf.cpu(), lse.cpu()


def _check_append(data, seed, device, providers):
    gen = torch.Generator().manual_seed(seed)
    call = _append_call(data, gen)
    results = []
    for provider in providers:
        using = (lambda p=provider: running(p)) if device == "cpu" else (
            lambda p=provider: xpu_ops.use_provider(p))
        results.append(_run(call, device, using))
    for k_buf, v_buf, out_buf, _ in results:
        for buf in (k_buf, v_buf, out_buf):
            assert buf[:GUARD].isnan().all() and buf[-GUARD:].isnan().all(), "guard written"
    (k0, v0, out0, lse0), rest = results[0], results[1:]
    total_q = call["q"].shape[0]
    rows = oracle.described_rows(call["cu_seqlens_q"], total_q, call["max_seqlen_q"])
    owners = torch.tensor(oracle.row_owners(rows, total_q), dtype=torch.long)
    once = owners == 1
    out0 = out0[GUARD:GUARD + total_q]
    assert out0[owners == 0].isnan().all(), "a row no request describes was written"
    assert not out0[once].isnan().any()
    for k1, v1, out1, lse1 in rest:
        assert bitwise_equal(k1, k0) and bitwise_equal(v1, v0), "providers stored differently"
        out1 = out1[GUARD:GUARD + total_q]
        torch.testing.assert_close(out1[once], out0[once], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse1[:, once], lse0[:, once], atol=2e-5, rtol=2e-5)
        assert out1[owners == 0].isnan().all()
    _check_debug_rejects_before_writing(call)


def _check_debug_rejects_before_writing(call: dict) -> None:
    """Under the debug checks the call runs, or raises ValueError with nothing written."""
    call = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    call["out"] = torch.full(call["q"].shape, math.nan)
    before = {k: v.clone() for k, v in call.items() if isinstance(v, torch.Tensor)}
    with running("reference"), xpu_ops.debug_checks():
        try:
            xpu_ops.flash_attn_with_kvcache(**call)
        except ValueError as error:
            assert str(error).startswith("flash_attn_with_kvcache: "), error
            for name, t in before.items():
                assert bitwise_equal(call[name], t), f"{name} written by a rejected call"


@pytest.mark.skipif(not INTERPRETED, reason="Triton in compile mode here; "
                    "test_rerun_in_subprocess covers it")
@_settings(8)
@given(data=st.data(), seed=st.integers(0, 2 ** 16))
def test_fuzzed_append_agrees_across_providers(data, seed):
    _check_append(data, seed, "cpu", ("reference", "triton"))


@_settings(25)
@given(data=st.data(), seed=st.integers(0, 2 ** 16))
def test_fuzzed_append_on_the_reference(data, seed):
    """The reference alone, more examples (cheap): guards, NaN rows, debug rejections."""
    _check_append(data, seed, "cpu", ("reference",))


@pytest.mark.gpu
@_settings(200)
@given(data=st.data(), seed=st.integers(0, 2 ** 16))
def test_fuzzed_append_on_gpu(data, seed):
    """Compiled Triton and the reference on CUDA: no illegal access, guards intact, the
    providers agree. ``pytest -m gpu tests/ops/test_fuzz_append.py``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_append(data, seed, "cuda", ("reference", "triton"))
    torch.cuda.synchronize()
