"""Checks that read tensor values (slots and page ids in range, prefix sums), behind a switch.

Shape/dtype checks (``_checks.py``) run always, in the ops and their fakes. The checks here need
the values of index tensors, i.e. a host synchronisation on a GPU, so they run only when the
debug switch is on: ``XPU_OPS_DEBUG_CHECKS=1`` in the environment (read once;
``xpu_ops.refresh()`` reads it again) or inside ``with xpu_ops.debug_checks():``. The public
wrappers call one ``check_<op>`` each, right before the ``torch.ops.xpu_ops`` call; calling the
ops directly skips them.

Even with the switch on, nothing is checked while ``torch.compile`` traces, for fake or meta
tensors, or while the current stream of the tensors' device is being captured into a graph (a
host sync there would break the capture): run one eager step with the switch on to debug.
Each check raises ``ValueError`` in the house format, naming the argument, the rule and the first
bad value with its index. The checks assume the shapes the op expects and skip otherwise, so
the op's own shape check reports a malformed call.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch
from torch import Tensor

from ._checks import fail
from .provider_table import getenv

ENV = "XPU_OPS_DEBUG_CHECKS"
_INT_DTYPES = (torch.int32, torch.int64)
_override: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar(
    "xpu_ops_debug_checks", default=None)


def debug_checks_enabled() -> bool:
    """True inside ``debug_checks()`` or when ``XPU_OPS_DEBUG_CHECKS=1`` (as of the last
    ``xpu_ops.refresh()``)."""
    forced = _override.get()
    return forced if forced is not None else getenv(ENV) == "1"


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """Turn the value checks of the public ops on (or off) inside the block, whatever the
    environment says.

    >>> import torch, xpu_ops
    >>> kc = vc = torch.zeros(4, 1, 2)
    >>> with xpu_ops.debug_checks():
    ...     xpu_ops.store_kv_cache(kc, vc, torch.tensor([4]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    Traceback (most recent call last):
    xpu_ops._checks.XpuOpsValueError: store_kv_cache: loc has a token slot out of range; expected 0 <= loc < 4 ...
    """
    token = _override.set(bool(enabled))
    try:
        yield
    finally:
        _override.reset(token)


def _capturing(device: torch.device) -> bool:
    backend = getattr(torch, device.type, None)
    is_capturing = getattr(backend, "is_current_stream_capturing", None)
    try:
        return bool(is_capturing()) if is_capturing is not None else False
    except RuntimeError:
        return False


def _active(*tensors: Optional[Tensor]) -> bool:
    """Run value checks now? Off while tracing, for fake/meta tensors and during graph capture."""
    # is_compiling first: Dynamo cannot trace the switch's context variable.
    if torch.compiler.is_compiling() or not debug_checks_enabled():
        return False
    real = [t for t in tensors if isinstance(t, Tensor)]
    if torch._guards.detect_fake_mode(real) is not None:
        return False
    return not any(t.device.type == "meta" or _capturing(t.device) for t in real)


def _index_ok(t, ndim: int, device: Optional[torch.device] = None) -> bool:
    """``t`` has the rank and integer dtype the check needs (else the op's own check reports)."""
    return (isinstance(t, Tensor) and t.dim() == ndim and t.dtype in _INT_DTYPES
            and (device is None or t.device == device))


def _first(bad: Tensor) -> Optional[tuple[int, ...]]:
    """Index of the first True element of ``bad`` (one host sync), or None."""
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0])


def _at(arg: str, t: Tensor, index: tuple[int, ...]) -> str:
    return f"{arg}[{', '.join(map(str, index))}] = {int(t[index])}"


def _check_in_range(fn: str, arg: str, t: Tensor, upper: int, what: str, unit: str,
                    fix: str) -> None:
    """Every entry of the index tensor ``t`` lies in ``[0, upper)``, else a ValueError naming
    ``arg`` and its first entry out of range."""
    where = _first((t < 0) | (t >= upper))
    if where is not None:
        fail(fn, arg, f"has a {what} out of range", f"0 <= {arg} < {upper} ({unit})",
             _at(arg, t, where), fix)


def check_loc(fn: str, loc, num_slots: int) -> None:
    """Every ``loc`` entry is a token slot in ``[0, num_slots)``, and no slot repeats."""
    if not _index_ok(loc, 1):
        return
    _check_in_range(fn, "loc", loc, num_slots, "token slot", "token slots of the cache",
                    "Allocate slots from the cache's pool; out-of-range slots are skipped "
                    "(never written) when XPU_OPS_DEBUG_CHECKS is off.")
    if loc.shape[0] < 2:
        return
    slots, order = loc.sort(stable=True)
    repeat = torch.zeros_like(loc, dtype=torch.bool)
    repeat[order[1:]] = slots[1:] == slots[:-1]          # a later entry of a repeated slot
    where = _first(repeat)
    if where is not None:
        earlier = int(_first(loc[:where[0]] == loc[where])[0])
        fail(fn, "loc", "has a repeated token slot", "distinct slots (one row per slot)",
             f"{_at('loc', loc, where)} = loc[{earlier}]",
             "Give each new token its own slot; which of two rows for one slot lands is "
             "unspecified when XPU_OPS_DEBUG_CHECKS is off.")


def check_store_cache(fn: str, indices, k_cache) -> None:
    """``store_cache_xpu``'s ``indices``: -1 (skip the token) or a row in ``[0, S)``."""
    if not (_index_ok(indices, 1) and isinstance(k_cache, Tensor) and k_cache.dim() >= 1
            and _active(indices)):
        return
    rows = k_cache.shape[0]
    where = _first((indices < -1) | (indices >= rows))
    if where is not None:
        fail(fn, "indices", "has a token slot out of range",
             f"-1 (skip) or 0 <= indices < {rows} (rows of k_cache)",
             _at("indices", indices, where),
             "Pass -1 for a token that is not stored; other out-of-range indices are skipped "
             "(never written) when XPU_OPS_DEBUG_CHECKS is off.")


def check_cache_batch_idx(fn: str, cache_batch_idx, rows: int, rows_rule: str) -> None:
    """Every ``cache_batch_idx`` entry is a row in ``[0, rows)`` (of the dense cache or the
    page table)."""
    if not (_index_ok(cache_batch_idx, 1) and _active(cache_batch_idx)):
        return
    _check_in_range(fn, "cache_batch_idx", cache_batch_idx, rows, "row", rows_rule,
                    "Out-of-range rows read no keys and take no appended keys when "
                    "XPU_OPS_DEBUG_CHECKS is off.")


def check_scale(fn: str, arg: str, scale) -> None:
    """A per-tensor fp8 scale tensor is positive and finite (stored rows are divided by it)."""
    if not isinstance(scale, Tensor) or not scale.is_floating_point() or scale.numel() == 0:
        return
    flat = scale.reshape(-1)
    where = _first(~((flat > 0) & torch.isfinite(flat)))
    if where is not None:
        fail(fn, arg, "is not a positive finite number", "0 < scale < inf (the fp8 cache "
             "stores rows / scale)", f"{float(flat[where[0]])}",
             "Use the scale the cache was calibrated with (1.0 when unscaled).")


def check_cu_seqlens(fn: str, arg: str, cu, total: int, total_rule: str,
                     padded: bool = False) -> None:
    """``cu`` starts at 0, never decreases and ends at ``total`` tokens (``padded``: at most
    ``total``; the tokens past its end are padding that no request owns)."""
    if not _index_ok(cu, 1) or cu.shape[0] == 0:
        return
    if int(cu[0]) != 0:
        fail(fn, arg, "does not start at 0", f"prefix sums with {arg}[0] = 0", _at(arg, cu, (0,)),
             "Prepend a 0 (e.g. torch.nn.functional.pad(lens.cumsum(0), (1, 0))).")
    where = _first(cu[1:] < cu[:-1])
    if where is not None:
        fail(fn, arg, "decreases", "non-decreasing prefix sums", _at(arg, cu, (where[0] + 1,)),
             f"Build it as a cumulative sum of per-request lengths (previous entry "
             f"{int(cu[where[0]])}).")
    if padded and int(cu[-1]) > total:
        fail(fn, arg, "reaches past the packed k", f"{arg}[-1] <= {total_rule} = {total}",
             _at(arg, cu, (cu.shape[0] - 1,)), "Pass the prefix sums of the packed new keys.")
    if not padded and int(cu[-1]) != total:
        fail(fn, arg, "does not end at the number of tokens", f"{arg}[-1] = {total_rule} = "
             f"{total}", _at(arg, cu, (cu.shape[0] - 1,)),
             "Pass the prefix sums of exactly the packed tokens.")


def check_max_seqlen(fn: str, arg: str, max_seqlen: int, cu, cu_arg: str) -> None:
    """``max_seqlen`` bounds every request's length ``cu[r + 1] - cu[r]`` (None: the default,
    the total, which always does)."""
    if max_seqlen is None or not _index_ok(cu, 1) or cu.shape[0] < 2:
        return
    lens = cu[1:] - cu[:-1]
    where = _first(lens > max_seqlen)
    if where is not None:
        r = where[0]
        fail(fn, arg, "is smaller than a request's length", f"{arg} >= {cu_arg}[r + 1] - "
             f"{cu_arg}[r] for every request r", f"{max_seqlen} < {int(lens[r])} (request {r})",
             f"Pass {arg}=int(({cu_arg}[1:] - {cu_arg}[:-1]).max()) or leave it None.")


def check_paged(fn: str, cache_seqlens, page_table, page_size: int, num_pages: int,
                contiguous: bool = False, lens_arg: str = "cache_seqlens",
                table_arg: str = "page_table") -> None:
    """``0 <= cache_seqlens <= capacity`` and every page-table entry that is read is a page id.

    ``contiguous``: the caller built ``page_table`` for a contiguous cache ``[b, seqlen_k, Hkv,
    D]`` (none was given), so the capacity is stated as ``seqlen_k``. ``lens_arg``: the name of
    the lengths argument in the caller's signature, ``table_arg`` that of the table.
    """
    if not (_index_ok(cache_seqlens, 1) and _index_ok(page_table, 2, cache_seqlens.device)
            and page_table.shape[0] == cache_seqlens.shape[0]):
        return
    max_pages = page_table.shape[1]
    capacity = max_pages * page_size
    where = _first((cache_seqlens < 0) | (cache_seqlens > capacity))
    if where is not None:
        if contiguous:
            fail(fn, lens_arg, "is out of range", f"0 <= {lens_arg} <= k_cache.shape[1] "
                 f"(seqlen_k of a contiguous cache without page_table) = {capacity} tokens",
                 _at(lens_arg, cache_seqlens, where),
                 "Keep each request's length within the cache, or pass a paged cache with "
                 "its page_table.")
        fail(fn, lens_arg, "is out of range", f"0 <= {lens_arg} <= {table_arg}.shape[1] "
             f"* page_size = {max_pages} * {page_size} = {capacity} tokens",
             _at(lens_arg, cache_seqlens, where),
             "Give each request enough page-table columns for its tokens.")
    pages_used = (cache_seqlens.long() + page_size - 1) // page_size
    read = torch.arange(max_pages, device=page_table.device)[None, :] < pages_used[:, None]
    where = _first(read & ((page_table < 0) | (page_table >= num_pages)))
    if where is not None:
        fail(fn, table_arg, "has a page id out of range in an entry that is read",
             f"0 <= page id < {num_pages} (num_pages) in the first ceil({lens_arg} / "
             f"page_size) entries of each row", _at(table_arg, page_table, where),
             "Map each request's pages to physical pages of the cache.")


def check_prefix_lens(fn: str, prefix_lens, page_table) -> None:
    """``0 <= prefix_lens <= page_table.shape[1]`` (P)."""
    if not (_index_ok(prefix_lens, 1) and _index_ok(page_table, 2)):
        return
    width = page_table.shape[1]
    where = _first((prefix_lens < 0) | (prefix_lens > width))
    if where is not None:
        fail(fn, "prefix_lens", "is out of range", f"0 <= prefix_lens <= page_table.shape[1] "
             f"(P) = {width} tokens", _at("prefix_lens", prefix_lens, where),
             "Widen page_table to the longest prefix.")


# One entry point per public wrapper (called right before its torch.ops.xpu_ops call).

def check_store_kv_cache(loc, k_cache, k_scale=None, v_scale=None) -> None:
    """Debug-switch value checks of ``store_kv_cache``: ``loc`` distinct slots of the cache,
    fp8 scales positive and finite."""
    if _active(loc, k_cache, k_scale, v_scale) and isinstance(k_cache, Tensor) \
            and k_cache.dim() in (3, 4):
        check_loc("store_kv_cache", loc, k_cache.shape[:-2].numel())
        check_scale("store_kv_cache", "k_scale", k_scale)
        check_scale("store_kv_cache", "v_scale", v_scale)


def check_store_mla_kv_cache(loc, kv_cache) -> None:
    """Debug-switch value check of ``store_mla_kv_cache``: ``loc`` distinct token slots."""
    if _active(loc, kv_cache) and isinstance(kv_cache, Tensor) and kv_cache.dim() in (3, 4):
        slots = kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 4 else 1)
        check_loc("store_mla_kv_cache", loc, slots)


