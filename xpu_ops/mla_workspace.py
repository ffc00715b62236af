"""The split-KV workspace of ``flash_mla_decode``: the layout its op and its providers share.

The op sizes the caller's workspace (``flash_mla_get_workspace_size``) and a provider carves its
split partials out of it; both derive the split count from shapes only, with these functions,
so the op never allocates inside a captured graph and a provider never needs more than the op
promised. A neutral module: ``xpu_ops/ops/`` and the providers both import it, neither imports
the other.
"""

from __future__ import annotations

MAX_KV_SPLITS = 16
TOKENS_PER_SPLIT = 512        # default split granularity of the keys, in tokens


def mla_num_kv_splits(max_seq_len: int, num_kv_splits: int = -1) -> int:
    """Split-KV count from shapes only: ``num_kv_splits`` if > 0, else one split per
    ``TOKENS_PER_SPLIT`` tokens of ``max_seq_len``, between 1 and ``MAX_KV_SPLITS``."""
    if num_kv_splits > 0:
        return num_kv_splits
    return max(1, min(MAX_KV_SPLITS, -(-max_seq_len // TOKENS_PER_SPLIT)))


def mla_split_bytes(batch: int, num_heads: int, latent_dim: int) -> int:
    """Scratch bytes of one KV split: float32 partial outputs ``[b, H, R]`` and LSEs ``[b, H]``.
    A provider uses ``min(mla_num_kv_splits(...), workspace bytes // mla_split_bytes(...))``
    splits, so the split count depends on shapes only."""
    return batch * num_heads * (latent_dim + 1) * 4


__all__ = ["MAX_KV_SPLITS", "TOKENS_PER_SPLIT", "mla_num_kv_splits", "mla_split_bytes"]
