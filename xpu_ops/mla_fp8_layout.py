"""FlashMLA's fp8 latent-cache token layout: the byte map that the op checks and providers share.

With ``is_fp8_kvcache=True`` every token of a ``[num_pages, page_size, 1, token_bytes]`` cache
(dtype ``torch.float8_e4m3fn`` or ``torch.uint8``, read as bytes) holds, in order:

- ``Dv`` bytes: the latent ("NoPE") part, ``float8_e4m3fn`` values;
- ``4 * Dv / 128`` bytes: one float32 scale per tile of 128 latent values (the latent value is
  ``fp8 * scale``);
- ``2 * (D - Dv)`` bytes: the rotary ("RoPE") part, bfloat16, not quantized.

DeepSeek-V3/V3.2 (``D = 576``, ``Dv = 512``) gives FlashMLA's 656-byte token. A neutral module:
``xpu_ops/ops/`` and the providers import it, neither imports the other.
Source: FlashMLA ``flash_mla/flash_mla_interface.py`` (``flash_mla_with_kvcache`` docstring).
"""

from __future__ import annotations

FP8_TILE = 128          # latent values per float32 scale
ROPE_BYTES = 2          # bytes of one rotary value (bfloat16)


def fp8_scale_offset(head_dim_v: int) -> int:
    """Byte offset of a token's first float32 scale (right after the ``Dv`` fp8 bytes)."""
    return head_dim_v


def fp8_rope_offset(head_dim_v: int) -> int:
    """Byte offset of a token's bfloat16 rotary part."""
    return head_dim_v + 4 * (head_dim_v // FP8_TILE)


def fp8_token_bytes(head_dim: int, head_dim_v: int) -> int:
    """Bytes of one token: ``Dv + 4 * Dv / 128 + 2 * (D - Dv)`` (656 for D = 576, Dv = 512).

    >>> fp8_token_bytes(576, 512), fp8_token_bytes(288, 256)
    (656, 328)
    """
    return fp8_rope_offset(head_dim_v) + ROPE_BYTES * (head_dim - head_dim_v)


def quantize_fp8_tokens(tokens, head_dim_v: int):
    """Float tokens ``[..., D]`` (latent then rope) as FlashMLA fp8 token bytes ``[...,
    token_bytes]`` (dtype ``torch.float8_e4m3fn``): each tile of 128 latent values divided by
    its scale ``amax / 448`` (1 for an all-zero tile), the rope part rounded to bfloat16.
    Plain PyTorch, for building caches in tests and tools (not a kernel).

    >>> import torch
    >>> quantize_fp8_tokens(torch.randn(3, 576), 512).shape
    torch.Size([3, 656])
    """
    import torch
    head_dim = tokens.shape[-1]
    latent = tokens[..., :head_dim_v].float().unflatten(-1, (-1, FP8_TILE))
    amax = latent.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))      # [..., Dv / 128]
    nope = (latent / scales[..., None]).flatten(-2).to(torch.float8_e4m3fn).view(torch.uint8)
    rope = tokens[..., head_dim_v:].to(torch.bfloat16).contiguous().view(torch.uint8)
    raw = torch.cat([nope, scales.contiguous().view(torch.uint8), rope], dim=-1)
    assert raw.shape[-1] == fp8_token_bytes(head_dim, head_dim_v)
    return raw.view(torch.float8_e4m3fn)


# DeepSeek-V4 (FlashMLA's MODEL1) pages: per token 448 fp8 latent values and 64 bfloat16 rope
# values (576 bytes, tokens packed at the start of the page), then at the page's end one 8-byte
# group per token of 7 UE8M0 scales (one per 64 latent values; value = fp8 * 2^(e - 127)) and a
# pad byte. The cache view is [num_pages, page_size, 1, 584] float8_e4m3fn whose stride(0) is
# the page's byte size (>= page_size * 584); stride(1) is not the token spacing. D = Dv = 512:
# the values are the whole dequantized token.
MODEL1_HEAD_DIM = 512
MODEL1_NOPE = 448
MODEL1_TILE = 64
MODEL1_TOKEN_DATA = 576     # bytes of a token's latent + rope part
MODEL1_SCALE_BYTES = 8      # bytes of a token's scale group (7 scales + 1 pad)
MODEL1_VIEW_BYTES = MODEL1_TOKEN_DATA + MODEL1_SCALE_BYTES   # the view's last dimension, 584


def is_model1(head_dim: int, head_dim_v: int, last_dim: int) -> bool:
    """True for DeepSeek-V4's page layout: ``D = Dv = 512`` over a ``[..., 584]`` view."""
    return (head_dim, head_dim_v, last_dim) == (MODEL1_HEAD_DIM, MODEL1_HEAD_DIM,
                                                MODEL1_VIEW_BYTES)


__all__ = ["FP8_TILE", "ROPE_BYTES", "fp8_scale_offset", "fp8_rope_offset", "fp8_token_bytes",
           "quantize_fp8_tokens", "MODEL1_HEAD_DIM", "MODEL1_NOPE", "MODEL1_TILE",
           "MODEL1_TOKEN_DATA", "MODEL1_SCALE_BYTES", "MODEL1_VIEW_BYTES", "is_model1"]
