"""Launcher of the paged-attention kernels (``paged_attention_kernel.py``) and its provider ops.

``paged_attention`` turns a call's shapes, strides and scalars into the kernel's grid, tile config
(``_Config``: tiles plus the kernel paths of ``_common.OPTIONAL_PATHS``, each applied where the
launch allows it, ``_kernel_paths``), split plan (``plan_splits``), kernel and scalar arguments,
once per call shape (``_launch_params``, cached), and launches; ``flash_attn_with_kvcache`` is the
``triton`` provider's op. The plain form of a call (``_plain_launch``: a paged cache, none of
the rare features) takes ``_paged_attention_plain_kernel``, which binds 45 arguments where
``_paged_attention_kernel`` binds 94 (Triton's binder costs host time per argument on every
launch); both run the same program. Grid, tiles, splits, scratch and counter sizes depend only on
shapes and the device's multiprocessor count, never on tensor values, so a launch can be
captured in a graph.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Optional

import torch
from torch import Tensor

from .. import provider_table
from . import split_plan
from ._common import (available, cdiv, descriptors_supported, launch, launch_paths, next_pow2,
                      num_sms, set_descriptor_allocator, smem_per_sm, warp_specialize_supported)
from .paged_attention_kernel import _paged_attention_kernel, _paged_attention_plain_kernel


@dataclasses.dataclass(frozen=True)
class _Config:
    """Tile shape and kernel paths of one launch (``_common.OPTIONAL_PATHS``; each applies
    where the launch allows it, else the launch runs without it).

    ``page_tiles``: key tiles addressed per page (power-of-two page sizes, at most two pages
    per tile). ``phases``: the
    three-phase key loop (``attention_tiles``). ``tma``: tensor descriptors for Q, O and the
    interior K/V tiles (CUDA capability >= 9.0 with descriptor support, 16-byte aligned rows,
    a power-of-two GQA group; paged: BLOCK_N capped at two pages, one descriptor box per page,
    3 stages or more);
    implies both others.
    ``ws``: the interior loop warp-specialised (``tl.range(warp_specialize=True)``) on top of
    ``tma``. ``dv_split``: programs per row tile, each accumulating ``Dv_pad / dv_split`` output
    columns (FlashMLA's split of the 512 latent columns, here across programs, which all compute
    the scores); only with ``qv`` (absorbed MLA), the one-loop schedule and
    ``BLOCK_M >= 16 * dv_split``. ``fold_scale``: the softmax scale applied inside the exp2
    argument (plain scores: no qv, no softcap).
    """
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    page_tiles: bool = False
    phases: bool = False
    tma: bool = False
    ws: bool = False
    dv_split: int = 1
    fold_scale: bool = False


# page_tiles shrinks a decode tile to one page from pages of this many keys up (H200: with
# 16-key pages, 64-key tiles of per-key addresses were up to 10 % faster than one-page tiles).
PAGE_TILE_MIN_KEYS = 32
# page_tiles applies to tiles of at most this many pages (else per-key page-table loads)
PAGE_TILE_MAX_PAGES = 2
# (BLOCK_N, num_warps, num_stages) of a decode launch whose grid is small enough to be split
# (fewer than DECODE_PROGRAMS_PER_SM programs per multiprocessor), with head dims <= 64, 16-bit
# q/K/V and pages of under PAGE_TILE_MIN_KEYS keys: such a launch is bound by each program's
# chain of key tiles, so fewer, wider tiles win (benchmarks/bench_decode_graph.py; figures in
# benchmarks/RESULTS.md, H200).
SMALL_GRID_DECODE_TILES = (128, 4, 3)


def _pick_config(device: torch.device, rows_per_request: int, d_pad: int, dv_pad: int,
                 elem_bytes: int, paths: Optional[frozenset] = None,
                 page_size: Optional[int] = None,
                 kv_programs: Optional[int] = None) -> _Config:
    """Tile shape from shapes only (``rows_per_request = max_seqlen_q * G`` packed M rows), with
    the optional ``paths`` (``_common.OPTIONAL_PATHS``; None: ``launch_paths`` of the launch's
    kind) on. ``kv_programs``: requests x KV heads of the launch (None: unknown).

    With ``page_tiles``, a decode tile holds one whole page where pages have
    ``PAGE_TILE_MIN_KEYS`` or more keys (BLOCK_N = page_size when smaller than the default), so
    its K/V addresses come from one page id and the compiler can stage the loads through shared
    memory; the pipeline deepens to keep as many bytes in flight (at most 8 stages). A decode
    grid small enough to be split takes ``SMALL_GRID_DECODE_TILES`` where they apply."""
    decode = rows_per_request <= 64
    if paths is None:  # the defaults: descriptors only where the device has them (else portable)
        paths = launch_paths(decode)
        if paths & {"tma", "tma_ws"} and not descriptors_supported(device.type, device.index):
            paths = paths - {"tma", "tma_ws"}
    tiles = _pick_tiles(device, rows_per_request, d_pad, dv_pad, elem_bytes)
    if (decode and kv_programs is not None and device.type != "cpu" and elem_bytes == 2
            and max(d_pad, dv_pad) <= 64 and page_size is not None
            and page_size < PAGE_TILE_MIN_KEYS
            and kv_programs * cdiv(rows_per_request, tiles.block_m)
            < DECODE_PROGRAMS_PER_SM * num_sms(device)):
        block_n, warps, stages = SMALL_GRID_DECODE_TILES
        tiles = dataclasses.replace(tiles, block_n=block_n, num_warps=warps, num_stages=stages)
    if ("page_tiles" in paths and decode and page_size is not None
            and PAGE_TILE_MIN_KEYS <= page_size < tiles.block_n
            and page_size == next_pow2(page_size)):
        stages = min(8, tiles.num_stages * tiles.block_n // page_size)
        tiles = dataclasses.replace(tiles, block_n=page_size, num_stages=stages)
    return with_paths(tiles, paths)


def with_paths(config: _Config, paths: frozenset) -> _Config:
    """``config`` with exactly the optional kernel ``paths`` on (and the ones they imply)."""
    ws = "tma_ws" in paths
    tma = ws or "tma" in paths
    return dataclasses.replace(config, page_tiles=tma or "page_tiles" in paths,
                               phases=tma or "phases" in paths, tma=tma, ws=ws,
                               dv_split=2 if "mla_split" in paths else 1,
                               fold_scale="fold_scale" in paths)


def default_config(q: Tensor, v: Tensor, max_seqlen_q: int, num_heads_kv: int,
                   paths: Optional[frozenset] = None,
                   page_size: Optional[int] = None) -> _Config:
    """The config a launch on these tensors picks, with ``paths`` on (None: the defaults;
    benchmarks A/B paths with ``paged_attention(..., config=default_config(..., paths))``).
    ``page_size``: of a paged cache (None: ragged K/V). The request count is taken as
    ``total_q // max_seqlen_q`` (exact for decode, where it can change the tiles)."""
    group = q.shape[1] // num_heads_kv
    d_pad, dv_pad = max(16, next_pow2(q.shape[-1])), max(16, next_pow2(v.shape[-1]))
    requests = q.shape[0] // max(max_seqlen_q, 1)
    return _pick_config(q.device, max_seqlen_q * group, d_pad, dv_pad, q.element_size(), paths,
                        page_size, kv_programs=requests * num_heads_kv)


