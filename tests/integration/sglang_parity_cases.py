"""Side by side: sglang 0.5.23's own ``XPUAttentionBackend`` (over ``install_sgl_kernel_shim``)
and this project's ``compile.backend.XPUAttentionBackend`` on the same batches.

Run with ``sglang_backend_cases.py`` by ``test_sglang_backend.py`` in its child process. Each
case builds sglang's pools and batch (``sglang_backend_cases.Harness``), copies the pools'
contents into this project's pools (``Twin``: same slots, same ``req_to_token``), runs both
backends on the same queries and new K/V, and requires both outputs to equal the float64 oracle
and each other. The modes are the ones 0.5.23 serves that ``sglang_backend_cases.py`` does not
cover: MIXED, DRAFT_EXTEND_V2, a target verify whose width is ``spec_info.num_tokens_per_req``,
an ENCODER_ONLY (non-causal) layer, Gemma-3 image blocks (``bidirectional_block_ids`` over
whole sequences, with a cached prefix), encoder-decoder self and cross attention with encoder
lengths that are not page multiples, absorbed MLA (``flash_mla_prefill`` for extend and
verify, ``flash_mla_decode``), deterministic inference (both pass ``num_splits=1``), a tree
target verify (topk 2: the cascade, sglang's flattened mask) and a draft decode step of each
side's ``XPUMultiStepDraftBackend`` (topk 1 and 2); plus extend and decode again, side by side.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode

import xpu_ops
from compile import backend as ours
from compile import batch as ours_batch
from compile.engine.model_runner import ModelRunnerInfo

from ..ops import oracle
from .sglang_backend_cases import (CONTEXT_LEN, D, HKV, HQ, MLA_HEADS, MLA_R, MLA_ROPE,
                                   MLA_SCALE, SCALE, Harness, _assert_close, _verify_input,
                                   publish_config, published_config)

__all__ = ["published_config"]                  # the fixture, active in this module too


@pytest.fixture(autouse=True)
def provider():
    """The reference provider only: these cases compare the two backends' metadata and calls;
    the providers are compared with the oracle op by op in tests/ops and in
    sglang_backend_cases.py."""
    with xpu_ops.use_provider("reference"):
        yield "reference"


class Twin:
    """This project's backend over copies of ``h``'s pools (taken when built: build it after
    the cached prefix is stored and before sglang's step writes the new tokens)."""

    def __init__(self, h: Harness, deterministic: bool = False, topk: int = 1,
                 draft_tokens: int = 0, **layer_kw):
        if h.mla:
            rows = h.pool.kv_buffer[0].shape[0]
            self.pool = ours_batch.MLATokenToKVPool(rows, h.page_size, torch.float32, MLA_R,
                                                    MLA_ROPE, 1, "cpu")
            self.pool.kv_buffer[0].copy_(h.pool.kv_buffer[0])
            self.layer = ours.PagedAttention(MLA_HEADS, MLA_R + MLA_ROPE, MLA_SCALE, 1, 0,
                                             v_head_dim=MLA_R)
        else:
            rows = h.pool.k_buffer[0].shape[0]
            self.pool = ours_batch.MHATokenToKVPool(rows, h.page_size, torch.float32, HKV, D,
                                                    layer_num=1, device="cpu")
            self.pool.k_buffer[0].copy_(h.pool.k_buffer[0])
            self.pool.v_buffer[0].copy_(h.pool.v_buffer[0])
            self.layer = ours.PagedAttention(HQ, D, SCALE, HKV, 0, **layer_kw)
        req_pool = ours_batch.ReqToTokenPool(h.req_pool.req_to_token.shape[0], CONTEXT_LEN, "cpu")
        req_pool.req_to_token.copy_(h.req_pool.req_to_token.to(req_pool.req_to_token.dtype))
        runner = ModelRunnerInfo(
            model_config=SimpleNamespace(context_len=CONTEXT_LEN,
                                         num_attention_heads=MLA_HEADS if h.mla else HQ),
            tp_size=1, device=torch.device("cpu"), page_size=h.page_size,
            req_to_token_pool=req_pool, token_to_kv_pool=self.pool,
            kv_cache_dtype=torch.float32,
            server_args=SimpleNamespace(speculative_eagle_topk=topk,
                                        speculative_num_draft_tokens=draft_tokens,
                                        enable_deterministic_inference=deterministic))
        self.runner = runner
        self.backend = ours.XPUAttentionBackend(runner)

    def batch(self, sglang_batch, spec_info=None) -> ours_batch.ForwardBatch:
        """This project's ``ForwardBatch`` of sglang's ``sglang_batch`` (its metadata built)."""
        fb = ours_batch.ForwardBatch(
            forward_mode=ours_batch.ForwardMode[sglang_batch.forward_mode.name],
            batch_size=sglang_batch.batch_size, req_pool_indices=sglang_batch.req_pool_indices,
            seq_lens=sglang_batch.seq_lens, out_cache_loc=sglang_batch.out_cache_loc,
            extend_seq_lens=sglang_batch.extend_seq_lens,
            extend_prefix_lens=sglang_batch.extend_prefix_lens, spec_info=spec_info,
            encoder_lens=sglang_batch.encoder_lens,
            encoder_out_cache_loc=sglang_batch.encoder_out_cache_loc)
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        return fb

    def forward(self, sglang_batch, q, k, v, spec_info=None, block_ids=None):
        """This backend's output ``[total_q, HQ, D]`` for sglang's batch ``sglang_batch``."""
        fb = self.batch(sglang_batch, spec_info)
        self.backend.bidirectional_block_ids = block_ids
        return self.layer(q.view(-1, HQ * D), k, v, fb).view(-1, HQ, D)


def _side_by_side(h, twin, mode, seq_lens, new_lens, layer=None, spec_info=None,
                  our_spec=None, block_ids=None, **fields):
    """sglang's and this backend's outputs of one step, the same q and new K/V for both.

    ``seq_lens``: the batch's lengths (TARGET_VERIFY: before the ``new_lens`` drafts, as
    sglang; every other mode: after the ``new_lens`` new tokens)."""
    seq_lens, new_lens = torch.tensor(seq_lens), torch.tensor(new_lens)
    if mode == ForwardMode.TARGET_VERIFY:
        start, stop = seq_lens, seq_lens + new_lens
    else:
        start, stop = seq_lens - new_lens, seq_lens
    if layer is not None:
        h.layer = layer
    loc, k, v = h.tokens(start, stop)
    q = torch.randn(loc.shape[0], HQ, D, generator=h.gen)
    batch = h.make_batch(mode, seq_lens, loc, spec_info=spec_info, **fields)
    h.backend.init_forward_metadata(batch)
    h.backend.bidirectional_block_ids = block_ids
    theirs = h.backend.forward(q.view(-1, HQ * D), k, v, h.layer, batch).view(-1, HQ, D)
    mine = twin.forward(batch, q, k, v, spec_info=our_spec, block_ids=block_ids)
    return theirs, mine, q


def _extend_fields(prefix, new):
    return dict(extend_prefix_lens=torch.tensor(prefix), extend_prefix_lens_cpu=prefix,
                extend_seq_lens=torch.tensor(new), extend_seq_lens_cpu=new,
                extend_num_tokens=sum(new))


def _expected(h, q, total, new, causal=True, block_ids=None):
    """Float64 oracle over the keys the case wrote (``block_ids``: per request, its new
    tokens' ids)."""
    outs, row = [], 0
    for i, (t, n) in enumerate(zip(total, new)):
        ids = None if block_ids is None else block_ids[i]
        mask = oracle.visible_mask(n, t, causal=causal, block_ids=ids)
        out, _ = oracle.attend(q[row:row + n], h.keys[i, :t], h.values[i, :t], mask,
                               scale=SCALE)
        outs.append(out)
        row += n
    return torch.cat(outs)


def _assert_all(theirs, mine, expected):
    _assert_close(theirs, expected)
    _assert_close(mine, expected)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED,
                                  ForwardMode.DRAFT_EXTEND_V2], ids=lambda mode: mode.name)
