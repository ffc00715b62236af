"""Float64 oracle of the FlashMLA surface (``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd``),
written from FlashMLA's documented semantics and API.md; imports nothing from ``xpu_ops``.

It loops per request and per query row, reads each selected key token by token (fp8 tokens
decoded byte by byte with ``struct``: e4m3fn latent, little-endian float32 tile scales,
bfloat16 rope), so no slot outside the selection is ever touched.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch
from torch import Tensor

F64 = torch.float64
NEG_INF = float("-inf")


def e4m3fn_value(byte: int) -> float:
    """The float8_e4m3fn value of one byte: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal, ``S.1111.111`` is NaN (no infinities)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8.0 * 2.0 ** -6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


_E4M3 = [e4m3fn_value(b) for b in range(256)]


def fp8_token(raw: bytes, head_dim: int, head_dim_v: int) -> list[float]:
    """One FlashMLA fp8 token: ``Dv`` e4m3 bytes, ``Dv / 128`` float32 scales, bf16 rope."""
    tiles = head_dim_v // 128
    scales = struct.unpack(f"<{tiles}f", raw[head_dim_v:head_dim_v + 4 * tiles])
    latent = [_E4M3[raw[k]] * scales[k // 128] for k in range(head_dim_v)]
    at = head_dim_v + 4 * tiles
    rope = [struct.unpack("<f", b"\0\0" + raw[at + 2 * k:at + 2 * k + 2])[0]
            for k in range(head_dim - head_dim_v)]
    return latent + rope


def model1_token(cache: Tensor, page: int, offset: int) -> list[float]:
    """One DeepSeek-V4 token: page ``page`` starts ``cache.stride(0)`` bytes after page 0; its
    token ``offset`` holds 448 e4m3 bytes and 64 bf16 at ``offset * 576``, and 7 UE8M0 scale
    bytes (``2^(e - 127)``, 255 NaN) at ``page_size * 576 + offset * 8``."""
    page_size = cache.shape[1]
    start = cache.storage_offset() + page * cache.stride(0)
    raw = torch.as_strided(cache.view(torch.uint8), (page_size * 584,), (1,), start).tolist()
    data, groups = raw[offset * 576:offset * 576 + 576], raw[page_size * 576 + offset * 8:]
    scales = [math.nan if e == 255 else 2.0 ** (e - 127) for e in groups[:7]]
    latent = [_E4M3[data[k]] * scales[k // 64] for k in range(448)]
    rope = [struct.unpack("<f", b"\0\0" + bytes(data[448 + 2 * k:450 + 2 * k]))[0]
            for k in range(64)]
    return latent + rope


def cache_token(cache: Tensor, page: int, offset: int, head_dim: int, head_dim_v: int,
                is_fp8: bool) -> Tensor:
    """Float64 ``[D]`` key of slot ``offset`` of page ``page`` of a ``[pages, page_size, 1, X]``
    cache (DeepSeek-V4 pages when ``D = Dv = 512`` over 584-byte views)."""
    if is_fp8 and (head_dim, head_dim_v, cache.shape[-1]) == (512, 512, 584):
        return torch.tensor(model1_token(cache, page, offset), dtype=F64)
    row = cache[page, offset, 0]
    if is_fp8:
        raw = bytes(row.view(torch.uint8).tolist())
        return torch.tensor(fp8_token(raw, head_dim, head_dim_v), dtype=F64)
    return row.to(F64)


def attend_keys(q: Tensor, keys: list[Tensor], head_dim_v: int, scale: float,
                sink: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``q [H, D]`` over the listed keys: ``(out [H, Dv], lse [H], max_logit [H])`` float64;
    no keys gives 0, -inf, -inf. The sink joins the output's denominator, not the LSE."""
    num_heads = q.shape[0]
    if not keys:
        empty = torch.full((num_heads,), NEG_INF, dtype=F64)
        return torch.zeros(num_heads, head_dim_v, dtype=F64), empty, empty.clone()
    k = torch.stack(keys)                                          # [n, D]
    scores = scale * (q.to(F64) @ k.T)                             # [H, n]
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[:, None]) @ k[:, :head_dim_v]
    if sink is not None:
        denominator = 1.0 + torch.exp(sink.to(F64) - lse)          # sink +inf: inf, -inf: 1
        out = out / denominator[:, None]
    return out, lse, scores.amax(dim=-1)


def _selected(cache, index_row, length, head_dim, head_dim_v, is_fp8) -> list[Tensor]:
    pages, page_size = cache.shape[:2]
    count = len(index_row) if length is None else max(0, min(int(length), len(index_row)))
    keys = []
    for k in range(count):
        slot = int(index_row[k])
        if 0 <= slot < pages * page_size:
            keys.append(cache_token(cache, slot // page_size, slot % page_size, head_dim,
                                    head_dim_v, is_fp8))
    return keys


def _dense_keys(k_cache, table_row, seqlen, last, head_dim, head_dim_v, is_fp8):
    pages, page_size = k_cache.shape[:2]
    length = max(0, min(int(seqlen), len(table_row) * page_size))
    keys = []
    for j in range(min(length, last + 1)):
        page = int(table_row[j // page_size])
        if 0 <= page < pages:
            keys.append(cache_token(k_cache, page, j % page_size, head_dim, head_dim_v, is_fp8))
    return keys


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                           causal, is_fp8_kvcache, indices=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None) -> tuple[Tensor, Tensor]:
    """``(out [b, s_q, h_q, Dv], lse [b, h_q, s_q])`` float64 (semantics: API.md, FlashMLA)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    out = torch.zeros(batch, seqlen_q, num_heads, head_dim_v, dtype=F64)
    lse = torch.full((batch, num_heads, seqlen_q), NEG_INF, dtype=F64)
    for i in range(batch):
        for s in range(seqlen_q):
            if indices is None:
                seqlen = int(cache_seqlens[i])
                bound = max(0, min(seqlen, block_table.shape[1] * k_cache.shape[1]))
                last = bound - seqlen_q + s if causal else bound - 1
                keys = _dense_keys(k_cache, block_table[i], seqlen, last, head_dim, head_dim_v,
                                   is_fp8_kvcache)
            else:
                length = None if topk_length is None else topk_length[i]
                keys = _selected(k_cache, indices[i, s], length, head_dim, head_dim_v,
                                 is_fp8_kvcache)
                if extra_k_cache is not None:
                    length = None if extra_topk_length is None else extra_topk_length[i]
                    keys += _selected(extra_k_cache, extra_indices_in_kvcache[i, s], length,
                                      head_dim, head_dim_v, is_fp8_kvcache)
            o, l, _ = attend_keys(q[i, s], keys, head_dim_v, softmax_scale, attn_sink)
            out[i, s], lse[i, :, s] = o, l
    return out, lse


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])`` float64."""
    seqlen_q, num_heads, head_dim = q.shape
    out = torch.zeros(seqlen_q, num_heads, d_v, dtype=F64)
    max_logits = torch.full((seqlen_q, num_heads), NEG_INF, dtype=F64)
    lse = max_logits.clone()
    for t in range(seqlen_q):
        length = None if topk_length is None else topk_length[t]
        keys = _selected(kv[None], indices[t, 0], length, head_dim, d_v, False)
        out[t], lse[t], max_logits[t] = attend_keys(q[t], keys, d_v, sm_scale, attn_sink)
    return out, max_logits, lse
