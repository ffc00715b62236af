"""Per-request state of a finished prefill, as token-ordered tensors: what disaggregation sends.

A prefill engine hands a request to a decode engine with its cached state; the two engines
may use different page sizes, so nothing here is page shaped. Each *handler* owns one kind of
per-request state and turns it into a few contiguous tensors (``pack``), sizes the receive
buffers from the prompt length alone (``buffers``: both sides run the same model, so shapes
agree) and writes received tensors into the decode engine's own pools (``unpack``) through
the pools' store paths (``xpu_ops.store_kv_cache`` / ``xpu_ops.store_mla_kv_cache``), so the
decode side's page size, page order and sliding-window mapping are its own:

- ``TokenKVHandler``: MHA K and V, or the MLA latent row, of every cached layer
  (``KVLayout.cache_layer_ids``), one ``[layers, tokens, ...]`` tensor each; with a hybrid
  sliding-window pool the full-attention layers' whole prompt.
- ``WindowKVHandler``: the sliding-window layers' live window only, the last ``W - 1`` prompt
  tokens (what the next query at position ``prompt_len`` sees besides itself).
- ``LinearStateHandler``: the conv window and recurrent state of every linear-attention layer
  (``LinearStatePool`` slot of the request's row).
- ``IndexKeyHandler``: DeepSeek-V3.2's DSA index keys (``DSATokenToKVPool``), each token's fp8
  key bytes and float32 scale, moved as stored (no requantisation).

``state_handlers(engine)`` lists the handlers an engine's pools need; a new per-request state
kind adds a class with the same four methods and a line there.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from xpu_ops.index_k_layout import split_blocks

from compile.backend import kv_layout
from compile.batch import MLATokenToKVPool, SWAKVPool
from compile.batch.dsa_pool import DSATokenToKVPool


class StateHandler(Protocol):
    """One kind of per-request state (see the module docstring)."""

    name: str

    def buffers(self, prompt_len: int) -> list[Tensor]:
        """Empty receive tensors for a request of ``prompt_len`` cached tokens."""

    def pack(self, req) -> list[Tensor]:
        """The request's state as contiguous tensors shaped like ``buffers``."""

    def unpack(self, req, tensors: list[Tensor]) -> None:
        """Write ``tensors`` into the pools for ``req`` (its row and slots already allocated)."""


def _slots(engine, req, start: int, end: int) -> Tensor:
    """int64 full-pool slots of tokens ``start .. end - 1`` of ``req`` (from ``req_to_token``)."""
    return engine.req_to_token_pool.req_to_token[req.row, start:end].long()


class TokenKVHandler:
    """K/V (MHA) or latent rows (MLA) of ``layer_ids`` for every prompt token.

    Args:
        engine: the engine whose pool is read or written. layer_ids: global ids of the layers
            sent (layers with a cache of their own, full-attention ones of a hybrid pool).
    """

    name = "kv"

    def __init__(self, engine, layer_ids):
        self.engine, self.pool, self.layer_ids = engine, engine.token_to_kv_pool, tuple(layer_ids)
        self.mla = isinstance(self.pool, MLATokenToKVPool)

    def _parts(self, layer_id: int) -> tuple[Tensor, ...]:
        if self.mla:
            return (self.pool.get_key_buffer(layer_id),)
        return self.pool.get_kv_buffer(layer_id)

    def buffers(self, prompt_len: int) -> list[Tensor]:
        first = self._parts(self.layer_ids[0])
        return [torch.empty((len(self.layer_ids), prompt_len, *b.shape[1:]), dtype=b.dtype,
                            device=b.device) for b in first]

    def _range(self, req) -> tuple[int, int]:
        return 0, len(req.prompt_ids)

    def pack(self, req) -> list[Tensor]:
        start, end = self._range(req)
        slots = self._translate(_slots(self.engine, req, start, end))
        per_layer = [self._parts(lid) for lid in self.layer_ids]
        return [torch.stack([parts[i][slots] for parts in per_layer])
                for i in range(len(per_layer[0]))]

    def _translate(self, slots: Tensor) -> Tensor:
        return slots

    def unpack(self, req, tensors: list[Tensor]) -> None:
        start, end = self._range(req)
        loc = _slots(self.engine, req, start, end)
        for i, lid in enumerate(self.layer_ids):
            if self.mla:
                self.pool.set_kv_buffer(lid, loc, tensors[0][i])
            else:
                self.pool.set_kv_buffer(lid, loc, tensors[0][i], tensors[1][i])


