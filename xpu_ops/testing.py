"""Sample inputs for every ``torch.ops.xpu_ops`` op, for opcheck, fake-tensor and numeric tests.

``sample_inputs(op, device)`` yields ``(args, kwargs)`` pairs that call the op itself (the
``torch.ops.xpu_ops.<name>`` packet or its ``.default`` overload), never the public wrapper.
Samples are small (a CI runner is a 2-core CPU and ``opcheck`` traces each one several times)
but together cover every feature flag the op has. Every sample follows the API.md contract,
including its adversarial parts: cache slots at or past ``cache_seqlens``, unused pages and
unused page-table entries hold NaN or out-of-range garbage, page tables are shuffled, and ``out``
buffers start as NaN so an unwritten element shows.

>>> import torch, xpu_ops
>>> from xpu_ops.testing import sample_inputs
>>> op = torch.ops.xpu_ops.flash_attn_with_kvcache
>>> args, kwargs = next(sample_inputs(op, "cpu"))
>>> lse = op(*args, **kwargs)
>>> bool(torch.isfinite(args[6]).all())  # out (argument 6) is fully written
True
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

import xpu_ops  # noqa: F401  (registers the ops)
from .testing_layouts import LAYOUTS, relayout

__all__ = ["REGISTERED_OPS", "AttentionCase", "ATTENTION_CASES", "NO_LSE_CASES", "sample_inputs",
           "paged_kv_cache", "attention_case_inputs", "varlen_case_inputs", "op_name",
           "counted_ops", "recorded_op_calls", "recorded_triton_launches"]

#: The op packets the package registers (``xpu_ops.REGISTERED_OPS``), each with a sampler here.
REGISTERED_OPS = list(xpu_ops.REGISTERED_OPS)

Sampler = Callable[[torch.device, Optional[torch.dtype], torch.Generator], Iterator[tuple]]
_SAMPLERS: dict[str, Sampler] = {}


def op_name(op) -> str:
    """``"flash_attn_with_kvcache"`` for the packet, its overload, or the plain name."""
    if isinstance(op, str):
        return op.split("::")[-1].split(".")[0]
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    return op._qualified_op_name.split("::")[-1]


def sample_inputs(op, device, dtype: Optional[torch.dtype] = None, *, seed: int = 0,
                  layout: str = "contiguous") -> Iterator[tuple[tuple, dict]]:
    """Yield ``(args, kwargs)`` pairs that call ``op`` directly: small, varied, adversarial.

    Args:
        op: a ``torch.ops.xpu_ops.<name>`` packet, its ``.default`` overload, or the name.
        device: where to build the tensors (``"cpu"``, ``"cuda"``, ...).
        dtype: floating dtype of queries/keys/values; ``None`` mixes float32, bfloat16 and
            float16 across samples. fp8 KV caches stay fp8 (their queries take ``dtype``).
        seed: seed of the random values (the shapes and flags do not depend on it).
        layout: ``"contiguous"``, or ``"strided"``: every tensor argument as a view with other
            strides (expanded scales and sinks, column-sliced tables, strided index vectors,
            padded rows; ``xpu_ops.testing_layouts``) whose padding holds garbage.
    Returns:
        An iterator of ``(args, kwargs)``; each pair is freshly allocated, so the caller may
        run the op on it (mutated ``out`` buffers start as NaN).
    Raises:
        KeyError: the op has no sampler here (add one next to the op's family).

    >>> import torch, xpu_ops.testing as t
    >>> len(list(t.sample_inputs(torch.ops.xpu_ops.flash_attn_with_kvcache, "cpu"))) >= 15
    True
    """
    name = op_name(op)
    if name not in _SAMPLERS:
        raise KeyError(f"sample_inputs: op {name!r} has no sampler; expected one of "
                       f"{sorted(_SAMPLERS)}, got {name!r}. Add one in xpu_ops/testing.py.")
    gen = torch.Generator().manual_seed(seed)
    arg_names = [a.name for a in getattr(torch.ops.xpu_ops, name).default._schema.arguments]
    for args, kwargs in _SAMPLERS[name](torch.device(device), dtype, gen):
        yield relayout(arg_names, args, layout), kwargs


def _sampler(name: str):
    def decorate(fn: Sampler) -> Sampler:
        _SAMPLERS[name] = fn
        return fn
    return decorate


# ----------------------------------------------------------------------------------------------
# Random tensors and paged caches
# ----------------------------------------------------------------------------------------------

def _randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0) -> Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def _nan_poisoned(shape, dtype, device) -> Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32).to(dtype).to(device)


def paged_kv_cache(gen: torch.Generator, k_lens: Sequence[int], page_size: int,
                   feature_shapes: Sequence[tuple], *, dtype: torch.dtype,
                   device, spare_pages: int = 2, extra_columns: int = 1, scale: float = 1.0
                   ) -> tuple[list[Tensor], Tensor, Tensor]:
    """Random paged caches sharing one shuffled page table, with NaN/garbage where unused.

    Args:
        k_lens: keys (tokens) per request. page_size: tokens per page.
        feature_shapes: per-token shape of each cache, e.g. ``[(Hkv, D), (Hkv, Dv)]``.
        dtype: cache dtype (fp8 allowed: values are drawn in float32 and cast).
        spare_pages: physical pages no request owns (all NaN).
        extra_columns: page-table columns past the longest request (garbage ids).
    Returns:
        ``(caches [num_pages, page_size, *feature], page_table [b, max_pages] int32,
        cache_seqlens [b] int32)``. Slots at or past ``cache_seqlens`` hold NaN; page-table
        entries past a request's last page hold random ids, some out of range (-1, too large).
    """
    pages_per_req = [-(-n // page_size) for n in k_lens]
    num_pages = sum(pages_per_req) + spare_pages
    max_pages = max(pages_per_req, default=0) + extra_columns
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.randint(-1, num_pages + 8, (len(k_lens), max_pages), generator=gen)
    valid = torch.zeros(num_pages, page_size, dtype=torch.bool)
    start = 0
    for r, (n, used) in enumerate(zip(k_lens, pages_per_req)):
        pages = perm[start:start + used]
        start += used
        table[r, :used] = pages
        for p in range(used):
            valid[pages[p], :max(0, min(page_size, n - p * page_size))] = True
    caches = []
    for feat in feature_shapes:
        c = torch.randn(num_pages, page_size, *feat, generator=gen) * scale
        c[~valid] = float("nan")
        caches.append(c.to(dtype).to(device))
    return (caches, table.to(torch.int32).to(device),
            torch.tensor(list(k_lens), dtype=torch.int32, device=device))


def _cu_seqlens(lens: Sequence[int], device) -> Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------------------------
# Attention cases (flash_attn_with_kvcache; reused by the varlen and MLA samplers)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One attention configuration. ``reqs`` lists ``(new query tokens, total keys)``."""
    reqs: tuple[tuple[int, int], ...]
    page_size: int = 16
    hq: int = 4
    hkv: int = 4
    d: int = 64
    dv: int = 0                               # 0: same as d
    dtype: torch.dtype = torch.float32        # q (and K/V unless kv_dtype)
    kv_dtype: Optional[torch.dtype] = None    # fp8 KV with k/v_descale
    q_fp8: bool = False                       # fp8 q with q_descale (output bf16)
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    qv: bool = False
    softmax_scale: Optional[float] = None     # None: 1/sqrt(D) (1/sqrt(D + Dv) with qv)
    leftpad: tuple[int, ...] = ()             # cache_leftpad per request (() : none)
    blocks: tuple[tuple[int, int, int], ...] = ()  # (request, first row, last row) id spans
    num_splits: int = 0
    return_lse: bool = True                   # False: the op returns an empty [Hq, 0] LSE

    @property
    def head_dim_v(self) -> int:
        return self.dv or self.d

    @property
    def scale(self) -> float:
        if self.softmax_scale is not None:
            return self.softmax_scale
        return 1.0 / math.sqrt(self.d + (self.head_dim_v if self.qv else 0))


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ATTENTION_CASES = (
    # decode, MHA, page 16, D 64
    AttentionCase(((1, 7), (1, 1), (1, 20)), page_size=16, causal=True),
    # extend with prefixes, GQA 3, page 4, D 80
    AttentionCase(((5, 5), (3, 12), (1, 1)), page_size=4, hq=6, hkv=2, d=80, causal=True),
    # mixed with empty requests (0 new tokens; cache length 0), GQA 4, page 1, D 128
    AttentionCase(((0, 0), (4, 9), (0, 5), (2, 2)), page_size=1, hq=8, hkv=2, d=128, causal=True),
    # D 192 with Dv 128, MQA, non-causal
    AttentionCase(((3, 10), (2, 6)), page_size=4, hq=4, hkv=1, d=192, dv=128),
    # D 256, page 16, bf16
    AttentionCase(((2, 17), (1, 3)), page_size=16, hq=2, hkv=2, d=256, dtype=torch.bfloat16,
                  causal=True),
    # sliding window, causal (HF W = 4), GQA 2
    AttentionCase(((6, 6), (2, 19)), page_size=4, hq=4, hkv=2, causal=True, window=(3, 0)),
    # window (2, 0) without causal: right = 0 all the same
    AttentionCase(((4, 10),), page_size=16, window=(2, 0)),
    # two-sided window, page 1
    AttentionCase(((5, 12), (3, 3)), page_size=1, hq=3, hkv=1, window=(2, 3)),
    # left unbounded, right 1
    AttentionCase(((3, 9),), page_size=4, hq=2, hkv=1, window=(-1, 1)),
    # softcap with a scale large enough for tanh to saturate
    AttentionCase(((3, 8), (1, 15)), page_size=4, causal=True, softcap=2.0, softmax_scale=0.5),
    # sinks, GQA 2, an empty request (the sink alone)
    AttentionCase(((2, 9), (1, 1), (0, 0)), page_size=16, hq=6, hkv=3, causal=True, sinks=True),
    # fp8 e4m3 KV with descale, bf16 q
    AttentionCase(((2, 11), (1, 4)), page_size=16, hq=4, hkv=2, dtype=torch.bfloat16,
                  kv_dtype=E4M3, causal=True),
    # fp8 e5m2 KV with descale, fp32 q, page 4, window
    AttentionCase(((3, 13),), page_size=4, hq=3, hkv=3, kv_dtype=E5M2, causal=True, window=(5, 0)),
    # fp8 q and KV (output bf16)
    AttentionCase(((2, 6), (1, 9)), page_size=4, hq=4, hkv=2, kv_dtype=E4M3, q_fp8=True,
                  causal=True),
    # qv (absorbed MLA extend): MQA, D 64 rope part, Dv 128 latent
    AttentionCase(((3, 7), (1, 12)), page_size=4, hq=4, hkv=1, d=64, dv=128, qv=True,
                  causal=True),
    # everything at once in bf16: GQA 3, window, softcap, sinks
    AttentionCase(((4, 13), (1, 30)), page_size=16, hq=6, hkv=2, dtype=torch.bfloat16,
                  causal=True, window=(7, 0), softcap=5.0, sinks=True),
    # fp16 extend, page 4 (lengths page_size +- 1)
    AttentionCase(((2, 3), (3, 5), (1, 4)), page_size=4, hq=4, hkv=4, dtype=torch.float16,
                  causal=True),
    # fp16, page 16 boundary (15, 16, 17 keys), non-causal prefill
    AttentionCase(((2, 15), (1, 16), (3, 17)), page_size=16, hq=3, hkv=3, d=80,
                  dtype=torch.float16),
    # an idle batch: no query token at all
    AttentionCase(((0, 0), (0, 4)), page_size=4, hq=4, hkv=2),
    # rows with no visible key: more queries than keys under causal, a request with no cache
    AttentionCase(((4, 2), (2, 0), (1, 3)), page_size=1, hq=2, hkv=2, causal=True),
    # window (0, 0): each row sees only its own position
    AttentionCase(((3, 6),), page_size=4, hq=2, hkv=1, window=(0, 0)),
    # cache_leftpad (one request all padding), causal, GQA 2, one pass over the keys
    AttentionCase(((3, 9), (1, 6), (2, 4)), page_size=4, hq=4, hkv=2, causal=True,
                  leftpad=(2, 6, 0), num_splits=1),
    # bidirectional blocks (Gemma-3 image tokens): full prefill, a block per request, GQA 2
    AttentionCase(((6, 6), (5, 5)), page_size=4, hq=4, hkv=2, causal=True,
                  blocks=((0, 1, 3), (1, 0, 1), (1, 3, 4))),
    # bidirectional block after a cached prefix, with a left window, at most 2 KV splits
    AttentionCase(((4, 9),), page_size=1, hq=2, hkv=1, causal=True, window=(5, 0),
                  blocks=((0, 0, 2),), num_splits=2),
)
# Calls without the LSE (the op returns an empty [Hq, 0]): samples of the op, not kernel cases.
NO_LSE_CASES = (
    # decode (the CPU's SDPA path), GQA 3, page 4 (lengths page_size +- 1)
    AttentionCase(((1, 3), (1, 5), (1, 12)), page_size=4, hq=6, hkv=2, causal=True,
                  return_lse=False),
    # extend, a left window, bf16
    AttentionCase(((3, 7), (2, 2)), page_size=4, hq=4, hkv=2, dtype=torch.bfloat16,
                  causal=True, window=(4, 0), return_lse=False),
)


def attention_case_inputs(case: AttentionCase, device, dtype: Optional[torch.dtype] = None,
                          gen: Optional[torch.Generator] = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``torch.ops.xpu_ops.flash_attn_with_kvcache`` for ``case``.

    ``dtype`` overrides ``case.dtype`` (fp8 KV and fp8 q stay fp8). Values are standard normal;
    fp8 descales are random in [0.5, 1.5].
    """
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    dtype = dtype or case.dtype
    q_lens = [lq for lq, _ in case.reqs]
    k_lens = [lk for _, lk in case.reqs]
    b, total_q, dv = len(case.reqs), sum(q_lens), case.head_dim_v
    kv_dtype = case.kv_dtype or dtype
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, k_lens, case.page_size, [(case.hkv, case.d), (case.hkv, dv)], dtype=kv_dtype,
        device=device)
    q = _randn(gen, total_q, case.hq, case.d, dtype=E4M3 if case.q_fp8 else dtype, device=device)
    qv = _randn(gen, total_q, case.hq, dv, dtype=dtype, device=device) if case.qv else None

    def descale(flag):
        return (torch.rand(b, case.hkv, generator=gen) + 0.5).to(device) if flag else None

    fp8_kv = case.kv_dtype is not None
    q_descale, k_descale, v_descale = descale(case.q_fp8), descale(fp8_kv), descale(fp8_kv)
    sinks = _randn(gen, case.hq, scale=2.0, device=device) if case.sinks else None
    out_dtype = torch.bfloat16 if case.q_fp8 else dtype
    out = _nan_poisoned((total_q, case.hq, dv), out_dtype, device)
    left, right = case.window
    leftpad = None
    if case.leftpad:
        leftpad = torch.tensor(case.leftpad, dtype=torch.int32, device=device)
        _poison_slots(k_cache, v_cache, page_table, case.leftpad)
    args = (q, k_cache, v_cache, cache_seqlens, page_table, _cu_seqlens(q_lens, device), out, qv,
            q_descale, k_descale, v_descale, sinks, leftpad, _block_ids(case, device))
    kwargs = dict(max_seqlen_q=max(q_lens, default=0), softmax_scale=case.scale,
                  causal=case.causal, window_size_left=left,
                  window_size_right=0 if case.causal else right, softcap=case.softcap,
                  num_splits=case.num_splits, return_softmax_lse=case.return_lse)
    return args, kwargs


def _poison_slots(k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                  leftpad: Sequence[int]) -> None:
    """NaN into the first ``leftpad[r]`` key slots of request ``r`` (never to be read)."""
    page_size = k_cache.shape[1]
    for r, n in enumerate(leftpad):
        for j in range(n):
            page = int(page_table[r, j // page_size])
            k_cache[page, j % page_size] = float("nan")
            v_cache[page, j % page_size] = float("nan")


def _block_ids(case: AttentionCase, device) -> Optional[Tensor]:
    """``bidirectional_block_ids [total_q]`` int32 of ``case.blocks`` (span k gets id k, other
    tokens -1), or None without blocks."""
    if not case.blocks:
        return None
    starts = [0]
    for lq, _ in case.reqs:
        starts.append(starts[-1] + lq)
    ids = torch.full((starts[-1],), -1, dtype=torch.int32)
    for block, (req, first, last) in enumerate(case.blocks):
        ids[starts[req] + first:starts[req] + last + 1] = block
    return ids.to(device)


def client_forms(args: tuple, variant: int) -> tuple:
    """``args`` of either attention op with sinks and fp8 descales in the other forms sgl-kernel
    and sgl-kernel-xpu pass (the op reads them as float32 ``[Hq]`` and ``[b, Hkv]``): sinks in
    bfloat16 (``variant`` odd: one value expanded to ``[Hq]``, stride 0); ``k_descale [1]``
    (``variant`` odd: a 0-d scale expanded to ``[1]``), ``v_descale`` and ``q_descale [b]``.
    The values are new (the first KV head's scales); a test builds the ``[b, Hkv]`` form itself.
    Positions: 8-11 are q/k/v descale and sinks in both ops' schemas."""
    args = list(args)
    q_descale, k_descale, v_descale, sinks = args[8:12]
    if sinks is not None:
        sinks = (sinks[:1].to(torch.bfloat16).expand(sinks.shape[0]) if variant % 2
                 else sinks.to(torch.bfloat16))
    if k_descale is not None:
        k_descale = k_descale[0, 0].expand(1) if variant % 2 else k_descale[0, :1].clone()
    per_request = [None if t is None else t[:, 0].contiguous() for t in (q_descale, v_descale)]
    args[8:12] = per_request[0], k_descale, per_request[1], sinks
    return tuple(args)


#: Indices of the first ``ATTENTION_CASES`` with sinks, with fp8 KV and with an fp8 query: their
#: ``client_forms`` are samples too.
CLIENT_FORM_CASES = tuple(next(i for i, c in enumerate(ATTENTION_CASES) if has(c)) for has in (
    lambda c: c.sinks, lambda c: c.kv_dtype is not None and not c.q_fp8, lambda c: c.q_fp8))


@_sampler("flash_attn_with_kvcache")
def _flash_attn_with_kvcache_samples(device, dtype, gen):
    for case in ATTENTION_CASES + NO_LSE_CASES:
        if dtype is not None and case.q_fp8:
            continue
        yield attention_case_inputs(case, device, dtype, gen)
    for variant, index in enumerate(CLIENT_FORM_CASES):
        if dtype is None or not ATTENTION_CASES[index].q_fp8:
            args, kwargs = attention_case_inputs(ATTENTION_CASES[index], device, dtype, gen)
            yield client_forms(args, variant), kwargs


def varlen_case_inputs(case: AttentionCase, device, dtype: Optional[torch.dtype] = None,
                       gen: Optional[torch.Generator] = None, *, seqused: bool = False,
                       seqused_q: bool = False) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``torch.ops.xpu_ops.flash_attn_varlen_func`` for ``case``.

    Request ``r``'s keys are packed contiguously (``case.page_size`` is unused). With ``seqused``
    every request gets 2 extra NaN keys past ``seqused_k[r]`` inside its ``cu_seqlens_k`` range.
    With ``seqused_q`` the last query row of every request with one is unused (output 0).
    """
    args, kwargs = attention_case_inputs(case, device, dtype, gen)
    q, k_cache, v_cache, _, _, cu_q, out, qv, q_descale, k_descale, v_descale, sinks = args[:12]
    gen = gen if gen is not None else torch.Generator().manual_seed(1)
    pad = 2 if seqused else 0
    k_lens = [lk for _, lk in case.reqs]
    kv_dtype = k_cache.dtype

    def ragged(feat):
        parts = []
        for n in k_lens:
            x = torch.randn(n + pad, case.hkv, feat, generator=gen)
            x[n:] = float("nan")
            parts.append(x)
        return torch.cat(parts).to(kv_dtype).to(device)

    k, v = ragged(case.d), ragged(case.head_dim_v)
    cu_k = _cu_seqlens([n + pad for n in k_lens], device)
    seqused_k = torch.tensor(k_lens, dtype=torch.int32, device=device) if seqused else None
    kwargs = dict(kwargs, max_seqlen_k=max(k_lens, default=0) + pad)
    del kwargs["return_softmax_lse"]  # the varlen op always returns the LSE
    used_q = (torch.tensor([max(lq - 1, 0) for lq, _ in case.reqs], dtype=torch.int32,
                           device=device) if seqused_q else None)
    return ((q, k, v, cu_q, cu_k, out, seqused_k, qv, q_descale, k_descale, v_descale, sinks,
             used_q), kwargs)


@_sampler("flash_attn_varlen_func")
def _flash_attn_varlen_func_samples(device, dtype, gen):
    for i, case in enumerate(ATTENTION_CASES):
        if dtype is not None and case.q_fp8:
            continue
        yield varlen_case_inputs(case, device, dtype, gen, seqused=i % 3 == 1,
                                 seqused_q=i % 4 == 2)
    for variant, index in enumerate(CLIENT_FORM_CASES):
        if dtype is None or not ATTENTION_CASES[index].q_fp8:
            args, kwargs = varlen_case_inputs(ATTENTION_CASES[index], device, dtype, gen)
            yield client_forms(args, variant + 1), kwargs


# ----------------------------------------------------------------------------------------------
# merge_state_v2, flash_mla_decode, KV-cache writes, SWA spec page tables
# ----------------------------------------------------------------------------------------------

@_sampler("merge_state_v2")
def _merge_state_v2_samples(device, dtype, gen):
    inf = float("inf")
    # (N, H, D, dtype, which LSE entries are empty: -inf on "a", "b", "both" or "mixed" rows;
    # "posinf": +inf (FlashAttention's empty row) against finite, -inf and +inf; "far" or "")
    for n, h, d, dt, empty in ((5, 4, 64, torch.float32, "mixed"), (3, 2, 128, torch.bfloat16, ""),
                               (4, 8, 80, torch.float16, "mixed"), (1, 1, 256, torch.float32, "a"),
                               (2, 3, 64, torch.float32, "both"), (0, 4, 64, torch.float32, ""),
                               (6, 2, 32, torch.float32, "far"),
                               (4, 3, 64, torch.bfloat16, "posinf")):
        dt = dtype or dt
        v_a, v_b = _randn(gen, n, h, d, dtype=dt, device=device), _randn(gen, n, h, d, dtype=dt,
                                                                             device=device)
        s_a, s_b = torch.randn(n, h, generator=gen) * 3, torch.randn(n, h, generator=gen) * 3
        if empty in ("a", "both"):
            s_a.fill_(-inf)
        if empty in ("b", "both"):
            s_b.fill_(-inf)
        if empty == "mixed" and n:
            s_a[0], s_b[-1] = -inf, -inf
            s_a[n // 2, 0] = s_b[n // 2, 0] = -inf
        if empty == "far":                      # one side dominates by e^60
            s_a = s_b + 60.0
        if empty == "posinf":
            s_a[0], s_b[1] = inf, inf                           # against finite LSEs
            s_a[2], s_b[2] = inf, -inf                          # +inf with -inf
            s_a[3], s_b[3] = inf, inf                           # both +inf
        s_a, s_b = s_a.to(device), s_b.to(device)
        yield ((v_a, s_a, v_b, s_b, _nan_poisoned((n, h, d), dt, device),
                _nan_poisoned((n, h), torch.float32, device)), {})


@_sampler("merge_state")
def _merge_state_samples(device, dtype, gen):
    # merge_state (v1) reads the same LSEs in log2 units: the same cases, empty sides included.
    yield from _merge_state_v2_samples(device, dtype, gen)


def _mla_inputs(gen, k_lens, rows, page_size, h, latent, rope, dtype, device):
    """``(q_nope [rows, H, R], q_rope [rows, H, r], kv_cache [num_pages, page_size, R + r],
    page_table, seq_lens)`` of an MLA sample, the cache with garbage past each request's keys."""
    (kv_cache,), page_table, seq_lens = paged_kv_cache(
        gen, k_lens, page_size, [(latent + rope,)], dtype=dtype, device=device)
    q_nope = _randn(gen, rows, h, latent, dtype=dtype, device=device)
    q_rope = _randn(gen, rows, h, rope, dtype=dtype, device=device)
    return q_nope, q_rope, kv_cache, page_table, seq_lens


@_sampler("flash_mla_decode")
def _flash_mla_decode_samples(device, dtype, gen):
    from .ops.mla_decode import flash_mla_get_workspace_size
    # (k_lens, page_size, H, R, r, dtype, num_kv_splits)
    for k_lens, page_size, h, latent, rope, dt, splits in (
            ((9, 1, 30), 16, 4, 64, 16, torch.float32, -1),
            ((0, 5), 1, 2, 128, 32, torch.float32, -1),
            ((17,), 64, 16, 512, 64, torch.bfloat16, -1),
            ((4, 8, 12), 4, 3, 64, 16, torch.float16, 2),
            ((33, 2), 16, 8, 128, 64, torch.float32, 4)):
        dt = dtype or dt
        b = len(k_lens)
        q_nope, q_rope, kv_cache, page_table, cache_seqlens = _mla_inputs(
            gen, k_lens, b, page_size, h, latent, rope, dt, device)
        size = flash_mla_get_workspace_size(max(k_lens), b, h, page_size, splits)
        workspace = torch.zeros(size, dtype=torch.uint8, device=device)
        yield ((q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                1.0 / math.sqrt(latent // 4 + rope), splits), {})


@_sampler("flash_mla_prefill")
def _flash_mla_prefill_samples(device, dtype, gen):
    # (q_lens, k_lens, page_size, H, R, r, dtype, causal, num_kv_splits, q_pe a view of q_all):
    # extend with prefixes, a request whose queries outnumber its keys (first rows see nothing)
    # next to one without queries, full prefill at DeepSeek's R/r, non-causal, forced splits.
    for q_lens, k_lens, page_size, h, latent, rope, dt, causal, splits, sliced in (
            ((3, 1, 5), (9, 1, 30), 16, 4, 64, 16, torch.float32, True, -1, False),
            ((2, 0), (1, 5), 1, 2, 128, 32, torch.float32, True, -1, True),
            ((17,), (17,), 64, 16, 512, 64, torch.bfloat16, True, -1, True),
            ((3, 5), (8, 12), 4, 3, 64, 16, torch.float16, False, 1, False),
            ((2, 7), (33, 7), 16, 8, 128, 64, torch.float32, True, 4, False)):
        dt = dtype or dt
        q_nope, q_pe, kv_cache, page_table, seq_lens_k = _mla_inputs(
            gen, k_lens, sum(q_lens), page_size, h, latent, rope, dt, device)
        if sliced:                       # sglang splits one [total_q, H, R + r] query tensor
            q_pe = torch.cat([q_nope, q_pe], dim=-1)[..., latent:]
        cu_seqlens_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32,
                                    device=device)
        workspace = torch.zeros(1, dtype=torch.uint8, device=device)
        yield ((q_nope, q_pe, kv_cache, cu_seqlens_q, seq_lens_k, page_table, workspace),
               dict(max_seqlen_q=max(q_lens), sm_scale=1.0 / math.sqrt(latent // 4 + rope),
                    causal=causal, num_kv_splits=splits))


@_sampler("store_kv_cache")
def _store_kv_cache_samples(device, dtype, gen):
    # (cache shape prefix, N, Hkv, D, Dv, dtype, cache dtype, loc dtype, scales)
    for prefix, n, hkv, d, dv, dt, cache_dt, loc_dt, scaled in (
            ((32,), 5, 2, 64, 64, torch.float32, None, torch.int64, False),
            ((6, 4), 7, 4, 80, 80, torch.bfloat16, None, torch.int64, False),
            ((3, 16), 3, 1, 192, 128, torch.float16, None, torch.int32, False),
            ((4, 4), 6, 2, 64, 64, torch.bfloat16, E4M3, torch.int64, True),
            ((16,), 4, 2, 64, 64, torch.float32, E5M2, torch.int64, False),
            ((8,), 0, 2, 64, 64, torch.float32, None, torch.int64, False)):
        dt = dtype or dt
        cache_dt = cache_dt or dt
        slots = math.prod(prefix)
        k_cache = _randn(gen, *prefix, hkv, d, dtype=cache_dt, device=device)
        v_cache = _randn(gen, *prefix, hkv, dv, dtype=cache_dt, device=device)
        loc = torch.randperm(slots, generator=gen)[:n].to(loc_dt).to(device)
        k = _randn(gen, n, hkv, d, dtype=dt, device=device, scale=2.0)
        v = _randn(gen, n, hkv, dv, dtype=dt, device=device, scale=2.0)
        scale = (lambda: torch.rand(1, generator=gen).add(0.5).to(device)) if scaled else None
        yield ((k_cache, v_cache, loc, k, v, scale and scale(), scale and scale()), {})


def sparse_attn_inputs(gen, b, sq, sk, hq, hkv, d, nnz_s, nnz_v, bm, bn, dtype, device):
    """``(q, k, v, block_count, block_offset, column_count, column_index, out)`` of
    ``sparse_attn_func``: random offsets (some past ``seqlen_k``), columns (some negative or past
    ``seqlen_k``) and counts (some above capacity), NaN-poisoned ``out``."""
    rows = -(-sq // bm)
    q = _randn(gen, b, sq, hq, d, dtype=dtype, device=device)
    k = _randn(gen, b, sk, hkv, d, dtype=dtype, device=device)
    v = _randn(gen, b, sk, hkv, d, dtype=dtype, device=device)
    i32 = torch.int32
    block_count = torch.randint(0, nnz_s + 2, (b, hq, rows), generator=gen, dtype=i32)
    block_offset = torch.randint(0, sk + bn, (b, hq, rows, nnz_s), generator=gen, dtype=i32)
    column_count = torch.randint(0, nnz_v + 2, (b, hq, rows), generator=gen, dtype=i32)
    column_index = torch.randint(-2, sk + 2, (b, hq, rows, nnz_v), generator=gen, dtype=i32)
    out = _nan_poisoned((b, sq, hq, d), dtype, device)
    return (q, k, v, *(t.to(device) for t in (block_count, block_offset, column_count,
                                              column_index)), out)


@_sampler("sparse_attn_func")
def _sparse_attn_func_samples(device, dtype, gen):
    # (b, seqlen_q, seqlen_k, Hq, Hkv, D, NNZ_S, NNZ_V, block_size_M/N, dtype, causal, softcap)
    for b, sq, sk, hq, hkv, d, nnz_s, nnz_v, bm, bn, dt, causal, softcap in (
            (1, 9, 13, 2, 2, 32, 2, 3, 4, 4, torch.float32, False, 0.0),
            (2, 7, 12, 4, 2, 64, 3, 2, 4, 2, torch.bfloat16, True, 0.0),
            (1, 5, 5, 2, 1, 32, 1, 0, 8, 4, torch.float16, True, 5.0),
            (2, 1, 16, 2, 2, 32, 0, 4, 4, 8, torch.float32, True, 0.0)):
        args = sparse_attn_inputs(gen, b, sq, sk, hq, hkv, d, nnz_s, nnz_v, bm, bn,
                                  dtype or dt, device)
        yield args, dict(softmax_scale=d ** -0.5, causal=causal, softcap=softcap,
                         block_size_M=bm, block_size_N=bn)


@_sampler("convert_vertical_slash_indexes")
def _convert_vertical_slash_indexes_samples(device, dtype, gen):
    # (q_lens, kv_lens, H, NNZ_V, NNZ_S, context_size, block_size_M/N, causal, mergehead)
    for q_lens, kv_lens, h, nnz_v, nnz_s, ctx, bm, bn, causal, merge in (
            ((6,), (6,), 1, 2, 1, 6, 2, 2, True, False),
            ((9, 5), (17, 5), 2, 4, 3, 9, 4, 2, True, False),
            ((8,), (12,), 2, 3, 2, 8, 4, 4, False, False),
            ((7, 3), (9, 8), 2, 3, 3, 7, 2, 2, True, True)):
        i32 = torch.int32
        verticals = torch.stack([torch.randperm(max(kv_lens), generator=gen)[:nnz_v].sort().values
                                 for _ in range(len(q_lens) * h)]).view(len(q_lens), h, nnz_v)
        slashes = torch.stack([torch.randperm(max(kv_lens), generator=gen)[:nnz_s].sort(
            descending=True).values for _ in range(len(q_lens) * h)]).view(len(q_lens), h, nnz_s)
        counts = ((torch.randint(0, nnz_v + 1, (h,), generator=gen, dtype=i32).to(device),
                   torch.randint(0, nnz_s + 2, (h,), generator=gen, dtype=i32).to(device))
                  if merge else (None, None))
        yield ((torch.tensor(q_lens, dtype=i32, device=device),
                torch.tensor(kv_lens, dtype=i32, device=device), verticals.to(i32).to(device),
                slashes.to(i32).to(device), *counts, ctx, bm, bn, causal), {})


@_sampler("store_cache")
def _store_cache_samples(device, dtype, gen):
    # (S, N, row dims Dk/Dv, dtype, rows as one head of [N, H, D] (strided), skipped tokens)
    for slots, n, dk, dv, dt, heads, skip in ((32, 5, 64, 64, torch.float32, 1, ()),
                                              (64, 7, 128, 96, torch.bfloat16, 3, (1, 4)),
                                              (16, 4, 80, 80, torch.float16, 2, (0, 1, 2, 3)),
                                              (8, 0, 64, 64, torch.float32, 1, ())):
        dt = dtype or dt
        k_cache = _randn(gen, slots, dk, dtype=dt, device=device)
        v_cache = _randn(gen, slots, dv, dtype=dt, device=device)
        indices = torch.randperm(slots, generator=gen)[:n]
        indices[list(skip)] = -1
        k = _randn(gen, n, heads, dk, dtype=dt, device=device, scale=2.0)[:, heads - 1]
        v = _randn(gen, n, heads, dv, dtype=dt, device=device, scale=2.0)[:, 0]
        yield ((k, v, k_cache, v_cache, indices.to(device)), {})


@_sampler("store_mla_kv_cache")
def _store_mla_kv_cache_samples(device, dtype, gen):
    # (cache shape prefix before R + r, N, R, r, dtype, cache dtype)
    for prefix, n, latent, rope, dt, cache_dt in (
            ((24, 1), 5, 64, 16, torch.float32, None),
            ((4, 16), 9, 512, 64, torch.bfloat16, None),
            ((3, 4, 1), 4, 128, 32, torch.float16, None),
            ((10, 1), 3, 64, 16, torch.bfloat16, E4M3),
            ((6, 1), 0, 64, 16, torch.float32, None)):
        dt = dtype or dt
        kv_cache = _randn(gen, *prefix, latent + rope, dtype=cache_dt or dt, device=device)
        slots = math.prod(prefix)
        loc = torch.randperm(slots, generator=gen)[:n].to(device)
        k_nope = _randn(gen, n, 1, latent, dtype=dt, device=device)
        k_rope = _randn(gen, n, 1, rope, dtype=dt, device=device)
        yield ((kv_cache, loc, k_nope, k_rope), {})


@_sampler("prepare_swa_spec_page_table")
def _prepare_swa_spec_page_table_samples(device, dtype, gen):
    # (prefix_lens, page-table width P, tree of D drafts as parent indices, -1 = root's child)
    for prefix_lens, width, parents in (((5, 0, 7), 8, (-1, 0, 1, 2)),          # chains
                                        ((3, 6), 6, (-1, 0, 0, 1, 1, 2)),      # topk 2 tree
                                        ((1,), 4, (-1,)),                      # one draft
                                        ((4, 2), 5, (-1, -1, 0, 1, 2, 3))):    # topk 2 roots
        b, num_draft = len(prefix_lens), len(parents)
        mask = torch.zeros(num_draft, num_draft, dtype=torch.bool)
        for i in range(num_draft):
            j = i
            while j >= 0:                      # a draft sees itself and its ancestors
                mask[i, j] = True
                j = parents[j]
        page_table = torch.randint(0, 1000, (b, width), generator=gen, dtype=torch.int32)
        draft_slots = torch.randint(1000, 2000, (b, num_draft), generator=gen, dtype=torch.int32)
        yield ((page_table.to(device), torch.tensor(prefix_lens, dtype=torch.int32, device=device),
                draft_slots.to(device), mask.expand(b, -1, -1).contiguous().to(device)), {})


@_sampler("apply_rotary_emb")
def _apply_rotary_emb_samples(device, dtype, gen):
    # (N, H, D, rotary_dim, seqlen_ro, interleaved, dtype, strided x)
    for n, h, d, rot, seqlen_ro, interleaved, dt, strided in (
            (5, 3, 64, 64, 16, False, torch.float32, False),
            (4, 2, 64, 32, 9, True, torch.float32, True),        # partial rotary, x a view
            (3, 4, 80, 48, 5, False, torch.bfloat16, False),
            (2, 1, 128, 128, 300, True, torch.float16, False),
            (0, 2, 32, 16, 4, False, torch.float32, False)):     # no token
        dt = dtype or dt
        base = _randn(gen, n, h, 2 * d if strided else d, dtype=dt, device=device)
        x = base[..., ::2] if strided else base
        angle = torch.rand(seqlen_ro, rot // 2, generator=gen) * 6.283
        positions = torch.randint(0, seqlen_ro, (n,), generator=gen, dtype=torch.int32)
        if n:
            positions[0] = seqlen_ro - 1
        yield ((x, angle.cos().to(dt).to(device), angle.sin().to(dt).to(device),
                positions.to(device)), dict(interleaved=interleaved))


@contextlib.contextmanager
def recorded_triton_launches() -> Iterator[list]:
    """Record the keyword launch parameters (tile sizes, kernel-path constexprs, ``num_warps``,
    ``num_stages``) of every kernel launch the Triton ``paged_attention`` provider makes inside
    the block; the launches still run. Yields the list the records are appended to, one dict per
    launch. For tests and benchmarks that check which kernel path a call took.

    >>> with recorded_triton_launches() as launches:
    ...     pass
    >>> launches
    []
    """
    from xpu_ops.triton import paged_attention as pa
    seen: list = []
    real = pa.launch

    def spy(kernel, grid, device, *args, **kwargs):
        seen.append(kwargs)
        return real(kernel, grid, device, *args, **kwargs)
    pa.launch = spy
    try:
        yield seen
    finally:
        pa.launch = real


@contextlib.contextmanager
def counted_ops() -> Iterator[collections.Counter]:
    """Count every op dispatched inside the block (on any device, host tensors included), as
    ``{op packet name: calls}`` (``aten.copy_`` counts as ``"copy_"``); the ops still run.

    >>> with counted_ops() as counts:
    ...     _ = torch.zeros(2) + 1
    >>> counts["add"]
    1
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    counts: collections.Counter = collections.Counter()

    class _Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with _Counter():
        yield counts


@contextlib.contextmanager
def recorded_op_calls(name: str) -> Iterator[list]:
    """Record every eager call of ``torch.ops.xpu_ops.<name>`` made inside the block, whether
    through the public wrapper or straight into the op, as one ``{argument name: value}`` dict
    per call (names from the op's schema); the calls still run. A ``TorchDispatchMode`` sees
    them at the dispatcher, so a caller that skips the wrapper is seen too; calls inside a
    compiled graph are seen only while it is traced.

    >>> with recorded_op_calls("flash_attn_with_kvcache") as calls:
    ...     pass
    >>> calls
    []
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    packet = getattr(torch.ops.xpu_ops, name)
    seen: list = []

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket is packet:
                names = [a.name for a in func._schema.arguments]
                seen.append({**dict(zip(names, args)), **kwargs})
            return func(*args, **kwargs)

    with _Recorder():
        yield seen


from . import testing_flash_mla  # noqa: E402,F401  (the FlashMLA surface's samplers)
from . import testing_dsa  # noqa: E402,F401  (the DSA indexer ops' samplers register on import)
from . import testing_linear_attention  # noqa: E402,F401  (registers the linear-attention samplers)
