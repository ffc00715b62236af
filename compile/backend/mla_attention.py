"""MLA (multi-head latent attention) paths of ``XPUAttentionBackend``.

The MLA pool stores per token one row ``[R + r]``: the compressed KV (latent, R) and the rope key
(r). With weight absorption the query is ``q_nope [tokens, H, R]`` (in the latent space) and
``q_rope [tokens, H, r]``; scores are ``q_nope.latent + q_rope.rope`` and values the latents:

- plain decode: ``flash_mla_decode`` (split-KV; workspace from the metadata);
- extend, target verify and draft steps over the main call: ``flash_mla_prefill`` (sglang
  0.5.23's absorbed prefill), ragged queries over the paged latent cache;
- what the latent ops cannot take (cascade trees, a sliding window, sinks, softcap, an fp8
  cache, the chunked-local variant): ``flash_attn_with_kvcache`` with ``q = q_rope``
  over the rope part as keys, ``qv = q_nope`` over the latent part as values;
- MHA prefill (``forward_batch.attn_attend_prefix_cache is not None``): the model decompresses
  K/V itself; ``flash_attn_varlen_func`` over one prefix chunk (non-causal) or over the new tokens
  (causal), returning the LSE ``[tokens, H]`` (sglang 0.5.23's layout, ``merge_state_v2``'s)
  that the model merges with ``merge_state_v2``.

Under deterministic inference both MLA ops run with ``num_kv_splits=1``.

MHA prefill reads no cache.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

import xpu_ops


def _split_query(q: Tensor, q_rope: Optional[Tensor], heads: int, rank: int, rope: int):
    if q_rope is not None:
        return q.reshape(-1, heads, rank), q_rope.reshape(-1, heads, rope)
    q_all = q.reshape(-1, heads, rank + rope)
    return q_all[..., :rank], q_all[..., rank:]


def _save(pool, layer, loc: Tensor, k: Tensor, k_rope: Optional[Tensor]) -> None:
    rank, rope = pool.kv_lora_rank, pool.qk_rope_head_dim
    if k_rope is None:
        pool.set_kv_buffer(layer, loc, k.reshape(-1, 1, rank + rope))
    else:
        pool.set_mla_kv_buffer(layer, loc, k.reshape(-1, 1, rank), k_rope.reshape(-1, 1, rope))


def _latent_cache(pool, layer) -> Tensor:
    """[num_slots, 1, R + r] of ``layer``: the pool's look-up by ``kv_cache_layer_id``."""
    return pool.get_key_buffer(layer.kv_cache_layer_id)


def forward_absorbed(backend, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layer, fb,
                     save_kv_cache: bool, meta, q_rope: Optional[Tensor] = None,
                     k_rope: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                     **kwargs) -> Tensor:
    """Absorbed MLA attention of one layer.

    Args:
        q: [tokens, H * (R + r)] (nope then rope) or [tokens, H * R] with ``q_rope``.
        k: [tokens, 1, R] latent (with ``k_rope [tokens, 1, r]``) or [tokens, 1, R + r], or
            None (already cached). v: ignored (the latent is the value).
        layer: PagedAttention with ``head_dim = R + r``, ``v_head_dim = R``, 1 KV head.
    Returns:
        [tokens, H * R].
    """
    pool = backend.token_to_kv_pool
    rank, rope, heads = pool.kv_lora_rank, pool.qk_rope_head_dim, layer.tp_q_head_num
    if k is not None and save_kv_cache:
        _save(pool, layer, meta.write.loc, k, k_rope)
    q_nope, q_rope = _split_query(q, q_rope, heads, rank, rope)
    out = backend.output_buffer(fb, q_nope, heads, rank)
    kv = _latent_cache(pool, layer)                                        # [slots, 1, R + r]
    call, causal, cascade = backend.select_call(meta, layer)
    # The latent ops take no window, sinks, softcap or fp8 descales.
    latent_op = (meta.mla_workspace is not None and not cascade and call is meta.main
                 and layer.sliding_window_size < 0 and sinks is None and not layer.logit_cap
                 and kv.dtype == q_nope.dtype)
    if latent_op and fb.forward_mode.is_decode() and fb.spec_info is None:
        out.copy_(xpu_ops.flash_mla_decode(
            q_nope.contiguous(), q_rope.contiguous(), kv.view(-1, call.page_size, rank + rope),
            call.cache_seqlens, call.page_table, meta.mla_workspace, layer.scaling,
            num_kv_splits=backend.num_kv_splits))
    elif latent_op:
        out.copy_(xpu_ops.flash_mla_prefill(
            q_nope, q_rope, kv.view(-1, call.page_size, rank + rope), call.cu_seqlens_q,
            call.cache_seqlens, call.max_seqlen_q, call.page_table, meta.mla_workspace,
            layer.scaling, causal=causal, num_kv_splits=backend.num_kv_splits))
    else:
        paged = kv.view(-1, call.page_size, 1, rank + rope)
        backend.attend(q_rope, paged[..., rank:], paged[..., :rank], call, layer, out,
                       causal=causal, sinks=sinks, qv=q_nope,
                       expand=meta.expand if cascade else None)
    return out.view(-1, heads * rank)


def mha_prefill(backend, q: Tensor, k: Tensor, v: Tensor, layer, fb):
    """MHA prefill of an MLA model over ragged, already decompressed K/V (sglang's chunked
    prefix cache path; nothing is written to the cache here).

    Args:
        q: [tokens, H * D] or [tokens, H, D]. k: [n, H, D], v: [n, H, Dv]: a prefix chunk's
            tokens (``attn_attend_prefix_cache``, cu from ``prefix_chunk_cu_seq_lens``) or the
            new tokens themselves (causal).
    Returns:
        ``(out [tokens, H, Dv], lse [tokens, H] float32)`` for a prefix chunk or with
        ``mha_return_lse``; else ``out`` as ``[tokens, H * Dv]``.
    """
    main = backend._metadata().main
    heads, dv = layer.tp_q_head_num, layer.v_head_dim
    q3 = q.reshape(-1, heads, layer.head_dim)
    if fb.attn_attend_prefix_cache:
        idx = fb.prefix_chunk_idx
        cu_k, max_k = fb.prefix_chunk_cu_seq_lens[idx], fb.prefix_chunk_max_seq_lens[idx]
        causal, want_lse = False, True
    else:
        cu_k, max_k, causal = main.cu_seqlens_q, main.max_seqlen_q, True
        want_lse = bool(fb.mha_return_lse)
    res = xpu_ops.flash_attn_varlen_func(
        q3, k, v, main.cu_seqlens_q, cu_k, max_seqlen_q=main.max_seqlen_q, max_seqlen_k=max_k,
        softmax_scale=layer.scaling, causal=causal, softcap=layer.logit_cap,
        return_softmax_lse=want_lse)
    if not want_lse:
        return res.view(-1, heads * dv)
    out, lse = res
    return out, lse.transpose(0, 1).contiguous()


__all__ = ["forward_absorbed", "mha_prefill"]