def _pick_tiles(device: torch.device, rows_per_request: int, d_pad: int, dv_pad: int,
                elem_bytes: int) -> _Config:
    """Tile shape from shapes only. ``rows_per_request = max_seqlen_q * G`` packed M rows."""
    if device.type == "cpu":  # interpreter: small tiles exercise the multi-tile paths
        return _Config(max(16, min(32, next_pow2(rows_per_request))), 16, 1, 1)
    wide = max(d_pad, dv_pad)
    if rows_per_request <= 64:  # decode / short verify: M = packed heads
        block_m = max(16, next_pow2(rows_per_request))
        if wide >= 512:
            return _Config(min(block_m, 64), 64, 8, 2)
        if wide >= 256:
            return _Config(block_m, 32, 4, 3)
        if elem_bytes > 2:
            return _Config(block_m, 64, 4, 2)
        return _Config(block_m, 64, 2 if block_m <= 16 else 4, 4)
    if wide >= 512:
        return _Config(64, 64, 8, 2)   # MLA: H200 sweep best (0.39 ms vs 0.49 with BLOCK_N 32)
    if wide >= 256 or elem_bytes > 2:
        return _Config(64, 32, 4, 2)
    return _Config(128, 128, 8, 2)     # H200 sweep: 3.59 ms vs 4.21 for (128, 64, 8, 3)


# Decode (split_plan.decode_splits): DECODE_PROGRAMS_PER_SM decode programs resident per
# multiprocessor (the D = 128 bf16 tile, 16 x 64 keys, 2 warps, 4 stages, compiled for sm_90:
# 102 KiB of shared memory, so 2 fit in an H100/H200 multiprocessor's 228 KiB); splits of at least
# DECODE_SPLIT_KEYS keys while the unsplit grid leaves slots empty, else of DECODE_CHUNK_KEYS
# (H200 sweep, 132 SMs, b = 1..64 x 1k..16k keys: >= 256 keys per split were within ~10 % of the
# best split count of every row; b = 64 x 4096 was fastest unsplit), at least
# cdiv(keys, DECODE_CHUNK_KEYS) of them (at most DECODE_MAX_CHUNKS): mixed lengths balance.
DECODE_PROGRAMS_PER_SM = 2
# At most this many decode programs counted resident per multiprocessor (smaller tiles, D <= 64
# or fp8 K/V, fit more; split planning counts no more than this).
DECODE_MAX_RESIDENT = 4
DECODE_SPLIT_KEYS = 256
DECODE_CHUNK_KEYS = 4096
DECODE_MAX_CHUNKS = 8
# Prefill and extend: splits only while the grid holds fewer than this many programs per SM.
PREFILL_PROGRAMS_PER_SM = 4
MAX_SPLITS = 64


def plan_splits(device: torch.device, programs: int, max_kv_len: int, block_n: int,
                decode: bool, resident: Optional[int] = None) -> tuple[int, int]:
    """``(num_splits, min_split_tiles)`` of a launch, from shapes only (never tensor values).

    The kernel gives each split of a program an even share of the program's visible key tiles,
    but at least ``min_split_tiles`` of them (``max(min_split_tiles, cdiv(tiles, num_splits))``
    for each request's own length), so a short request uses only its first splits and a graph
    captured at a wide page table still splits the lengths it replays with. ``programs``: the
    grid without splits; ``max_kv_len``: the page table's capacity in tokens; ``resident``:
    decode programs a multiprocessor holds at once (None: ``DECODE_PROGRAMS_PER_SM``).

    - Decode-like launches (at most two row tiles per request): ``split_plan.decode_splits``
      on ``resident`` programs per multiprocessor (whole waves, splits
      of at least ``DECODE_SPLIT_KEYS`` keys while the grid leaves slots empty, else of
      ``DECODE_CHUNK_KEYS``, at least one per ``DECODE_CHUNK_KEYS`` keys up to
      ``DECODE_MAX_CHUNKS``); ``split_plan.SCHEDULE = "legacy"`` takes the former rule.
    - Prefill and extend: splits only to fill the device, each of >= 4 tiles.

    >>> plan_splits(torch.device("cpu"), programs=1, max_kv_len=4096, block_n=16, decode=True)
    (8, 16)
    """
    tiles = cdiv(max(max_kv_len, 1), block_n)
    if not decode:
        fill = round(PREFILL_PROGRAMS_PER_SM * num_sms(device) / max(programs, 1))
        return max(1, min(fill, cdiv(tiles, 4), MAX_SPLITS)), 4
    keys = dict(split_keys=DECODE_SPLIT_KEYS, chunk_keys=DECODE_CHUNK_KEYS,
                max_chunks=DECODE_MAX_CHUNKS, max_splits=MAX_SPLITS)
    if split_plan.SCHEDULE == "legacy":
        return split_plan.legacy_decode_splits(programs, num_sms(device), DECODE_PROGRAMS_PER_SM,
                                               max_kv_len, block_n, **keys)
    slots = (resident or DECODE_PROGRAMS_PER_SM) * num_sms(device)
    return split_plan.decode_splits(programs, slots, max_kv_len, block_n, **keys)