def test_extend_mixed_and_draft_extend_v2(page_size, mode):
    h = Harness(page_size, seed=11)
    prefix, new = [7, 0, 19], [3, 12, 1]
    h.store_prefix(prefix)
    twin = Twin(h)
    total = [p + n for p, n in zip(prefix, new)]
    theirs, mine, q = _side_by_side(h, twin, mode, total, new, **_extend_fields(prefix, new))
    _assert_all(theirs, mine, _expected(h, q, total, new))


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode(page_size):
    h = Harness(page_size, seed=12)
    prefix = [30, 2, 16]
    h.store_prefix(prefix)
    twin = Twin(h)
    total = [p + 1 for p in prefix]
    theirs, mine, q = _side_by_side(h, twin, ForwardMode.DECODE, total, [1, 1, 1])
    _assert_all(theirs, mine, _expected(h, q, total, [1, 1, 1]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_target_verify_width_from_num_tokens_per_req(page_size):
    # DSpark's draft block: D = 4 drafts configured, 2 tokens per request in this step.
    h = Harness(page_size, seed=13)
    prefix, width = [10, 1, 40], 2
    h.store_prefix(prefix)
    twin = Twin(h)
    spec = _verify_input(3, 4, prefix)
    spec.num_tokens_per_req = width
    our_spec = ours_batch.SpecInfo(topk=1, draft_token_num=4, num_tokens_per_req=width)
    theirs, mine, q = _side_by_side(h, twin, ForwardMode.TARGET_VERIFY, prefix, [width] * 3,
                                    spec_info=spec, our_spec=our_spec)
    total = [p + width for p in prefix]
    _assert_all(theirs, mine, _expected(h, q, total, [width] * 3))


@pytest.mark.parametrize("page_size", [1, 16])
def test_encoder_only_layer_is_not_causal(page_size):
    h = Harness(page_size, seed=14)
    prefix, new = [0, 9, 0], [6, 4, 20]
    h.store_prefix(prefix)
    twin = Twin(h, attn_type=ours.AttentionType.ENCODER_ONLY)
    layer = RadixAttention(num_heads=HQ, head_dim=D, scaling=SCALE, num_kv_heads=HKV,
                           layer_id=0, attn_type=AttentionType.ENCODER_ONLY)
    total = [p + n for p, n in zip(prefix, new)]
    theirs, mine, q = _side_by_side(h, twin, ForwardMode.EXTEND, total, new, layer=layer,
                                    **_extend_fields(prefix, new))
    _assert_all(theirs, mine, _expected(h, q, total, new, causal=False))


@pytest.mark.parametrize("page_size", [1, 16])
def test_gemma3_image_blocks_with_a_cached_prefix(page_size):
    h = Harness(page_size, seed=15)
    prefix, new = [0, 6, 3], [14, 10, 2]
    total = [p + n for p, n in zip(prefix, new)]
    # sglang's Gemma-3 model: ids over whole sequences; one image starts in a cached prefix.
    spans = [[(2, 9)], [(4, 12)], []]
    ids = xpu_ops.build_bidirectional_block_ids(total, spans)
    h.store_prefix(prefix)
    twin = Twin(h)
    theirs, mine, q = _side_by_side(h, twin, ForwardMode.EXTEND, total, new, block_ids=ids,
                                    **_extend_fields(prefix, new))
    per_request = [r[p:].tolist() for r, p in zip(ids.split(total), prefix)]
    expected = _expected(h, q, total, new, block_ids=per_request)
    _assert_all(theirs, mine, expected)
    assert not torch.allclose(expected, _expected(h, q, total, new)), "no block mattered"


@pytest.mark.parametrize("page_size", [1, 16])
def test_encoder_decoder_any_encoder_length(page_size):
    # Decoder tokens follow each request's encoder tokens in req_to_token; 5 and 9 are not page
    # multiples, so at page size 16 the decoder starts mid-page.
    h = Harness(page_size, seed=16, encoder_decoder=True)
    enc, prefix, new = [5, 16, 9], [0, 3, 7], [4, 2, 1]
    h.store_prefix([e + p for e, p in zip(enc, prefix)])      # encoder tokens, decoder prefix
    twin = Twin(h)
    cross_theirs = RadixAttention(num_heads=HQ, head_dim=D, scaling=SCALE, num_kv_heads=HKV,
                                  layer_id=0, is_cross_attention=True)
    cross_mine = ours.PagedAttention(HQ, D, SCALE, HKV, 0, is_cross_attention=True)
    total = [p + n for p, n in zip(prefix, new)]
    start = torch.tensor([e + p for e, p in zip(enc, prefix)])
    loc, k, v = h.tokens(start, start + torch.tensor(new))
    fields = dict(_extend_fields(prefix, new), encoder_lens=torch.tensor(enc),
                  encoder_lens_cpu=enc, encoder_out_cache_loc=h.tokens([0] * 3, enc)[0])
    batch = h.make_batch(ForwardMode.EXTEND, torch.tensor(total), loc, **fields)
    h.backend.init_forward_metadata(batch)
    fb = twin.batch(batch)
    q, qc = (torch.randn(loc.shape[0], HQ * D, generator=h.gen) for _ in range(2))
    theirs = h.backend.forward(q, k, v, h.layer, batch).view(-1, HQ, D)
    mine = twin.layer(q, k, v, fb).view(-1, HQ, D)
    cross = (h.backend.forward(qc, None, None, cross_theirs, batch).view(-1, HQ, D),
             cross_mine(qc, None, None, fb).view(-1, HQ, D))
    self_rows, cross_rows, row = [], [], 0
    for i, (e, t, n) in enumerate(zip(enc, total, new)):
        keys, values = h.keys[i], h.values[i]
        mask = oracle.visible_mask(n, t, causal=True)
        self_rows.append(oracle.attend(q[row:row + n].view(n, HQ, D), keys[e:e + t],
                                       values[e:e + t], mask, scale=SCALE)[0])
        mask = oracle.visible_mask(n, e, causal=False)
        cross_rows.append(oracle.attend(qc[row:row + n].view(n, HQ, D), keys[:e], values[:e],
                                        mask, scale=SCALE)[0])
        row += n
    _assert_all(theirs, mine, torch.cat(self_rows))
    _assert_all(*cross, torch.cat(cross_rows))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE,
                                  ForwardMode.TARGET_VERIFY], ids=lambda mode: mode.name)
