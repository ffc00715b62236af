"""Graph hooks of ``XPUAttentionBackend``: metadata written into fixed buffers for captured steps.

A captured graph reads its metadata from the addresses it saw at capture, so every metadata
tensor of a graph-captured batch lives in a buffer allocated once. The graph runner owns those
buffers (``compile/graphs/step_buffers.py``); the backend only sizes and fills them:

1. ``graph_metadata_buffers(max_bs, max_num_tokens)`` allocates them (page tables as wide as
   ``context_len``, local-attention and SWA tables included).
2. ``init_forward_metadata_out_graph(fb, buffers, bound=None)`` (host, before each captured or
   replayed step) builds the batch's metadata once and writes it into the buffers: bound to
   their leading slices when ``bound`` is None (a descriptor's first step), else copied into
   ``bound``'s tensors in place; addresses never change. It returns that metadata and makes it
   ``forward_metadata``, which the captured layers read.

It does not capture anything itself, keep state per batch shape, or own ``out_cache_loc``/
``seq_lens``: the runner's step buffers hold those. Supported: DECODE (plain, and draft steps
with topk 1) and TARGET_VERIFY with topk 1; other modes raise ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import xpu_ops

from compile.backend.local_attention import local_chunks_per_request

_EXTERNAL = ("write.loc", "write.encoder_loc")  # the runner's step buffers hold these


def _set_path(obj: Any, path: str, value: Tensor) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
    setattr(obj, leaf, value)


def metadata_buffers(backend, max_bs: int, max_num_tokens: int) -> dict[str, Tensor]:
    """Fixed buffers for the metadata of ``backend``'s batches up to ``max_bs`` requests and
    ``max_num_tokens`` query tokens, keyed by ``AttentionMetadata.tensors()`` names.

    Page tables are as wide as ``context_len`` (in pages); the SWA table and translated write
    slots exist only for hybrid SWA pools, the local-attention tables only with an
    ``attention_chunk_size``, the MLA workspace only for MLA.
    """
    dev, i32 = backend.device, dict(dtype=torch.int32, device=backend.device)
    max_pages = -(-backend.max_context_len // backend.page_size)
    q_per_req = max(1, backend.speculative_num_draft_tokens, -(-max_num_tokens // max_bs))
    buf = {"main.cu_seqlens_q": torch.zeros(max_bs + 1, **i32),
           "main.cache_seqlens": torch.zeros(max_bs, **i32),
           "main.page_table": torch.zeros(max_bs, max_pages, **i32)}
    if hasattr(backend.token_to_kv_pool, "translate_loc_from_full_to_swa"):
        buf["swa.page_table"] = torch.zeros(max_bs, max_pages, **i32)
        buf["write.swa_loc"] = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
    if backend.attention_chunk_size:
        chunk = int(backend.attention_chunk_size)
        max_v = max_bs * local_chunks_per_request(q_per_req, chunk)
        buf["local.cu_seqlens_q"] = torch.zeros(max_v + 1, **i32)
        buf["local.cache_seqlens"] = torch.zeros(max_v, **i32)
        buf["local.page_table"] = torch.zeros(max_v, chunk // backend.page_size, **i32)
    if backend.use_mla:
        size = xpu_ops.flash_mla_get_workspace_size(backend.max_context_len, max_bs,
                                                    backend.num_heads or 128)
        buf["mla_workspace"] = torch.empty(size, dtype=torch.uint8, device=dev)
    return buf


def bind_metadata(meta, buffers: dict[str, Tensor], external: tuple[str, ...] = _EXTERNAL):
    """Move every tensor of ``meta`` (but the ``external`` ones) into a leading slice of its
    buffer, in place, and return ``meta``.

    Raises:
        NotImplementedError: ``meta`` has a tensor without a buffer (a layer kind that cannot
            be kept in fixed buffers).
    """
    seen: dict[int, Tensor] = {}
    for name, t in list(meta.tensors()):
        if name in external:
            continue
        if id(t) not in seen:
            if name not in buffers:
                raise NotImplementedError(f"XPUAttentionBackend: metadata {name} has no graph "
                                          f"buffer; this layer kind is not graph-capturable.")
            buf = buffers[name]
            bound = buf if name == "mla_workspace" else buf[:t.shape[0]]
            if name != "mla_workspace":
                bound[..., :t.shape[-1] if t.dim() > 1 else None].copy_(t)
            seen[id(t)] = bound
        _set_path(meta, name, seen[id(t)])
    return meta


def refill_metadata(bound, fresh, external: tuple[str, ...] = _EXTERNAL) -> None:
    """Copy ``fresh`` values into ``bound``'s tensors (``bind_metadata``'s result for a batch of
    the same mode and size); columns past the new width keep stale entries, which are never read
    (they lie past ``cache_seqlens``).

    Raises:
        RuntimeError: a fresh tensor does not fit its bound slice.
    """
    fresh_tensors = dict(fresh.tensors())
    for name, b in bound.tensors():
        if name in external or name == "mla_workspace":
            continue
        f = fresh_tensors[name]
        if f.shape[0] != b.shape[0] or (f.dim() > 1 and f.shape[1] > b.shape[1]):
            raise RuntimeError(f"XPUAttentionBackend: refilled metadata {name} has shape "
                               f"{tuple(f.shape)}; expected it to fit {tuple(b.shape)}.")
        if f.dim() > 1:
            b[..., :f.shape[-1]].copy_(f)
        else:
            b.copy_(f)


class GraphMetadataMixin:
    """Graph hooks; mixed into ``XPUAttentionBackend`` (uses its ``build_metadata``)."""

    def graph_metadata_buffers(self, max_bs: int, max_num_tokens: int) -> dict[str, Tensor]:
        """Fixed metadata buffers for batches up to ``max_bs`` requests and ``max_num_tokens``
        query tokens (``metadata_buffers``)."""
        return metadata_buffers(self, max_bs, max_num_tokens)

    def graph_mode_unsupported(self, fb) -> Optional[str]:
        """Why ``fb``'s mode cannot keep its metadata in fixed buffers, or None (DECODE, and
        TARGET_VERIFY / draft decode with topk 1, and IDLE)."""
        mode = fb.forward_mode
        ok = mode.is_decode() or mode.is_target_verify() or mode.is_idle()
        if not ok or (fb.spec_info is not None and self._topk(fb) > 1):
            return (f"graph metadata for mode {mode.name} with topk "
                    f"{self._topk(fb) if fb.spec_info is not None else 0} is not supported; "
                    f"graphs cover DECODE and TARGET_VERIFY/draft decode with topk 1.")
        return None

    def init_forward_metadata_out_graph(self, forward_batch, buffers: dict[str, Tensor],
                                        bound=None):
        """Host side of a captured step: build the metadata once, bind it to ``buffers``
        (``bound`` None) or refill ``bound`` in place; returns it (also ``forward_metadata``).

        Raises:
            NotImplementedError: a mode or layer kind without fixed buffers.
            RuntimeError: more requests than the buffers hold.
        """
        why = self.graph_mode_unsupported(forward_batch)
        if why is not None:
            raise NotImplementedError(f"XPUAttentionBackend: {why}")
        max_bs = buffers["main.cache_seqlens"].shape[0]
        if forward_batch.batch_size > max_bs:
            raise RuntimeError(f"XPUAttentionBackend: batch size {forward_batch.batch_size} "
                               f"exceeds the graph buffers; expected graph_metadata_buffers("
                               f"max_bs >= {forward_batch.batch_size}), got max_bs={max_bs}.")
        fresh = self.build_metadata(forward_batch, graph=True)
        if bound is None:
            bound = bind_metadata(fresh, buffers)
        else:
            refill_metadata(bound, fresh)
        self.forward_metadata = bound
        return bound


__all__ = ["GraphMetadataMixin", "metadata_buffers", "bind_metadata", "refill_metadata"]