def decode_program_smem(cfg: _Config, d_pad: int, dv_pad: int, elem: int, kv_elem: int) -> int:
    """Shared memory of one decode program, estimated from its tiles: ``num_stages - 1``
    pipelined K and V tiles of ``BLOCK_N`` keys plus the q tile (compiled for sm_90: 102 KiB
    for 16 x 64 keys, D 128, 4 stages, estimated 100; 70 KiB for 16 x 128 keys, D 64, 3 stages,
    estimated 66).

    >>> decode_program_smem(_Config(16, 64, 2, 4), 128, 128, 2, 2) // 1024
    100
    """
    stages = max(cfg.num_stages - 1, 1)
    return stages * cfg.block_n * (d_pad + dv_pad) * kv_elem + cfg.block_m * d_pad * elem


def decode_resident(device: torch.device, cfg: _Config, d_pad: int, dv_pad: int, elem: int,
                    kv_elem: int) -> int:
    """Decode programs of ``cfg`` one multiprocessor of ``device`` holds at once (shared memory
    bound, ``split_plan.resident_programs``; ``DECODE_PROGRAMS_PER_SM`` where unknown): the
    ``resident`` of ``plan_splits``."""
    return split_plan.resident_programs(decode_program_smem(cfg, d_pad, dv_pad, elem, kv_elem),
                                        smem_per_sm(device), DECODE_PROGRAMS_PER_SM,
                                        DECODE_MAX_RESIDENT)


@dataclasses.dataclass(frozen=True)
class _LaunchParams:
    """What one ``paged_attention`` call shape launches: everything but the tensors."""
    grid: tuple[int, int, int]
    scalars: tuple  # the kernel's arguments after its tensors (strides, sizes, scalars)
    meta: dict      # constexprs and launch options
    num_splits: int
    dv_pad: int
    num_tiles: int  # (m-block, request x KV head) tiles: split-KV counters needed
    plain: bool     # _paged_attention_plain_kernel (else _paged_attention_kernel)


@functools.lru_cache(maxsize=512)
def _launch_params(device: torch.device, q_shape, q_strides, q_dtype, k_shape, k_strides,
                   v_shape, v_strides, out_strides, qv_strides, pt_strides, paged: bool,
                   batch: int, max_seqlen_q: int, max_kv_len: int, flags: tuple,
                   softmax_scale: float, softcap: float, window_left: int, window_right: int,
                   num_splits: Optional[int], config: Optional[_Config], part_strides,
                   lse_stride: int, meta_strides: tuple, layout: tuple) -> _LaunchParams:
    """Grid, tile config, split count, kernel and every scalar argument of one call shape
    (cached: a decode step repeats the same shape in every layer, so this runs once per shape).
    ``meta_strides``: ``_metadata_strides`` of the small tensors (their layouts are honoured).
    ``layout``: ``(q, K/V, out)`` element sizes and whether q, K, V, out start 16-byte aligned.

    The plain form (``_plain_launch``) takes the kernel with 15 runtime arguments (10 tensors)
    and 29 constexprs; every other call the full one (67 and 26)."""
    total_q, num_heads_q, head_dim = q_shape
    num_heads_kv = k_shape[2] if paged else k_shape[1]
    group = num_heads_q // num_heads_kv
    d_pad, dv_pad = max(16, next_pow2(head_dim)), max(16, next_pow2(v_shape[-1]))
    elem = torch.empty((), dtype=q_dtype).element_size()
    page_size = k_shape[1] if paged else 1
    cfg = config or _pick_config(device, max_seqlen_q * group, d_pad, dv_pad, elem,
                                 page_size=page_size if paged else None,
                                 kv_programs=batch * num_heads_kv)
    cfg, paths = _kernel_paths(cfg, device, paged, page_size, group, (head_dim, v_shape[-1]),
                               (d_pad, dv_pad), layout, (q_strides, k_strides, v_strides,
                                                         out_strides), flags[0])
    m_blocks = cdiv(max(max_seqlen_q, 1) * group, cfg.block_m)
    grid_m = m_blocks * paths["DV_SPLIT"]
    if num_splits is None:
        resident = decode_resident(device, cfg, d_pad, dv_pad, elem, layout[1])
        num_splits, min_split_tiles = plan_splits(device, grid_m * batch * num_heads_kv,
                                                  max_kv_len, cfg.block_n, decode=m_blocks <= 2,
                                                  resident=resident)
    else:  # forced: every request's keys shared evenly by all splits
        min_split_tiles = 1
    upcast = device.type == "cpu" and q_dtype != torch.float32
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D_PAD=d_pad, DV_PAD=dv_pad,
                PAGE_SIZE=page_size, USE_SOFTCAP=softcap > 0, NUM_SPLITS=num_splits,
                PRECISION="ieee" if q_dtype == torch.float32 or upcast else None, UPCAST=upcast,
                PAGE_TILES=paths["PAGE_TILES"], EVEN_D=paths["EVEN_D"], PHASES=paths["PHASES"],
                FOLD_SCALE=paths["FOLD_SCALE"])
    head = (q_strides[0], q_strides[1])
    scalars = (float(softmax_scale), float(softcap), int(window_left), int(window_right))
    plain = _plain_launch(paged, flags, paths, k_strides, v_strides, meta_strides,
                          part_strides, lse_stride == total_q,
                          num_splits * total_q * num_heads_q * (dv_pad + 1))
    if plain:  # what is fixed for a layer is a constexpr: only 5 scalars are bound per launch
        scalars = (pt_strides[0], total_q, k_shape[0], max_seqlen_q, max_kv_len)
        meta.update(STRIDE_QT=head[0], STRIDE_QH=head[1], STRIDE_KP=k_strides[0],
                    STRIDE_KS=k_strides[1], STRIDE_KH=k_strides[2], STRIDE_OT=out_strides[0],
                    STRIDE_OH=out_strides[1], SOFTMAX_SCALE=float(softmax_scale),
                    SOFTCAP=float(softcap), WINDOW_LEFT=int(window_left),
                    WINDOW_RIGHT=int(window_right), MIN_SPLIT_TILES=min_split_tiles,
                    GROUP_SIZE=group, NUM_HEADS_KV=num_heads_kv, HEAD_DIM=head_dim,
                    HEAD_DIM_V=v_shape[-1])
    else:
        scalars = _full_scalars(q_strides, k_strides, v_strides, out_strides, qv_strides,
                                pt_strides, paged, flags[0], part_strides, lse_stride,
                                meta_strides, scalars, (num_splits, total_q, num_heads_q, dv_pad),
                                (group, num_heads_kv, head_dim, v_shape[-1], min_split_tiles,
                                 total_q, k_shape[0], k_shape[0], max_seqlen_q, max_kv_len))
        meta.update(PAGED=paged, **dict(zip(_FLAG_NAMES, flags)), TMA=paths["TMA"],
                    WS=paths["WS"], GROUP=paths["GROUP"], DV_SPLIT=paths["DV_SPLIT"])
    meta.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _LaunchParams((grid_m, batch * num_heads_kv, num_splits), scalars, meta, num_splits,
                         dv_pad, grid_m * batch * num_heads_kv, plain)