def test_mla_absorbed(page_size, mode):
    # 0.5.23: flash_mla_prefill for extend and verify, flash_mla_decode for decode.
    h = Harness(page_size, seed=17, mla=True)
    prefix = [9, 0, 33]
    new = {ForwardMode.EXTEND: [5, 12, 1], ForwardMode.DECODE: [1, 1, 1],
           ForwardMode.TARGET_VERIFY: [3, 3, 3]}[mode]
    if mode == ForwardMode.DECODE:
        prefix = [p + 4 for p in prefix]                  # decode needs a cached prefix
    h.store_prefix(prefix)
    twin = Twin(h)
    start = torch.tensor(prefix)
    stop = start + torch.tensor(new)
    loc, k, _ = h.tokens(start, stop)
    fields, spec, our_spec = {}, None, None
    if mode == ForwardMode.EXTEND:
        fields = _extend_fields(prefix, new)
    if mode == ForwardMode.TARGET_VERIFY:
        spec = _verify_input(3, 3, prefix)
        our_spec = ours_batch.SpecInfo(topk=1, draft_token_num=3)
    seq_lens = start if mode == ForwardMode.TARGET_VERIFY else stop
    batch = h.make_batch(mode, seq_lens, loc, spec_info=spec, **fields)
    h.backend.init_forward_metadata(batch)
    fb = twin.batch(batch, our_spec)
    q = torch.randn(loc.shape[0], MLA_HEADS * (MLA_R + MLA_ROPE), generator=h.gen)
    k_nope, k_rope = k[..., :MLA_R], k[..., MLA_R:]
    theirs = h.backend.forward(q, k_nope, k_nope, h.layer, batch, k_rope=k_rope)
    mine = twin.layer(q, k_nope, None, fb, k_rope=k_rope)
    rows, row = [], 0
    q3 = q.view(-1, MLA_HEADS, MLA_R + MLA_ROPE)
    for i, (t, n) in enumerate(zip(stop.tolist(), new)):
        mask = oracle.visible_mask(n, t, causal=True)
        rows.append(oracle.attend(q3[row:row + n], h.keys[i, :t], h.values[i, :t], mask,
                                  scale=MLA_SCALE)[0])
        row += n
    _assert_all(theirs.view(-1, MLA_HEADS, MLA_R), mine.view(-1, MLA_HEADS, MLA_R),
                torch.cat(rows))