def check_flash_attn_with_kvcache(q, k_cache, cache_seqlens, page_table, cu_seqlens_q,
                                  max_seqlen_q, contiguous: bool = False,
                                  cache_leftpad: Optional[Tensor] = None) -> None:
    """Debug-switch value checks of ``flash_attn_with_kvcache``: ``cache_seqlens``/``page_table`` in
    range, ``cu_seqlens_q`` prefix sums of ``total_q`` tokens, ``max_seqlen_q`` a bound,
    ``0 <= cache_leftpad[r] <= cache_seqlens[r]`` (``contiguous``: no page_table was given, see
    ``check_paged``). ``cache_seqlens`` are the lengths attended (after any append).
    """
    fn = "flash_attn_with_kvcache"
    if not _active(q, k_cache, cache_seqlens, page_table, cu_seqlens_q) or k_cache.dim() != 4:
        return
    check_paged(fn, cache_seqlens, page_table, k_cache.shape[1], k_cache.shape[0], contiguous)
    check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0] (total_q)")
    check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, cu_seqlens_q, "cu_seqlens_q")
    if _index_ok(cache_leftpad, 1, cache_seqlens.device) and _index_ok(cache_seqlens, 1) \
            and cache_leftpad.shape == cache_seqlens.shape:
        where = _first((cache_leftpad < 0) | (cache_leftpad > cache_seqlens))
        if where is not None:
            fail(fn, "cache_leftpad", "is out of range", "0 <= cache_leftpad[r] <= the "
                 "request's keys", _at("cache_leftpad", cache_leftpad, where),
                 "Pad at most the keys each request has.")