split_plan._ON_CHANGE.append(_launch_params.cache_clear)
_FLAG_NAMES = ("HAS_QV", "HAS_Q_DESCALE", "HAS_K_DESCALE", "HAS_V_DESCALE", "HAS_SINKS",
               "HAS_K_START", "HAS_BLOCK_IDS", "HAS_Q_USED")
# _metadata_strides of the plain form: unit-stride cache_seqlens, cu_seqlens_q and page-table
# rows, no ragged K/V, sinks, descales, leftpad, blocks or seqused_q.
_PLAIN_METADATA_STRIDES = (1, 1, 0, 1) + (0,) * 10


def _plain_launch(paged: bool, flags: tuple, paths: dict, k_strides, v_strides, meta_strides,
                  part_strides, lse_contiguous: bool, scratch_elems: int) -> bool:
    """Whether a call takes ``_paged_attention_plain_kernel``: a paged cache whose K and V
    share strides, none of the rare features (``flags``) or kernel paths it leaves out (TMA,
    warp specialisation, split latent columns), unit-stride metadata, the launcher's own
    scratch (int32-addressable) and a contiguous LSE."""
    return (paged and not any(flags) and not paths["TMA"] and paths["DV_SPLIT"] == 1
            and k_strides[:3] == v_strides[:3] and meta_strides == _PLAIN_METADATA_STRIDES
            and part_strides is None and lse_contiguous and scratch_elems < 2 ** 31)


def _full_scalars(q_strides, k_strides, v_strides, out_strides, qv_strides, pt_strides,
                  paged: bool, has_qv: bool, part_strides, lse_stride: int, meta_strides: tuple,
                  scalars: tuple, scratch_shape: tuple, sizes: tuple) -> tuple:
    """The scalar arguments of ``_paged_attention_kernel`` after its 20 tensors: strides (of
    the caller's scratch, or of fresh contiguous ``scratch_shape = (splits, total_q, Hq,
    Dv_pad)`` partials), ``scalars`` (scale, softcap, window) and ``sizes``."""
    if paged:
        kv = (*k_strides[:3], *v_strides[:3])
        pt_stride = pt_strides[0]
    else:
        kv = (0, k_strides[0], k_strides[1], 0, v_strides[0], v_strides[1])
        pt_stride = 0
    splits, total_q, num_heads_q, dv_pad = scratch_shape
    if splits > 1:
        if part_strides is None:  # fresh contiguous scratch
            part_strides = ((total_q * num_heads_q * dv_pad, num_heads_q * dv_pad, dv_pad),
                            (total_q * num_heads_q, num_heads_q))
        part = (*part_strides[0][:3], *part_strides[1][:2])
    else:
        part = (0,) * 5
    qv_s = qv_strides if has_qv else q_strides
    return (q_strides[0], q_strides[1], *kv, qv_s[0], qv_s[1], out_strides[0], out_strides[1],
            lse_stride, pt_stride, *part, *meta_strides, *scalars, *sizes)