class WindowKVHandler(TokenKVHandler):
    """K/V of the sliding-window layers of a hybrid ``SWAKVPool`` for the prompt's last
    ``min(W - 1, prompt_len)`` tokens: the keys the first decode query still sees."""

    name = "swa_kv"

    def __init__(self, engine, layer_ids, window: int):
        super().__init__(engine, layer_ids)
        self.window = window

    def _live(self, prompt_len: int) -> int:
        return min(self.window - 1, prompt_len)

    def buffers(self, prompt_len: int) -> list[Tensor]:
        return super().buffers(self._live(prompt_len))

    def _range(self, req) -> tuple[int, int]:
        n = len(req.prompt_ids)
        return n - self._live(n), n

    def _translate(self, slots: Tensor) -> Tensor:
        return self.pool.translate_loc_from_full_to_swa(slots)


class LinearStateHandler:
    """Conv windows ``[L, conv_dim, width - 1]`` and recurrent states ``[L, Hv, K, V]`` of the
    request's ``LinearStatePool`` slot."""

    name = "linear_state"

    def __init__(self, engine):
        self.pool = engine.state_pool

    def buffers(self, prompt_len: int) -> list[Tensor]:
        return [torch.empty_like(self.pool.conv[:, 0]), torch.empty_like(self.pool.ssm[:, 0])]

    def _slot(self, req) -> int:
        return int(self.pool.req_to_slot[req.row])

    def pack(self, req) -> list[Tensor]:
        slot = self._slot(req)
        return [self.pool.conv[:, slot].contiguous(), self.pool.ssm[:, slot].contiguous()]

    def unpack(self, req, tensors: list[Tensor]) -> None:
        slot = self._slot(req)
        self.pool.conv[:, slot] = tensors[0]
        self.pool.ssm[:, slot] = tensors[1]


class IndexKeyHandler:
    """DSA index keys of ``layer_ids`` for every prompt token: fp8 bytes ``uint8 [layers,
    tokens, Di]`` and scales ``float32 [layers, tokens]``, read and written at the request's
    slots through the paged layout's views (``xpu_ops.index_k_layout.split_blocks``: page
    ``s // page_size``, row ``s % page_size``), so the two sides' page sizes are independent
    and the bytes arrive as the prefill stored them."""

    name = "index_k"

    def __init__(self, engine, layer_ids):
        self.engine, self.pool, self.layer_ids = engine, engine.token_to_kv_pool, tuple(layer_ids)

    def _views(self, layer_id: int) -> tuple[Tensor, Tensor]:
        return split_blocks(self.pool.get_index_k_with_scale_buffer(layer_id))

    def buffers(self, prompt_len: int) -> list[Tensor]:
        values, scales = self._views(self.layer_ids[0])
        n = len(self.layer_ids)
        return [torch.empty((n, prompt_len, values.shape[-1]), dtype=values.dtype,
                            device=values.device),
                torch.empty((n, prompt_len), dtype=scales.dtype, device=scales.device)]

    def _where(self, req) -> tuple[Tensor, Tensor]:
        slots = _slots(self.engine, req, 0, len(req.prompt_ids))
        block = self._views(self.layer_ids[0])[1].shape[1]
        return slots // block, slots % block

    def pack(self, req) -> list[Tensor]:
        page, row = self._where(req)
        views = [self._views(lid) for lid in self.layer_ids]
        return [torch.stack([v[page, row] for v, _ in views]),
                torch.stack([s[page, row] for _, s in views])]

    def unpack(self, req, tensors: list[Tensor]) -> None:
        page, row = self._where(req)
        for i, lid in enumerate(self.layer_ids):
            values, scales = self._views(lid)
            values[page, row] = tensors[0][i]
            scales[page, row] = tensors[1][i]


def state_handlers(engine) -> list[StateHandler]:
    """The handlers of ``engine``'s pools, in the order both sides send and receive them."""
    pool = engine.token_to_kv_pool
    layout = kv_layout(engine.model)
    layers = layout.cache_layer_ids
    handlers: list[StateHandler] = []
    if isinstance(pool, SWAKVPool):
        swa = set(layout.swa_layer_ids)
        handlers.append(TokenKVHandler(engine, [i for i in layers if i not in swa]))
        handlers.append(WindowKVHandler(engine, [i for i in layers if i in swa],
                                        layout.sliding_window))
    elif layers:
        handlers.append(TokenKVHandler(engine, layers))
    if isinstance(pool, DSATokenToKVPool) and layers:
        handlers.append(IndexKeyHandler(engine, layers))
    if engine.state_pool is not None:
        handlers.append(LinearStateHandler(engine))
    return [h for h in handlers if not isinstance(h, TokenKVHandler) or h.layer_ids]


__all__ = ["StateHandler", "TokenKVHandler", "WindowKVHandler", "LinearStateHandler",
           "IndexKeyHandler", "state_handlers"]