def check_cu_seqlens_k_new(fn: str, cu_seqlens_k_new, k) -> None:
    """Debug-switch value check of an append's ``cu_seqlens_k_new``: prefix sums from 0 that
    never decrease and end at most at ``k.shape[0]`` (``total_new``; the rest is padding)."""
    if _active(cu_seqlens_k_new, k) and isinstance(k, Tensor):
        check_cu_seqlens(fn, "cu_seqlens_k_new", cu_seqlens_k_new, k.shape[0],
                         "k.shape[0] (total_new)", padded=True)


def check_rotary_positions(fn: str, positions: Tensor, seqlen_ro: int, arg: str) -> None:
    """Debug-switch value check of the rotary positions an append uses: inside the tables."""
    if not (_active(positions) and _index_ok(positions, 1)):
        return
    where = _first((positions < 0) | (positions >= seqlen_ro))
    if where is not None:
        fail(fn, arg, "reaches past the rotary tables", f"positions in [0, rotary_cos.shape[0] "
             f"= {seqlen_ro})", f"position {int(positions[where])} for token {where[0]}",
             "Pass rotary_cos/rotary_sin with a row for every position (cache_seqlens + s_new).")


def check_flash_attn_varlen_func(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                                 max_seqlen_k, seqused_q: Optional[Tensor] = None) -> None:
    """Debug-switch value checks of ``flash_attn_varlen_func``: both ``cu_seqlens`` valid prefix
    sums, ``max_seqlen_q/k`` bounds, ``0 <= seqused_k[r] <=`` request ``r``'s keys and
    ``0 <= seqused_q[r] <=`` its query rows.
    """
    fn = "flash_attn_varlen_func"
    if not _active(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, seqused_q):
        return
    check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0] (total_q)")
    check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, k.shape[0], "k.shape[0] (total_k)")
    check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, cu_seqlens_q, "cu_seqlens_q")
    check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k, cu_seqlens_k, "cu_seqlens_k")
    for arg, used, cu, what in (("seqused_k", seqused_k, cu_seqlens_k, "keys"),
                                ("seqused_q", seqused_q, cu_seqlens_q, "query rows")):
        if _index_ok(used, 1) and _index_ok(cu, 1, used.device) \
                and cu.shape[0] == used.shape[0] + 1:
            where = _first((used < 0) | (used > cu[1:] - cu[:-1]))
            if where is not None:
                name = arg.replace("seqused", "cu_seqlens")
                fail(fn, arg, "is out of range", f"0 <= {arg}[r] <= {name}[r + 1] - {name}[r]",
                     _at(arg, used, where), f"Use at most the {what} each request has.")


