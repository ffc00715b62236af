"""Checks and defaults shared by the attention ops (paged, varlen, MLA).

Each function reads only shapes, dtypes and devices, so it runs in the fakes as well.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

from .._checks import (FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, check_gqa, check_optional,
                       check_shape, check_size, check_tensor, check_window, fail, int_scalar)


def output_dtype(q: torch.Tensor) -> torch.dtype:
    """Attention output dtype: that of ``q``, or bfloat16 for an fp8 query (as FlashAttention-3)."""
    return torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype


def default_softmax_scale(head_dim: int, qv_head_dim: int = 0) -> float:
    """``1/sqrt(D)`` (``1/sqrt(D + Dv)`` when ``qv`` adds its own dot product, as FA3)."""
    return 1.0 / math.sqrt(head_dim + qv_head_dim)


def normalize_window(fn: str, window_size, causal: bool) -> tuple[int, int]:
    """Return ``(left, right)`` with ``causal=True`` forcing ``right = 0`` (API.md)."""
    left, right = check_window(fn, window_size)
    return left, (0 if causal else right)


def check_flag(fn: str, arg: str, value) -> bool:
    """A boolean keyword (``causal``, ``return_softmax_lse``): a bool, or an int 0 or 1.

    Raises:
        TypeError: any other value (a string such as ``"False"`` would otherwise read as True).
    """
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    fail(fn, arg, "is not a bool", "True or False", f"{value!r} ({type(value).__name__})",
         exc=TypeError)


def check_op_scalars(fn: str, softmax_scale: float, window_size_left: int,
                     window_size_right: int) -> None:
    """An attention op's score scalars, as its wrapper leaves them: ``softmax_scale`` finite
    (``finite_scale``), each window side ``>= -1`` (-1: unbounded). Runs in the op and its
    fake, so a direct ``torch.ops`` call is refused as the wrapper's is.

    Raises:
        ValueError: a non-finite scale or a side below -1, naming the argument.
    """
    check_finite_scale(fn, "softmax_scale", softmax_scale)
    for arg, side in (("window_size_left", window_size_left),
                      ("window_size_right", window_size_right)):
        if side < -1:
            fail(fn, arg, "is below -1", "an int >= -1 (-1: unbounded)", side)


def check_finite_scale(fn: str, arg: str, value: float) -> None:
    """A raw op's score multiplier (``softmax_scale``/``sm_scale``) is finite, as its wrapper's
    ``finite_scale`` demands; runs in the op and its fake.

    Raises:
        ValueError: NaN or infinite, naming ``arg``.
    """
    if not -math.inf < value < math.inf:  # a comparison Dynamo traces; False for NaN
        finite_scale(fn, arg, value)


def check_index(fn: str, arg: str, t, ndim: int, device: torch.device) -> torch.Tensor:
    """An int32 index/length tensor (int64 is rejected with the argument's name)."""
    if (isinstance(t, torch.Tensor) and t.dtype in INDEX_DTYPES and t.dim() == ndim
            and t.device == device):
        return t  # valid: skip building the message parts below
    return check_tensor(fn, arg, t, ndim=ndim, dtypes=INDEX_DTYPES, device=device,
                        fix=f"Build it with dtype=torch.int32 (e.g. {arg}.to(torch.int32)).")


def check_query(fn: str, q) -> torch.Tensor:
    """``q [total_q, Hq, D]`` in a float or fp8 dtype, with ``D >= 1``."""
    check_tensor(fn, "q", q, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES)
    check_head_dim(fn, "q", q)
    return q


def check_head_dim(fn: str, arg: str, t: torch.Tensor) -> None:
    """A head dimension (the last one) of 0 has no dot product to scale: reject it by name."""
    if t.shape[-1] == 0:
        fail(fn, arg, "has head dimension 0", "D >= 1 (the last dimension)",
             f"shape {tuple(t.shape)}", "Pass the heads' features in the last dimension.")


def check_kv_dtype(fn: str, arg: str, kv: torch.Tensor, q: torch.Tensor) -> None:
    """K/V are in q's dtype, or fp8 (then dequantised with ``*_descale``)."""
    if kv.dtype in FP8_DTYPES:
        return
    if q.dtype in FP8_DTYPES or kv.dtype != q.dtype:
        fail(fn, arg, f"has dtype {kv.dtype}", f"q's dtype {q.dtype} or an fp8 dtype",
             kv.dtype, "Cast the cache or the query so that they agree.")


def check_attention_extras(fn: str, *, q: torch.Tensor, k_dtype: torch.dtype,
                           v_dtype: torch.dtype, num_heads_kv: int, head_dim_v: int,
                           batch: int, qv, q_descale, k_descale, v_descale, sinks,
                           softcap: float, max_seqlen_q: int) -> None:
    """Checks common to every attention op: GQA, qv, fp8 descales, sinks, softcap.

    Args:
        q: [total_q, Hq, D].
        k_dtype/v_dtype: dtypes of the keys and values (cache or ragged).
        num_heads_kv: Hkv. head_dim_v: Dv. batch: b (number of requests).
    """
    total_q, num_heads_q, _ = q.shape
    device = q.device
    check_gqa(fn, num_heads_q, num_heads_kv)
    if qv is not None:
        check_tensor(fn, "qv", qv, ndim=3, dtypes=(q.dtype,), device=device)
        check_shape(fn, "qv", qv, (total_q, num_heads_q, head_dim_v), "[total_q, Hq, Dv]")
    no_descales = q_descale is None and k_descale is None and v_descale is None
    for arg, t, dtype in () if no_descales else (
            ("q_descale", q_descale, q.dtype), ("k_descale", k_descale, k_dtype),
            ("v_descale", v_descale, v_dtype)):
        if t is None:
            continue
        if dtype not in FP8_DTYPES:
            fail(fn, arg, "is given for a tensor that is not fp8",
                 f"no {arg} when the tensor it scales has dtype {dtype}", "a tensor",
                 f"Drop {arg} or store that tensor in an fp8 dtype.")
        check_descale(fn, arg, t, batch, num_heads_kv, device)
    if sinks is not None:
        check_tensor(fn, "sinks", sinks, ndim=1, dtypes=SINK_DTYPES, device=device,
                     fix="Pass the sink logits in a float dtype (they are read as float32).")
        check_size(fn, "sinks", sinks, 0, num_heads_q, "Hq")
    if not softcap >= 0.0:
        fail(fn, "softcap", "is negative or NaN", "softcap >= 0 (0 disables it, inf is no cap)",
             softcap)
    if max_seqlen_q < 0:
        fail(fn, "max_seqlen_q", "is negative", "max_seqlen_q >= 0", max_seqlen_q)
    # Plain ints only (eager calls): comparing symbolic sizes here would add guards when traced.
    if type(max_seqlen_q) is int and max_seqlen_q == 0 and type(total_q) is int and total_q > 0:
        fail(fn, "max_seqlen_q", f"is 0 while q has {total_q} tokens",
             "max_seqlen_q >= 1 (an upper bound of the new tokens of any request)", 0)


#: dtypes ``sinks`` may have (sgl-kernel's tests pass them in the model's dtype); read as float32.
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_descale(fn: str, arg: str, t: torch.Tensor, batch: int, num_heads_kv: int,
                  device: torch.device) -> None:
    """An fp8 dequantisation scale: float32 ``[1]`` (per tensor), ``[b]`` (per request) or
    ``[b, Hkv]`` (per request and KV head; any strides, expanded included, as FA3)."""
    check_tensor(fn, arg, t, ndim=(1, 2), dtypes=(torch.float32,), device=device)
    shape = tuple(t.shape)
    if shape == (batch, num_heads_kv) or shape == (batch,) or shape == (1,):
        return
    fail(fn, arg, "has the wrong shape",
         f"[1], [b] or [b, Hkv] = (1,), ({batch},) or ({batch}, {num_heads_kv})", shape,
         f"Pass one scale, one per request or one per request and KV head.")


def kernel_extras(sinks, q_descale, k_descale, v_descale, batch: int, num_heads_kv: int):
    """The providers' forms of checked extras: float32 ``sinks [Hq]`` and ``[b, Hkv]`` descales
    (a ``[1]`` or ``[b]`` scale broadcast as an expanded view, no copy). Returns
    ``(sinks, q_descale, k_descale, v_descale)``, or None when they are in that form already."""
    if ((sinks is None or sinks.dtype == torch.float32)
            and all(t is None or t.dim() == 2 for t in (q_descale, k_descale, v_descale))):
        return None
    return (None if sinks is None else sinks.to(torch.float32),
            *(t if t is None or t.dim() == 2 else t.reshape(-1, 1).expand(batch, num_heads_kv)
              for t in (q_descale, k_descale, v_descale)))


def check_out(fn: str, out, shape, dtype: torch.dtype, device: torch.device, rule: str) -> None:
    """A caller-provided ``out`` must have exactly the result's shape, dtype and device."""
    if (isinstance(out, torch.Tensor) and out.dtype == dtype and out.device == device
            and tuple(out.shape) == tuple(shape)):
        return  # valid: skip building the message parts below
    check_tensor(fn, "out", out, dtypes=(dtype,), device=device,
                 fix=f"Allocate it with dtype={dtype}.")
    check_shape(fn, "out", out, shape, rule)


def check_cu_seqlens(fn: str, arg: str, t, batch: int, device: torch.device) -> None:
    """``cu_seqlens [b + 1]`` int32 prefix sums starting at 0."""
    check_index(fn, arg, t, 1, device)
    check_size(fn, arg, t, 0, batch + 1, "b + 1")


def check_num_splits(fn: str, num_splits) -> None:
    """``num_splits`` (0: the provider chooses, 1: one pass over the keys, n > 1: at most n KV
    splits) is a non-negative integer.

    Raises:
        TypeError: not an integer. ValueError: negative.
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        given = num_splits
        try:  # a bool is not a split count (True would read as 1)
            num_splits = None if isinstance(given, bool) else operator.index(given)
        except TypeError:
            num_splits = None
        if num_splits is None:
            fail(fn, "num_splits", "is not an integer", "an int (0: automatic)",
                 f"{given!r} (bool)" if isinstance(given, bool) else type(given).__name__,
                 exc=TypeError)
    if num_splits < 0:
        fail(fn, "num_splits", "is negative", "0 (automatic) or a split count >= 1", num_splits)


def no_cap_if_infinite(softcap: float) -> float:
    """``softcap = inf`` is the limit of ``softcap * tanh(s / softcap)`` as the cap grows: no
    cap, which the providers spell 0 (``inf * tanh(s / inf)`` would be ``inf * 0 = NaN``)."""
    return 0.0 if softcap == math.inf else softcap


def max_seqlen(fn: str, arg: str, value, default: int) -> int:
    """``max_seqlen_q``/``max_seqlen_k`` of a public call: ``default`` when None, else an int
    (a float such as ``3.0`` raises ``TypeError`` naming the argument, never a dispatcher error).
    """
    if value is None:
        return default
    return int_scalar(fn, arg, value, "an int number of tokens (or None)")
def check_speed_hints(fn: str, *, pack_gqa=None, sm_margin=0, scheduler_metadata=None,
                      max_seqlen_k=None, ver=3) -> None:
    """FlashAttention-3's speed-only keywords: accepted, never change results, but typed.

    ``pack_gqa`` None or a bool; ``sm_margin`` an int >= 0 (None allowed); ``scheduler_metadata``
    None or a tensor (a precomputed FA3 schedule, unused here); ``max_seqlen_k`` None or an
    int >= 0 (a bound of keys per request); ``ver`` 3 or 4 (sgl-kernel's choice of its FA3 or
    FA4 kernel: the same math, one implementation here).

    Raises:
        TypeError: a value of the wrong kind. ValueError: a negative count, a ``ver`` not 3 or 4.
    """
    if not (type(ver) is int and ver in (3, 4)) and int_scalar(
            fn, "ver", ver, "3 or 4 (FlashAttention version)") not in (3, 4):
        fail(fn, "ver", "is not a FlashAttention version", "3 or 4", repr(ver),
             "Pass ver=3 or ver=4 (both run the same attention here).")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        fail(fn, "pack_gqa", "is not a bool", "None, True or False", type(pack_gqa).__name__,
             exc=TypeError)
    for arg, value in (("sm_margin", sm_margin), ("max_seqlen_k", max_seqlen_k)):
        if value is None or type(value) is int and value >= 0:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            fail(fn, arg, "is not an integer", "an int >= 0", type(value).__name__,
                 exc=TypeError)
        fail(fn, arg, "is negative", f"{arg} >= 0", value)
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        fail(fn, "scheduler_metadata", "is not a tensor", "None or a torch.Tensor",
             type(scheduler_metadata).__name__, exc=TypeError)


def check_mla_inputs(fn: str, q_nope, rope_arg: str, q_rope, cache_arg: str, kv_cache,
                     rows: str) -> None:
    """Absorbed-MLA queries and latent cache: ``q_nope [rows, H, R]`` float, ``<rope_arg> [rows, H,
    r]`` and ``<cache_arg> [num_pages, page_size, R + r]`` in q_nope's dtype and device.
    ``rows`` names q_nope's first dimension in messages (``b`` or ``total_q``)."""
    check_tensor(fn, "q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES)
    device = q_nope.device
    num_rows, num_heads, latent_dim = q_nope.shape
    check_tensor(fn, rope_arg, q_rope, ndim=3, dtypes=(q_nope.dtype,), device=device)
    check_size(fn, rope_arg, q_rope, 0, num_rows, f"q_nope.shape[0] ({rows})")
    check_size(fn, rope_arg, q_rope, 1, num_heads, "q_nope.shape[1] (H)")
    check_tensor(fn, cache_arg, kv_cache, ndim=3, dtypes=(q_nope.dtype,), device=device)
    check_size(fn, cache_arg, kv_cache, 2, latent_dim + q_rope.shape[2], "R + r")


def check_workspace_size_args(fn: str, **sizes) -> None:
    """Arguments of a ``flash_mla_*_get_workspace_size`` function: integers, the sizes
    non-negative (``num_kv_splits`` may be -1: automatic).

    Raises:
        TypeError: an argument is not an integer. ValueError: a negative size.
    """
    for arg, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            fail(fn, arg, "is not an integer", "an int", repr(value), exc=TypeError)
        if arg != "num_kv_splits" and value < 0:
            fail(fn, arg, "is negative", ">= 0", value)


def float_scalar(fn: str, arg: str, value) -> float:
    """Accept a Python/NumPy real number (not a tensor, not a bool) for a float argument.

    Raises:
        TypeError: a string, a bool or another object that is not a real number.
    """
    if type(value) is float:
        return value
    if isinstance(value, bool):  # True would read as 1.0
        fail(fn, arg, "is not a real number", "a float", f"{value!r} (bool)", exc=TypeError)
    if isinstance(value, (str, bytes)):
        fail(fn, arg, "is not a real number", "a float", f"{value!r} (str)",
             f"Pass float({arg}) yourself if the string holds a number.", exc=TypeError)
    if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)):
        try:
            return float(value)
        except (TypeError, ValueError):
            fail(fn, arg, "is not a real number", "a float", type(value).__name__, exc=TypeError)
    return float(value)


def finite_scale(fn: str, arg: str, value) -> float:
    """``float_scalar`` of a score multiplier (``softmax_scale``/``sm_scale``), which must be
    finite: NaN or an infinity would turn every output into NaN. Any finite value is legal
    (negative and 0 included: ``s = softmax_scale * q.k``).

    Raises:
        TypeError: not a real number. ValueError: NaN or infinite, naming ``arg``.
    """
    value = float_scalar(fn, arg, value)
    if not -math.inf < value < math.inf:  # False for NaN too; a comparison Dynamo traces
        fail(fn, arg, "is not finite", "a finite float (it multiplies every score)", value)
    return value


__all__ = ["output_dtype", "default_softmax_scale", "normalize_window", "check_index",
           "check_query", "check_head_dim", "no_cap_if_infinite", "max_seqlen", "check_kv_dtype",
           "check_attention_extras", "check_out", "check_cu_seqlens", "check_num_splits",
           "check_speed_hints", "check_workspace_size_args", "float_scalar", "finite_scale",
           "check_flag", "check_op_scalars", "check_finite_scale",
           "check_optional"]
