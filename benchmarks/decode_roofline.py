"""The memory roofline of one decode step: bytes it must move, and the device's copy bandwidth.

A decode step of ``b`` requests reads every weight once and the K/V of every cached token of
every request and layer once; at batch sizes where it is memory-bound (all of decode on a GPU
up to b of a few hundred) its time is at least those bytes over the copy bandwidth measured in
the same process. ``bench_model`` reports each mode's tokens/s as a fraction of
``b / (step_bytes / bandwidth)``.
"""

from __future__ import annotations

import statistics
import time

import torch

from compile.graphs import device as dev


def decode_step_bytes(model, b: int, context: int) -> tuple[int, int]:
    """``(weight_bytes, kv_bytes)`` one DECODE step of ``b`` requests at ``context`` cached tokens
    each must move, for a zoo decoder ``model``.

    weight_bytes: every parameter once, except that an untied input embedding contributes only
        the ``b`` rows it gathers (a tied one is read whole by the LM head).
    kv_bytes: ``num_layers * b * (context + 1) * Hkv * (D + Dv) * elem``: the cached tokens read
        plus the new token's K/V (written, then read).
    Activations (``b * hidden`` per layer) are left out: under 0.1% at these shapes.
    """
    cfg = model.config
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # tied weights once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = model.model.embed_tokens.weight
    if getattr(model, "lm_head", None) is not None:  # untied: the lookup reads b rows
        weight_bytes -= (embed.shape[0] - b) * embed.shape[1] * embed.element_size()
    elem = embed.element_size()
    kv_bytes = (cfg.num_hidden_layers * b * (context + 1) * cfg.num_key_value_heads
                * 2 * cfg.head_dim * elem)
    return weight_bytes, kv_bytes


def copy_bandwidth(device, nbytes: int, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s: ``2 * nbytes`` (read + write) over the median
    time of ``dst.copy_(src)`` on ``nbytes`` buffers, each timed to a device sync."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):  # 3 warm-up copies
        dev.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        dev.synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def roofline_tokens_per_s(model, b: int, context: int, bandwidth: float) -> float:
    """Tokens/s of a step that moves ``decode_step_bytes`` at ``bandwidth`` bytes/s: ``b`` over
    the bytes' time."""
    return b * bandwidth / sum(decode_step_bytes(model, b, context))


__all__ = ["copy_bandwidth", "decode_step_bytes", "roofline_tokens_per_s"]