def check_flash_mla_decode(kv_cache, cache_seqlens, page_table) -> None:
    """Debug-switch value check of ``flash_mla_decode``: cache_seqlens/page_table in range."""
    if _active(kv_cache, cache_seqlens, page_table) and kv_cache.dim() == 3:
        check_paged("flash_mla_decode", cache_seqlens, page_table, kv_cache.shape[1],
                    kv_cache.shape[0])


def check_flash_mla_prefill(q_nope, kv_cache, cu_seqlens_q, seq_lens_k, page_table,
                            max_seqlen_q) -> None:
    """Debug-switch value checks of ``flash_mla_prefill``: ``seq_lens_k``/``page_table`` in
    range, ``cu_seqlens_q`` prefix sums of ``total_q`` tokens, ``max_seqlen_q`` a bound."""
    fn = "flash_mla_prefill"
    if not _active(q_nope, kv_cache, cu_seqlens_q, seq_lens_k, page_table) or kv_cache.dim() != 3:
        return
    check_paged(fn, seq_lens_k, page_table, kv_cache.shape[1], kv_cache.shape[0],
                lens_arg="seq_lens_k")
    check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q_nope.shape[0], "q_nope.shape[0] (total_q)")
    check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, cu_seqlens_q, "cu_seqlens_q")