@pytest.mark.parametrize("page_size", [1, 16])
def test_deterministic_inference_pins_one_split(page_size, monkeypatch):
    # sglang reads --enable-deterministic-inference when its backend is built.
    # sglang's call is seen at its module's name, every call (sglang's through the shim, and
    # ours, which may go straight into the op) at the dispatcher.
    from sglang.srt.layers.attention import xpu_backend
    from xpu_ops.testing import recorded_op_calls
    theirs_splits = []
    real = xpu_backend.flash_attn_with_kvcache
    monkeypatch.setattr(xpu_backend, "flash_attn_with_kvcache",
                        lambda *a, **k: theirs_splits.append(k.get("num_splits")) or real(*a, **k))
    publish_config(enable_deterministic_inference=True)
    try:
        h = Harness(page_size, seed=18)
    finally:
        publish_config()
    prefix, new = [12, 0, 30], [3, 9, 1]
    h.store_prefix(prefix)
    twin = Twin(h, deterministic=True)
    total = [p + n for p, n in zip(prefix, new)]
    with recorded_op_calls("flash_attn_with_kvcache") as seen:
        theirs, mine, q = _side_by_side(h, twin, ForwardMode.EXTEND, total, new,
                                        **_extend_fields(prefix, new))
    _assert_all(theirs, mine, _expected(h, q, total, new))
    assert theirs_splits == [1]
    assert [c["num_splits"] for c in seen] == [1, 1]      # sglang's call and ours