def _kernel_paths(cfg: _Config, device: torch.device, paged: bool, page_size: int, group: int,
                  dims: tuple, pads: tuple, layout: tuple, strides: tuple,
                  has_qv: bool) -> tuple[_Config, dict]:
    """The kernel-path constexprs the launch can honour, and the config (BLOCK_N capped at two
    pages for paged descriptors, at 32 keys for split latent columns). ``strides``: q, K,
    V, out strides.

    Absorbed MLA's Dv >= 512 keeps the one-loop, per-key schedule: compiled for sm_90,
    ``page_tiles`` and ``phases`` spill registers there (``benchmarks/compile_kernels.py``)."""
    wide = pads[1] >= 512
    if wide:
        cfg = dataclasses.replace(cfg, page_tiles=False, phases=False, tma=False, ws=False)
    dv_split = cfg.dv_split
    if not (has_qv and not cfg.phases and cfg.block_m >= 16 * dv_split
            and pads[1] % dv_split == 0 and pads[1] // dv_split >= 16):
        dv_split = 1
    if dv_split > 1 and wide and cfg.block_n > 32:  # the chunk's V tiles need shared memory
        cfg = dataclasses.replace(cfg, block_n=32)
    elem, kv_elem, out_elem, aligned = layout
    pow2_pages = page_size == next_pow2(page_size)
    even_d = tuple(dims) == tuple(pads)
    tma = (cfg.tma and aligned and descriptors_supported(device.type, device.index)
           and group == next_pow2(group) and cfg.block_m % group == 0
           and (not paged or (pow2_pages and page_size >= 16))
           and _rows_aligned(strides, (elem, kv_elem, kv_elem, out_elem), paged))
    if tma and paged:  # one box per page, two pages per tile at most; one stage deeper
        cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, 2 * page_size),
                                  num_stages=max(cfg.num_stages, 3))
    # at most PAGE_TILE_MAX_PAGES pages per tile: with more (page sizes 1-8 under 64-key tiles)
    # the per-page offsets, reshaped to keys, spill (Triton 3.6, sm_90: 640 bytes at page 1)
    few_pages = cfg.block_n <= PAGE_TILE_MAX_PAGES * page_size
    return cfg, dict(PAGE_TILES=cfg.page_tiles and paged and pow2_pages and few_pages,
                     EVEN_D=cfg.page_tiles and even_d, PHASES=cfg.phases, TMA=tma,
                     WS=tma and cfg.ws and warp_specialize_supported(),
                     GROUP=group if tma else 1, DV_SPLIT=dv_split, FOLD_SCALE=cfg.fold_scale)


def _rows_aligned(strides: tuple, elems: tuple, paged: bool) -> bool:
    """Every non-unit stride of q, K, V and out is a multiple of 16 bytes (descriptor rows)."""
    dims = (2, 3 if paged else 2, 3 if paged else 2, 2)
    return all(st * e % 16 == 0 for t, e, n in zip(strides, elems, dims) for st in t[:n])


def paged_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, cache_seqlens: Tensor,
                    cu_seqlens_q: Tensor, *, page_table: Optional[Tensor],
                    cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_kv_len: int,
                    qv: Optional[Tensor], q_descale: Optional[Tensor],
                    k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                    sinks: Optional[Tensor], softmax_scale: float, window_left: int,
                    window_right: int, softcap: float, num_splits: Optional[int] = None,
                    scratch: Optional[tuple[Tensor, Tensor]] = None,
                    counters: Optional[Tensor] = None, config: Optional[_Config] = None,
                    lse: Optional[Tensor] = None, k_start: Optional[Tensor] = None,
                    block_ids: Optional[Tensor] = None,
                    q_used: Optional[Tensor] = None,
                    return_lse: bool = True) -> Optional[Tensor]:
    """Launch the attention kernel (splits merged inside it); write ``out``, return the LSE.

    Args:
        q: [total_q, Hq, D]. out: [total_q, Hq, Dv] (written). qv: [total_q, Hq, Dv] or None.
        k, v: paged [num_pages, page_size, Hkv, D|Dv] with ``page_table [b, max_pages]``, or
            ragged [total_k, Hkv, D|Dv] with ``cu_seqlens_k [b + 1]`` (``page_table=None``).
            Only the last dimension needs unit stride.
        cache_seqlens: [b] int32 keys per request (tokens).
        cu_seqlens_q: [b + 1] int32. max_seqlen_q: bound on new tokens per request.
        max_kv_len: bound on keys per request from shapes (tokens), used to choose splits.
        window_left/window_right: inclusive window, -1 unbounded (causal is right = 0).
        num_splits: force the KV split count (tests, benchmarks; each request's keys shared
            evenly by the splits); default planned from shapes (``plan_splits``).
        scratch: preallocated ``(o_part [>= splits, total_q, Hq, Dv_pad], lse_part [>= splits,
            total_q, Hq])`` float32 (e.g. MLA's workspace); allocated from shapes when None
            (a plain launch outside graph capture takes its stream's workspace instead,
            ``_WORKSPACES``, and so does its LSE when the caller wants none).
        counters: split-KV arrival counters, int32 contiguous, all zero, at least
            ``b * Hkv * cdiv(max_seqlen_q * Hq // Hkv, 16)`` entries (one per program tile;
            BLOCK_M >= 16); left all zero. Reusable by launches that run one after another on
            one stream, never by concurrent ones. When None: the stream's workspace for a plain
            launch outside graph capture, else ``torch.zeros`` per call; unused with one
            split.
        config: force the tile shape (benchmarks). lse: preallocated [Hq, total_q] output.
        k_start: [b] int32 first visible key per request (``cache_leftpad``).
        block_ids: [total_q] int32 bidirectional block id per query token (< 0: none): key j
            has the id of query row ``j - (Lk - Lq)``; same-id keys pass the right bound.
        q_used: [b] int32 used query rows (``seqused_q``): alignment ``Lk - q_used + i``, rows
            past it see no key (output 0, LSE -inf).
        return_lse: False: the caller wants no LSE (``lse`` must be None); a one-split launch
            of the plain form then neither allocates nor writes one.
    Returns:
        softmax_lse [Hq, total_q] float32 (natural log; -inf for rows with no visible key), or
        None with ``return_lse=False``.
    Raises:
        ValueError: ``counters`` is not int32, not contiguous or has fewer entries than tiles.

    The grid, tile config, split count and scalar arguments depend only on shapes, strides and
    scalars, so they are computed once per call shape (``_launch_params``, cached); the launch
    itself is ``kernel[grid](...)``.
    """
    max_seqlen_q, max_kv_len = _tight_bounds(q, k, page_table, max_seqlen_q, max_kv_len)
    plain_like = (page_table is not None and qv is None and q_descale is None
                  and k_descale is None and v_descale is None and sinks is None
                  and k_start is None and block_ids is None and q_used is None)
    if plain_like and scratch is None and config is None and (lse is None or lse.stride(0)
                                                               == q.shape[0]):
        return plain_attention(q, k, v, out, cache_seqlens, cu_seqlens_q, page_table,
                               max_seqlen_q, max_kv_len, softmax_scale, window_left,
                               window_right, softcap, num_splits, return_lse, lse, counters)
    return _general_attention(q, k, v, out, cache_seqlens, cu_seqlens_q, page_table,
                              cu_seqlens_k, max_seqlen_q, max_kv_len, qv, q_descale, k_descale,
                              v_descale, sinks, softmax_scale, window_left, window_right, softcap,
                              num_splits, scratch, counters, config, lse, k_start, block_ids,
                              q_used, return_lse)