def check_prepare_swa_spec_page_table(page_table, prefix_lens) -> None:
    """Debug-switch value check of ``prepare_swa_spec_page_table``: ``prefix_lens`` within ``P``."""
    if _active(page_table, prefix_lens):
        check_prefix_lens("prepare_swa_spec_page_table", prefix_lens, page_table)


def check_linear_attention(fn: str, cu_arg: str, cu, total: int, slots_arg: str, slots,
                           num_slots: int, max_steps: Optional[int] = None) -> None:
    """Debug-switch value checks of the linear-attention ops: ``cu`` prefix sums of ``total``
    tokens; every state slot -1 (none) or in ``[0, num_slots)``, none repeated; with
    ``max_steps`` (the intermediate-state scratch), no request longer than it."""
    if not (_index_ok(slots, 1) and _active(cu, slots)):
        return
    where = _first((slots < -1) | (slots >= num_slots))
    if where is not None:
        fail(fn, slots_arg, "has a state slot out of range",
             f"-1 (no state) or 0 <= {slots_arg} < {num_slots} (slots of the state pool)",
             _at(slots_arg, slots, where), "Out-of-range slots read zeros and are never written "
             "when XPU_OPS_DEBUG_CHECKS is off.")
    used = slots[slots >= 0]
    if used.unique().numel() != used.numel():
        fail(fn, slots_arg, "has a repeated state slot", "one slot per request (or -1)",
             slots.tolist(), "Give each request its own slot; which final state stays is "
             "unspecified when XPU_OPS_DEBUG_CHECKS is off.")
    if cu is None:
        return
    check_cu_seqlens(fn, cu_arg, cu, total, "the number of tokens")
    if max_steps is not None and cu.shape[0] > 1:
        longest = int((cu[1:] - cu[:-1]).max())
        if longest > max_steps:
            fail(fn, "intermediate_states", "has fewer steps than the longest request",
                 f"intermediate_states.shape[1] >= {longest} tokens", max_steps,
                 "Allocate one step per draft token; later steps are not kept when "
                 "XPU_OPS_DEBUG_CHECKS is off.")