def _random_tree(gen: torch.Generator, d: int) -> torch.Tensor:
    """``[d, d]`` bool: draft ``i`` sees itself and its ancestors (a random parent each)."""
    mask = torch.eye(d, dtype=torch.bool)
    for i in range(1, d):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] |= mask[parent]
    return mask


@pytest.mark.parametrize("page_size", [1, 16])
def test_target_verify_tree_topk2(page_size):
    # The cascade (topk > 1): a prefix pass over the cached tokens plus each draft's pass over
    # the drafts its tree row sees, merged by LSE; sglang's flattened mask layout for both.
    d = 4
    publish_config(speculative_eagle_topk=2, speculative_num_draft_tokens=d,
                   speculative_num_steps=2)
    try:
        h = Harness(page_size, seed=19)
    finally:
        publish_config()
    prefix = [9, 0, 33]
    h.store_prefix(prefix)
    assert h.backend.topk == 2                  # sglang's backend takes its cascade path
    twin = Twin(h, topk=2, draft_tokens=d)
    trees = [_random_tree(h.gen, d) for _ in prefix]
    flat = torch.cat([torch.cat([torch.ones(d, p, dtype=torch.bool), t], 1).reshape(-1)
                      for p, t in zip(prefix, trees)])
    spec = _verify_input(3, d, prefix)
    spec.topk, spec.custom_mask = 2, flat
    our_spec = ours_batch.SpecInfo(topk=2, draft_token_num=d, custom_mask=flat)
    theirs, mine, q = _side_by_side(h, twin, ForwardMode.TARGET_VERIFY, prefix, [d] * 3,
                                    spec_info=spec, our_spec=our_spec)
    rows, row = [], 0
    for i, (p, tree) in enumerate(zip(prefix, trees)):
        visible = torch.cat([torch.ones(d, p, dtype=torch.bool), tree], 1)
        out, _ = oracle.attend(q[row:row + d], h.keys[i, :p + d], h.values[i, :p + d],
                               visible, scale=SCALE)
        rows.append(out)
        row += d
    _assert_all(theirs, mine, torch.cat(rows))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("topk", [1, 2])
def test_draft_decode_step(page_size, topk):
    # Draft step 1 of a round of 3 (both sides' XPUMultiStepDraftBackend, its step-1 backend):
    # topk 1 reads the chain's drafts from req_to_token after the prefix; topk 2 is the
    # cascade, each branch over its own drafts in the round's (b, topk, steps) slots. The
    # drafts are stored first (the worker's writes); the step only reads.
    from sglang.srt.layers.attention.xpu_backend import XPUMultiStepDraftBackend
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    from compile.backend.multi_step_draft import XPUMultiStepDraftBackend as OurMultiStep
    steps, step = 3, 1
    publish_config(speculative_eagle_topk=topk, speculative_num_steps=steps,
                   speculative_num_draft_tokens=topk * steps)
    try:
        h = Harness(page_size, seed=20 + topk)
        theirs_backend = XPUMultiStepDraftBackend(h.runner, topk, steps).attn_backends[step]
    finally:
        publish_config()
    assert theirs_backend.topk == topk
    prefix = [11, 0, 26]
    h.store_prefix([p + topk * steps for p in prefix])   # prefix, then the round's drafts
    twin = Twin(h)
    twin.backend = OurMultiStep(twin.runner, topk, steps).attn_backends[step]
    loc = torch.stack([h.slots[i, p:p + topk * steps] for i, p in enumerate(prefix)])
    seq_lens = torch.tensor(prefix)
    batch = h.make_batch(ForwardMode.DECODE, seq_lens, loc.reshape(-1),
                         spec_info=EagleDraftInput())
    q = torch.randn(3 * topk, HQ, D, generator=h.gen)
    theirs_backend.init_forward_metadata(batch)
    theirs = theirs_backend.forward(q.view(-1, HQ * D), None, None, h.layer, batch,
                                    save_kv_cache=False).view(-1, HQ, D)
    mine = twin.forward(batch, q, None, None, spec_info=ours_batch.SpecInfo(topk=topk))
    rows = []
    for i, p in enumerate(prefix):
        for j in range(topk):
            # topk 1: the chain's drafts follow the prefix; topk 2: branch j's own drafts
            seen = (torch.arange(p + step + 1) if topk == 1 else torch.cat(
                [torch.arange(p), p + j * steps + torch.arange(step + 1)]))
            out, _ = oracle.attend(q[i * topk + j:i * topk + j + 1], h.keys[i, seen],
                                   h.values[i, seen], torch.ones(1, seen.numel(), dtype=torch.bool),
                                   scale=SCALE)
            rows.append(out)
    _assert_all(theirs, mine, torch.cat(rows))
