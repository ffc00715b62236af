"""``store_cache_xpu`` (op ``xpu_ops::store_cache``, sgl-kernel-xpu's fused K/V row store):
every provider against a float64 oracle written from the contract (``cache[indices[i]] = row i``,
-1 and other out-of-range indices skipped), guard rows, strided rows, checks eager and fake,
the debug value check, a fullgraph trace."""

from __future__ import annotations

import pytest
import torch

import xpu_ops

from .utils import error_message, reseeded_sample, runnable_providers, sample_indices

OP = torch.ops.xpu_ops.store_cache
PROVIDERS = runnable_providers("store_cache")


def oracle_store(cache, rows, indices):
    """float64 copy of ``cache`` with row ``indices[i]`` replaced by ``rows[i]`` for every index
    in ``[0, S)``; other rows unchanged."""
    out = cache.double().clone()
    for i, slot in enumerate(indices.tolist()):
        if 0 <= slot < cache.shape[0]:
            out[slot] = rows[i].double()
    return out


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    k, v, k_cache, v_cache, indices = reseeded_sample(OP, index, seed=900 + index)
    want_k, want_v = oracle_store(k_cache, k, indices), oracle_store(v_cache, v, indices)
    k_before = k.clone()
    with xpu_ops.use_provider(provider):
        OP(k, v, k_cache, v_cache, indices)
    assert torch.equal(k_cache.double(), want_k) and torch.equal(v_cache.double(), want_v)
    assert torch.equal(k, k_before)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_out_of_range_indices_write_nothing_outside(provider):
    """Guard rows around the cache (NaN) stay NaN; indices -1, -7 and S are skipped."""
    gen = torch.Generator().manual_seed(2)
    slots, dim = 6, 16
    k_full = torch.full((slots + 2, dim), float("nan"))
    v_full = torch.full((slots + 2, dim), float("nan"))
    k_cache, v_cache = k_full[1:-1], v_full[1:-1]
    k_cache.copy_(torch.randn(slots, dim, generator=gen))
    v_cache.copy_(torch.randn(slots, dim, generator=gen))
    k, v = torch.randn(5, dim, generator=gen), torch.randn(5, dim, generator=gen)
    indices = torch.tensor([3, -1, slots, -7, 0])
    want = oracle_store(k_cache, k, indices)
    with xpu_ops.use_provider(provider):
        xpu_ops.store_cache_xpu(k, v, k_cache, v_cache, indices)
    assert torch.equal(k_cache.double(), want)
    assert k_full[0].isnan().all() and k_full[-1].isnan().all() and v_full[-1].isnan().all()


def test_int32_indices_are_converted_and_debug_checks_reject_out_of_range():
    k_cache, v_cache = torch.zeros(4, 8), torch.zeros(4, 8)
    k, v = torch.randn(2, 8), torch.randn(2, 8)
    xpu_ops.store_cache_xpu(k, v, k_cache, v_cache, torch.tensor([2, -1], dtype=torch.int32))
    assert torch.equal(k_cache[2], k[0]) and not k_cache[[0, 1, 3]].any()
    with xpu_ops.debug_checks(), pytest.raises(RuntimeError, match=(
            r"store_cache_xpu: indices has a token slot out of range; expected -1 \(skip\) or "
            r"0 <= indices < 4 \(rows of k_cache\), got indices\[1\] = 4")):
        xpu_ops.store_cache_xpu(k, v, k_cache, v_cache, torch.tensor([1, 4]))
    assert not k_cache[1].any()                          # rejected before any write


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("change,exc,match", [
    (dict(k=torch.zeros(3, 4, 8)), ValueError, r"k has the wrong number of dimensions"),
    (dict(k_cache=torch.zeros(6, 8, dtype=torch.half)), ValueError, r"k_cache has dtype"),
    (dict(v_cache=torch.zeros(6, 4)), ValueError, r"v_cache has the wrong size in dimension 1"),
    (dict(indices=torch.zeros(2, dtype=torch.int64)), ValueError,
     r"indices has the wrong size in dimension 0 \(num_tokens\)"),
    (dict(indices=torch.zeros(3, dtype=torch.int16)), ValueError, r"indices has dtype"),
])
def test_checks(fake, change, exc, match):
    kwargs = dict(k=torch.zeros(3, 8), v=torch.zeros(3, 8), k_cache=torch.zeros(6, 8),
                  v_cache=torch.zeros(6, 8), indices=torch.zeros(3, dtype=torch.int64))
    kwargs.update(change)
    msg = error_message(lambda **kw: OP(**kw), kwargs, fake)
    assert msg.startswith(f"{exc.__name__}: store_cache_xpu: "), msg
    import re
    assert re.search(match, msg), msg
    with pytest.raises(RuntimeError):
        OP(**kwargs)


def test_type_error_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="store_cache_xpu: indices is not a tensor"):
        xpu_ops.store_cache_xpu(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(2, 2),
                                torch.zeros(2, 2), [0])


def test_fullgraph_trace_matches_eager():
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(5, 3, 16, generator=gen)            # one head of [N, H, D]: strided
    k, v = rows[:, 1], rows[:, 2]
    indices = torch.tensor([7, -1, 2, 5, 0])

    def step(k, v, k_cache, v_cache, indices):
        xpu_ops.store_cache_xpu(k, v, k_cache, v_cache, indices)
        return k_cache + 0, v_cache + 0

    caches = [torch.zeros(8, 16) for _ in range(4)]
    eager = step(k, v, caches[0], caches[1], indices)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(k, v, caches[2], caches[3],
                                                                        indices)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    assert torch.equal(eager[0].double(), oracle_store(torch.zeros(8, 16), k, indices))