def check_all_true(fn: str, arg: str, flags, rule: str, fix: str) -> None:
    """Debug-switch check that the bool tensor ``flags`` holds no False."""
    if isinstance(flags, Tensor) and flags.dtype == torch.bool and _active(flags):
        if not bool(flags.all()):
            fail(fn, arg, "has a False entry", rule, flags.tolist(), fix)


def check_store_index_k_cache(loc, index_k_cache) -> None:
    """Debug-switch value check of ``store_index_k_cache``: each ``loc`` entry is -1 (skip the
    token, sglang's padding) or a token slot of the cache, and no slot repeats."""
    fn = "store_index_k_cache"
    if not (_index_ok(loc, 1) and isinstance(index_k_cache, Tensor) and index_k_cache.dim() == 4
            and _active(loc, index_k_cache)):
        return
    num_slots = index_k_cache.shape[0] * index_k_cache.shape[1]
    where = _first((loc < -1) | (loc >= num_slots))
    if where is not None:
        fail(fn, "loc", "has a token slot out of range", f"-1 (skip) or 0 <= loc < {num_slots} "
             "(token slots of the cache)", _at("loc", loc, where),
             "Allocate slots from the index-key pool; such entries are skipped (never written) "
             "when XPU_OPS_DEBUG_CHECKS is off.")
    check_loc(fn, loc[loc >= 0], num_slots)


def check_fp8_paged_mqa_logits(q, kv_cache, context_lens, block_table) -> None:
    """Debug-switch value check of ``fp8_paged_mqa_logits``: each request's longest row of
    keys within its block table, and every block id it reads a block of the cache."""
    if not (_active(q, kv_cache, context_lens, block_table) and kv_cache.dim() == 4
            and _index_ok(context_lens, context_lens.dim()) and context_lens.dim() in (1, 2)):
        return
    lens = context_lens.amax(1) if context_lens.dim() == 2 else context_lens
    check_paged("fp8_paged_mqa_logits", lens, block_table, kv_cache.shape[1], kv_cache.shape[0],
                lens_arg="context_lens", table_arg="block_table")


def check_flash_mla_with_kvcache(k_cache, block_table, cache_seqlens) -> None:
    """Debug-switch value check of dense ``flash_mla_with_kvcache``: ``cache_seqlens`` within
    the block table's capacity, page ids in range in the entries that are read."""
    if (block_table is None or cache_seqlens is None or not isinstance(k_cache, Tensor)
            or k_cache.dim() != 4 or not _active(k_cache, block_table, cache_seqlens)):
        return
    check_paged("flash_mla_with_kvcache", cache_seqlens, block_table, k_cache.shape[1],
                k_cache.shape[0], table_arg="block_table")


def check_sinks(fn: str, arg: str, sinks) -> None:
    """Debug-switch value check of per-head sink logits (``sinks``/``attn_sink [Hq]``): no
    NaN (``+inf`` and ``-inf`` are legal: all weight to the sink, no sink)."""
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point() or not _active(sinks):
        return
    where = _first(torch.isnan(sinks.reshape(-1)))
    if where is not None:
        fail(fn, arg, "has a NaN logit", "a float or +-inf per head (-inf: no sink)",
             f"{arg}[{where[0]}] = nan", "A NaN sink's head has unspecified outputs when "
             "XPU_OPS_DEBUG_CHECKS is off.")
