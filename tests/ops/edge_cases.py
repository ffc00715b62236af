"""The edge-case table of ``flash_attn_with_kvcache`` that every path of every provider runs.

One table (``EDGE_CASES``), one input builder (``edge_case_inputs``), one path list per provider
(``PATHS``) and one runner (``run_path``), shared by the CPU test (``test_edge_cases.py``; Triton
through its interpreter) and the GPU one. Each case is an ``xpu_ops.testing.AttentionCase`` on
tiny shapes (NaN in every unused cache slot and in ``out`` before the call) plus the tweaks
that case needs:

- empty rows (more queries than keys under causal, a request without keys), with ``-inf`` and
  ``+inf`` sinks, on decode (the CPU reference's fast path) and extend shapes;
- softcap ``inf`` (no cap) and a saturating small cap; page size 1; every GQA ratio (1, 2, 3,
  4, 8); strided views over NaN buffers and expanded (stride-0) sinks; a loose
  ``max_seqlen_q = 2**31 - 1``; int32 extremes in ``cache_seqlens`` (clamped into the
  capacity, so the page-table column past each request is read: its garbage ids in range
  give keys, out of range hide them, as API.md's "Writes" says).

The paths: the reference's general path (a zero ``cache_leftpad`` keeps decode shapes off the
fast path), its CPU decode fast path (with and without the LSE, the latter torch SDPA where it
applies), its one pass (``num_splits=1``); Triton's one pass, split-KV, and each optional kernel
path of ``xpu_ops.triton._common.OPTIONAL_PATHS`` forced through ``ENABLED_PATHS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator, Optional

import torch

import xpu_ops.testing as xt
from xpu_ops.testing_layouts import expanded_view, strided_view

INT32_MAX = 2 ** 31 - 1
Case = xt.AttentionCase


@dataclasses.dataclass(frozen=True)
class EdgeCase:
    """A table row: the attention case and its tweaks."""
    case: xt.AttentionCase
    sink_value: Optional[float] = None    # every sink logit this value (with case.sinks)
    softcap: Optional[float] = None       # overrides case.softcap (inf: no cap)
    layout: str = "contiguous"            # "strided": q, out, caches and metadata as strided
                                          # views over NaN/garbage; "expanded": stride-0 sinks
    max_seqlen_q: Optional[int] = None    # a loose bound instead of the tight one
    cache_seqlens: tuple = ()             # int32 extremes instead of the lengths (checks off:
                                          # clamped into [0, capacity], API.md "Writes")

    @property
    def decode(self) -> bool:
        return all(lq == 1 for lq, _ in self.case.reqs)


EDGE_CASES = {
    "empty-rows": EdgeCase(Case(((3, 2), (2, 0), (1, 3)), page_size=2, hq=2, hkv=2, d=16,
                                causal=True)),
    "decode-no-keys-neg-inf-sinks": EdgeCase(Case(((1, 0), (1, 5), (1, 3)), page_size=4, hq=4,
                                                  hkv=2, d=16, sinks=True), -math.inf),
    "decode-no-keys-pos-inf-sinks": EdgeCase(Case(((1, 0), (1, 5)), page_size=4, hq=2, hkv=1,
                                                  d=16, sinks=True), math.inf),
    "extend-empty-neg-inf-sinks": EdgeCase(Case(((2, 0), (3, 4)), page_size=2, hq=3, hkv=1,
                                                d=16, causal=True, sinks=True), -math.inf),
    "decode-softcap-inf": EdgeCase(Case(((1, 6), (1, 3)), page_size=4, hq=4, hkv=4, d=16),
                                   softcap=math.inf),
    "extend-softcap-small": EdgeCase(Case(((2, 6), (1, 3)), page_size=4, hq=2, hkv=1, d=16,
                                          causal=True, softcap=0.5, softmax_scale=2.0)),
    "page-size-1-gqa-1": EdgeCase(Case(((3, 5), (1, 1)), page_size=1, hq=2, hkv=2, d=16,
                                       causal=True)),
    "decode-gqa-3": EdgeCase(Case(((1, 7), (1, 2)), page_size=2, hq=6, hkv=2, d=16)),
    "decode-gqa-8": EdgeCase(Case(((1, 9), (1, 1)), page_size=4, hq=8, hkv=1, d=16)),
    "extend-gqa-4-window": EdgeCase(Case(((3, 9),), page_size=4, hq=4, hkv=1, d=16, causal=True,
                                         window=(2, 0))),
    "strided-gqa-2": EdgeCase(Case(((2, 7), (1, 4)), page_size=4, hq=4, hkv=2, d=16,
                                   causal=True), layout="strided"),
    "expanded-sinks-decode": EdgeCase(Case(((1, 4), (1, 6)), page_size=2, hq=4, hkv=2, d=16,
                                           sinks=True), layout="expanded"),
    "int32-extreme-lengths": EdgeCase(Case(((1, 3), (2, 5), (1, 4)), page_size=2, hq=4, hkv=2,
                                           d=16, causal=True),
                                      cache_seqlens=(INT32_MAX, -(2 ** 31), 2 ** 31 - 2)),
    "loose-max-seqlen-q": EdgeCase(Case(((2, 5), (1, 1)), page_size=2, hq=2, hkv=1, d=16,
                                        causal=True), max_seqlen_q=INT32_MAX),
}

# (provider, path) pairs; ``run_path`` knows each.
REFERENCE_PATHS = ("general", "decode-fast", "decode-no-lse", "one-pass")
TRITON_PATHS = ("one-pass", "split", "paths:none", "paths:page_tiles", "paths:phases",
                "paths:tma", "paths:tma_ws", "paths:mla_split", "paths:fold_scale")


def applies(edge: EdgeCase, path: str) -> bool:
    """Whether ``path`` is a distinct path for this case (the decode paths need decode shapes;
    SDPA needs no sinks and no softcap)."""
    if path == "decode-fast":
        return edge.decode
    if path == "decode-no-lse":
        return edge.decode and not edge.case.sinks and not (edge.softcap or edge.case.softcap)
    return True


def edge_case_inputs(edge: EdgeCase, device="cpu", seed: int = 0) -> tuple[tuple, dict, list]:
    """``(args, kwargs, guards)`` of the op call for ``edge``; ``guards`` lists ``(view,
    base_before)`` pairs of strided views whose buffers outside the view must not change."""
    args, kwargs = xt.attention_case_inputs(edge.case, device,
                                            gen=torch.Generator().manual_seed(seed))
    args = list(args)
    if edge.sink_value is not None:
        args[11] = torch.full_like(args[11], edge.sink_value)
    if edge.softcap is not None:
        kwargs["softcap"] = edge.softcap
    if edge.max_seqlen_q is not None:
        kwargs["max_seqlen_q"] = edge.max_seqlen_q
    if edge.cache_seqlens:  # the clamped lengths make every slot a key: finite values there
        args[3] = torch.tensor(edge.cache_seqlens, dtype=torch.int32, device=args[3].device)
        for i in (1, 2):
            args[i] = torch.nan_to_num(args[i], nan=0.5)
    guards = []
    if edge.layout == "strided":
        for i in (0, 1, 2, 3, 4, 5, 6):          # q, caches, cache_seqlens, page_table, cu, out
            args[i] = strided_view(args[i])
            guards.append((args[i], args[i]._base.clone()))
    elif edge.layout == "expanded":
        args[11] = expanded_view(args[11])
    return tuple(args), kwargs, guards


@contextlib.contextmanager
def triton_paths(paths: Optional[frozenset]) -> Iterator[None]:
    """Every Triton launch takes exactly ``paths`` (None: its kind's defaults) while inside."""
    from xpu_ops.triton import _common, paged_attention as pa
    saved = _common.ENABLED_PATHS
    _common.ENABLED_PATHS = paths
    pa._launch_params.cache_clear()               # launch parameters are cached by shape
    try:
        yield
    finally:
        _common.ENABLED_PATHS = saved
        pa._launch_params.cache_clear()


def run_path(edge: EdgeCase, path: str, args: tuple, kwargs: dict):
    """Call the op on ``path`` of the current provider; returns ``(out, lse or None)``."""
    kwargs = dict(kwargs)
    paths = None
    if path == "general" and edge.decode and args[12] is None:
        # off the decode fast path: a zero cache_leftpad (no key hidden) is an extra it skips
        args = (*args[:12], torch.zeros_like(args[3]), *args[13:])
    elif path == "decode-no-lse":
        kwargs["return_softmax_lse"] = False
    elif path == "one-pass":
        kwargs["num_splits"] = 1
    elif path == "split":
        kwargs["num_splits"] = 3
    elif path.startswith("paths:"):
        name = path.split(":")[1]
        paths = frozenset() if name == "none" else frozenset({name})
    with triton_paths(paths) if path.startswith("paths:") else contextlib.nullcontext():
        lse = torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
    return args[6], lse if kwargs.get("return_softmax_lse", True) else None


def oracle_of(edge: EdgeCase, args: tuple, kwargs: dict):
    """The float64 oracle (``tests/ops/oracle.py``) of the call, on dense copies."""
    from . import oracle
    dense = tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in args)
    kwargs = dict(kwargs, max_seqlen_q=max(kwargs["max_seqlen_q"], 1))
    softcap = kwargs["softcap"]
    kwargs["softcap"] = 0.0 if softcap == math.inf else softcap
    if edge.cache_seqlens:  # lengths clamped, page ids past the end read or hidden
        q, k_cache, v_cache, lens, table, cu = dense[:6]
        out, lse, _ = oracle.flash_attn_with_kvcache_unchecked(
            q, k_cache, v_cache, lens, table, cu, max_seqlen_q=kwargs["max_seqlen_q"],
            softmax_scale=kwargs["softmax_scale"], causal=kwargs["causal"],
            window_size_left=kwargs["window_size_left"],
            window_size_right=kwargs["window_size_right"], softcap=kwargs["softcap"],
            sinks=dense[11])
        return out, lse
    return oracle.flash_attn_with_kvcache(*dense, **kwargs)


def check_result(edge: EdgeCase, out, lse, want, want_lse, guards) -> None:
    """``out``/``lse`` match the oracle (empty rows exactly 0 and -inf, or +inf with an
    infinite sink), and every guard region of the strided views is intact."""
    from .utils import OUT_TOL, LSE_TOL
    from xpu_ops.testing_layouts import outside_view_unchanged
    assert not out.isnan().any(), "output holds NaN (unwritten rows or garbage leaked in)"
    torch.testing.assert_close(out.double(), want, **OUT_TOL[out.dtype])
    if lse is not None:
        infinite = torch.isinf(want_lse)
        assert torch.equal(lse[infinite].double(), want_lse[infinite]), (lse, want_lse)
        torch.testing.assert_close(lse[~infinite].double(), want_lse[~infinite],
                                   **LSE_TOL[out.dtype])
        empty_rows = torch.isinf(want_lse).all(0)
        assert out[empty_rows].eq(0).all()
    for view, base_before in guards:
        assert outside_view_unchanged(view, base_before), "a write outside the view"