def _general_attention(q, k, v, out, cache_seqlens, cu_seqlens_q, page_table, cu_seqlens_k,
                       max_seqlen_q, max_kv_len, qv, q_descale, k_descale, v_descale, sinks,
                       softmax_scale, window_left, window_right, softcap, num_splits, scratch,
                       counters, config, lse, k_start, block_ids, q_used,
                       return_lse) -> Optional[Tensor]:
    """``paged_attention`` of any call (its arguments, positional): launch parameters from every
    feature flag and metadata stride, then the plain or the full kernel."""
    total_q, num_heads_q = q.shape[0], q.shape[1]
    if lse is None and return_lse:
        lse = torch.empty((num_heads_q, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or cache_seqlens.shape[0] == 0:
        return lse
    paged = page_table is not None
    extras = (k_start, block_ids, q_used)
    flags = (qv is not None, q_descale is not None, k_descale is not None,
             v_descale is not None, sinks is not None, *(t is not None for t in extras))
    meta_strides = _metadata_strides(cache_seqlens, cu_seqlens_q, cu_seqlens_k, page_table,
                                     sinks, q_descale, k_descale, v_descale, *extras)
    params = _launch_params(
        q.device, q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.shape, v.stride(),
        out.stride(), None if qv is None else qv.stride(),
        page_table.stride() if paged else None, paged, cache_seqlens.shape[0], max_seqlen_q,
        max_kv_len, flags, softmax_scale, softcap, window_left, window_right, num_splits, config,
        None if scratch is None else (scratch[0].stride(), scratch[1].stride()),
        total_q if lse is None else lse.stride(0), meta_strides, _layout(q, k, v, out))
    if params.plain:
        return _launch_plain(params, q, k, v, out, cache_seqlens, page_table, cu_seqlens_q, lse,
                             counters)
    if lse is None:  # the full kernel writes an LSE (and takes it for unused pointers)
        lse = torch.empty((num_heads_q, total_q), dtype=torch.float32, device=q.device)
    o_part, lse_part, counters = _split_buffers(params, q, scratch, counters, lse)
    if params.meta["TMA"] and q.device.type == "cuda":
        set_descriptor_allocator()
    launch(_paged_attention_kernel, params.grid, q.device,
           q, k, v, q if qv is None else qv, out, lse, o_part, lse_part, counters,
           cache_seqlens, cache_seqlens if page_table is None else page_table,
           cu_seqlens_q, cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k,
           *(lse if t is None else t for t in (q_descale, k_descale, v_descale, sinks, *extras)),
           *params.scalars, **params.meta)
    return lse if return_lse else None


def plain_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, cache_seqlens: Tensor,
                    cu_seqlens_q: Tensor, page_table: Tensor, max_seqlen_q: int,
                    max_kv_len: int, softmax_scale: float, window_left: int, window_right: int,
                    softcap: float, num_splits: Optional[int], return_lse: bool,
                    lse: Optional[Tensor] = None,
                    counters: Optional[Tensor] = None) -> Optional[Tensor]:
    """``paged_attention`` of a paged cache without qv, descales, sinks, leftpad, blocks,
    ``q_used``, caller scratch or forced config (the decode layer's call), positional: the
    ``triton`` provider's entry. A call whose layouts the plain kernel cannot take (K and V of
    different strides, strided metadata) goes on to ``paged_attention``'s general launch.
    ``lse``: a contiguous ``[Hq, total_q]`` output or None (then allocated if ``return_lse``).
    Returns as ``paged_attention``."""
    total_q, num_heads_q = q.shape[0], q.shape[1]
    if lse is None and return_lse:
        lse = torch.empty((num_heads_q, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or cache_seqlens.shape[0] == 0:
        return lse
    max_seqlen_q = min(max_seqlen_q, total_q)
    params = _launch_params(
        q.device, q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.shape, v.stride(),
        out.stride(), None, page_table.stride(), True, cache_seqlens.shape[0], max_seqlen_q,
        max_kv_len, _NO_FLAGS, softmax_scale, softcap, window_left, window_right, num_splits,
        None, None, total_q, (cache_seqlens.stride(0), cu_seqlens_q.stride(0), 0,
                              page_table.stride(1), *_NO_STRIDES), _layout(q, k, v, out))
    if params.plain:
        return _launch_plain(params, q, k, v, out, cache_seqlens, page_table, cu_seqlens_q, lse,
                             counters)
    return _general_attention(q, k, v, out, cache_seqlens, cu_seqlens_q, page_table, None,
                              max_seqlen_q, max_kv_len, None, None, None, None, None,
                              softmax_scale, window_left, window_right, softcap, num_splits,
                              None, counters, None, lse, None, None, None, return_lse)


def _tight_bounds(q: Tensor, k: Tensor, page_table: Optional[Tensor], max_seqlen_q: int,
                  max_kv_len: int) -> tuple[int, int]:
    """The caller's bounds cut to what the shapes allow: a request has at most ``total_q`` query
    rows and (ragged K/V) ``total_k`` keys, so a loose but legal bound (``2**31 - 1``) gives the
    tight bound's grid and result, and no launch size or int32 offset scales with it."""
    return min(max_seqlen_q, q.shape[0]), (max_kv_len if page_table is not None
                                           else min(max_kv_len, k.shape[0]))


def _layout(q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> tuple:
    """``(q, K/V, out)`` element sizes and whether q, K, V, out start 16-byte aligned."""
    return (q.element_size(), k.element_size(), out.element_size(),
            q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
            and out.data_ptr() % 16 == 0)


def _launch_plain(params: _LaunchParams, q, k, v, out, cache_seqlens, page_table, cu_seqlens_q,
                  lse: Optional[Tensor], counters: Optional[Tensor]) -> Optional[Tensor]:
    """Launch ``_paged_attention_plain_kernel`` (unused buffers are None: constexprs, nothing
    to bind); returns ``lse``."""
    if params.num_splits == 1:
        launch(_paged_attention_plain_kernel, params.grid, q.device, q, k, v, out, lse,
               None, None, cache_seqlens, page_table, cu_seqlens_q, *params.scalars,
               **params.meta)
        return lse
    total_q, num_heads_q = q.shape[0], q.shape[1]
    part_elems = params.num_splits * total_q * num_heads_q * (params.dv_pad + 1)
    ws = _workspace(q.device, part_elems, 0 if lse is not None else num_heads_q * total_q,
                    0 if counters is not None else params.num_tiles)
    if ws is None:  # graph capture, another device, a large launch: buffers of this call
        o_part, _, counters = _split_buffers(params, q, None, counters, None)
    else:
        o_part = ws[0]
        counters = ws[2] if counters is None else _checked_counters(counters, params)
    if lse is None:
        # the merge compiles with fewer spills when it writes an LSE (sm_90, 33 splits:
        # 280 bytes of stack against 408 without); the caller does not see it
        lse_buf = (ws[1] if ws is not None else
                   torch.empty((num_heads_q, total_q), dtype=torch.float32, device=q.device))
    else:
        lse_buf = lse
    launch(_paged_attention_plain_kernel, params.grid, q.device, q, k, v, out, lse_buf,
           o_part, counters, cache_seqlens, page_table, cu_seqlens_q, *params.scalars,
           **params.meta)
    return lse


# The rare-feature flags and metadata strides past the first four of a plain-form candidate.
_NO_FLAGS = (False,) * 8
_NO_STRIDES = (0,) * 10


def _metadata_strides(cache_seqlens, cu_seqlens_q, cu_seqlens_k, page_table, sinks, q_descale,
                      k_descale, v_descale, k_start, block_ids, q_used) -> tuple[int, ...]:
    """Strides of the small tensors, in the kernel's order: any view works (a column slice of
    the page table, strided lengths, expanded per-tensor descales and sinks), no copy."""
    def stride(t, dim):
        return 0 if t is None else t.stride(dim)
    return (stride(cache_seqlens, 0), stride(cu_seqlens_q, 0), stride(cu_seqlens_k, 0),
            stride(page_table, 1), stride(sinks, 0), stride(q_descale, 0), stride(q_descale, 1),
            stride(k_descale, 0), stride(k_descale, 1), stride(v_descale, 0),
            stride(v_descale, 1), stride(k_start, 0), stride(block_ids, 0), stride(q_used, 0))


def _split_buffers(params: _LaunchParams, q: Tensor, scratch, counters,
                   dummy: Optional[Tensor]) -> tuple:
    """``(o_part, lse_part, counters)`` for the launch's splits: the given buffers, new ones
    (partials uninitialised, counters zero; the plain kernel's are one buffer, ``o_part``), or
    ``dummy`` (one split: unused; None for the plain kernel)."""
    splits = params.num_splits
    if splits == 1:
        return dummy, dummy, dummy
    total_q, num_heads_q = q.shape[0], q.shape[1]
    if params.plain:  # [splits, total_q, Hq, Dv_pad] partial outputs, then their LSEs
        part = torch.empty(splits * total_q * num_heads_q * (params.dv_pad + 1),
                           dtype=torch.float32, device=q.device)
        scratch = (part, dummy)
    elif scratch is None:
        scratch = (torch.empty((splits, total_q, num_heads_q, params.dv_pad),
                               dtype=torch.float32, device=q.device),
                   torch.empty((splits, total_q, num_heads_q), dtype=torch.float32,
                               device=q.device))
    if counters is None:
        counters = torch.zeros(params.num_tiles, dtype=torch.int32, device=q.device)
    else:
        _checked_counters(counters, params)
    return scratch[0], scratch[1], counters


def _checked_counters(counters: Tensor, params: _LaunchParams) -> Tensor:
    """The caller's ``counters``, or ValueError when they cannot serve the launch."""
    if (counters.dtype != torch.int32 or not counters.is_contiguous()
            or counters.numel() < params.num_tiles):
        raise ValueError(f"paged_attention: counters is {counters.dtype}, "
                         f"{'' if counters.is_contiguous() else 'non-'}contiguous, with "
                         f"{counters.numel()} entries; expected contiguous torch.int32 with at "
                         f"least {params.num_tiles} (one per program tile). Allocate "
                         f"torch.zeros(n, dtype=torch.int32) once and reuse it.")
    return counters


# Split-KV workspaces of plain launches: (partials, LSE, counters) per (device, stream) on CUDA
# and per thread on the CPU interpreter (its launches run in the calling thread). Launches on one
# stream run one after another, the partials and LSE are written before they are read within a
# launch, and the kernel stores every counter it incremented back to 0 (the last arriving split
# of a tile, after its merge), so the counters are zero again when the next launch on that stream
# starts: a workspace never needs resetting. A launch being captured into a graph never uses one
# (it allocates from the graph's pool, and its counters' memset is replayed), so no graph ever
# holds a workspace's address and no replay can run concurrently with an eager launch on it;
# other devices (XPU: its capture query is not known here) and launches needing more than
# WORKSPACE_MAX_BYTES allocate per call too. A workspace grows to the largest launch of its
# stream; the buffer it replaces goes back to the caching allocator, which hands it out again
# only in that stream's order (after the launches that still use it).
_WORKSPACES: dict[object, tuple[Tensor, Tensor, Tensor]] = {}
WORKSPACE_MAX_BYTES = 64 * 2 ** 20


def _workspace_key(device: torch.device) -> Optional[object]:
    """The stream (CUDA: the current ``torch.Stream``, which hashes and compares by device and
    stream id) or thread (CPU) whose launches run in order, None when the launch must allocate
    its own buffers (graph capture, other device types)."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        # torch.accelerator's query builds no Python Stream object (torch.cuda.current_stream
        # does, after resolving the device through Python): one C call for the key
        return torch.accelerator.current_stream(device.index)
    if device.type == "cpu":
        return (device.type, threading.get_ident())
    return None


def _workspace(device: torch.device, part_elems: int, lse_elems: int,
               tiles: int) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """``(partials, LSE, counters)`` of this stream with at least these float32, float32 and
    (zero) int32 entries, or None (see ``_WORKSPACES``)."""
    if 4 * (part_elems + lse_elems + tiles) > WORKSPACE_MAX_BYTES:
        return None
    key = _workspace_key(device)
    if key is None:
        return None
    ws = _WORKSPACES.get(key)
    if (ws is None or ws[0].numel() < part_elems or ws[1].numel() < lse_elems
            or ws[2].numel() < tiles):
        old = ws or (None, None, None)

        def grown(buf, n, make):
            return buf if buf is not None and buf.numel() >= n else make(
                max(n, 0 if buf is None else buf.numel()))
        ws = _WORKSPACES[key] = (
            grown(old[0], part_elems, lambda n: torch.empty(n, dtype=torch.float32,
                                                            device=device)),
            grown(old[1], lse_elems, lambda n: torch.empty(n, dtype=torch.float32,
                                                           device=device)),
            grown(old[2], tiles, lambda n: torch.zeros(n, dtype=torch.int32, device=device)))
    return ws


def requested_splits(num_splits: int) -> Optional[int]:
    """The op's ``num_splits`` (0: automatic) as ``paged_attention``'s (None: planned)."""
    return None if num_splits == 0 else num_splits


def supports_attention(q, k, v, out, qv) -> Optional[str]:
    """Why the kernel cannot serve these tensors (shapes/strides only), or ``None``."""
    if q.shape[-1] > 256 or v.shape[-1] > 512:
        return (f"head dims D={q.shape[-1]}, Dv={v.shape[-1]} exceed the kernel's D <= 256, "
                f"Dv <= 512")
    if (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and out.stride(-1) == 1
            and (qv is None or qv.stride(-1) == 1)):
        return None  # the usual call (it runs on every launch): no tuple of names to build
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("qv", qv)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has a non-unit stride in its last dimension"
    return None


def _supports_call(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv,
                   *rest, **kwargs) -> Optional[str]:
    """``supports=`` of the ``triton`` ``flash_attn_with_kvcache`` (``supports_attention``;
    its usual case, checked first)."""
    if (q.shape[-1] <= 256 and v_cache.shape[-1] <= 512 and qv is None and q.stride(-1) == 1
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and out.stride(-1) == 1):
        return None
    return supports_attention(q, k_cache, v_cache, out, qv)


@provider_table.register("flash_attn_with_kvcache", "triton", available=available,
                    supports=_supports_call)
def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out,
                            qv, q_descale, k_descale, v_descale, sinks, cache_leftpad,
                            bidirectional_block_ids, max_seqlen_q, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, num_splits,
                            return_softmax_lse):
    """Triton ``flash_attn_with_kvcache`` (contract: ``xpu_ops/ops/paged_attention.py``).

    ``paged_attention`` in ``PAGED`` mode: FlashAttention-2 online softmax with GQA packing and
    split-KV; ``max_kv_len`` is the page-table capacity in tokens. Writes ``out``, returns the LSE
    (an empty ``[Hq, 0]`` unless ``return_softmax_lse``: then the plain form writes none). A call
    without the rare features goes straight to ``plain_attention`` (positional).
    """
    if (qv is None and q_descale is None and k_descale is None and v_descale is None
            and sinks is None and cache_leftpad is None and bidirectional_block_ids is None):
        lse = plain_attention(q, k_cache, v_cache, out, cache_seqlens, cu_seqlens_q, page_table,
                              max_seqlen_q, page_table.shape[1] * k_cache.shape[1],
                              softmax_scale, window_size_left, window_size_right, softcap,
                              requested_splits(num_splits), return_softmax_lse)
    else:
        lse = paged_attention(
            q, k_cache, v_cache, out, cache_seqlens, cu_seqlens_q, page_table=page_table,
            cu_seqlens_k=None, max_seqlen_q=max_seqlen_q,
            max_kv_len=page_table.shape[1] * k_cache.shape[1], qv=qv, q_descale=q_descale,
            k_descale=k_descale, v_descale=v_descale, sinks=sinks, softmax_scale=softmax_scale,
            window_left=window_size_left, window_right=window_size_right, softcap=softcap,
            num_splits=requested_splits(num_splits), k_start=cache_leftpad,
            block_ids=bidirectional_block_ids, return_lse=return_softmax_lse)
    return lse if return_softmax_lse else provider_table.empty_lse(q)
