"""Non-causal layer types (``attn_type`` ENCODER_ONLY, DECODER_BIDIRECTIONAL) and Gemma-3
bidirectional image blocks through ``XPUAttentionBackend``, against the float64 oracle."""

import pytest
import torch

import xpu_ops
from compile.backend import AttentionType
from compile.batch import ForwardMode
from tests.compile.oracle import Harness, assert_close

PAGE_SIZES = [1, 16, 64]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY,
                                       AttentionType.DECODER_BIDIRECTIONAL],
                         ids=lambda t: t.value)
def test_non_causal_layer_sees_every_key(page_size, attn_type):
    h = Harness(page_size, seed=200 + page_size)
    reqs = [h.add_request(p) for p in (0, 17, 5, 64)]
    bidir, causal = h.layer(attn_type=attn_type.value), h.layer()
    assert not bidir.causal and causal.causal
    new = [9, 1, 20, 3]
    outs, qs = h.step(ForwardMode.EXTEND, reqs, new, [bidir])
    assert_close(outs[0], h.expected(reqs, new, bidir, qs[0]))
    outs, qs = h.step(ForwardMode.DECODE, reqs, [1] * 4, [bidir])
    assert_close(outs[0], h.expected(reqs, [1] * 4, bidir, qs[0]))


def test_unknown_attn_type_is_a_value_error():
    with pytest.raises(ValueError, match="attn_type is not an AttentionType"):
        Harness(16).layer(attn_type="encoder_decoder")


def _whole_sequence_ids(prefixes, new_lens, spans):
    """The ids sglang 0.5.23's Gemma-3 model hands the backend: over whole sequences."""
    seq_lens = [p + n for p, n in zip(prefixes, new_lens)]
    ids = xpu_ops.build_bidirectional_block_ids(seq_lens, spans)
    return ids, ids.split(seq_lens)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED], ids=lambda m: m.name)
def test_gemma3_image_blocks_are_bidirectional(page_size, mode):
    h = Harness(page_size, seed=210 + page_size, num_layers=3, window=8)
    prefixes, new = [0, 10, 5, 30], [20, 12, 1, 17]
    # An image inside the new tokens, one that starts in the cached prefix (chunked prefill cut
    # it), none, and two images in one request.
    spans = [[(3, 12)], [(6, 15)], [], [(31, 35), (40, 46)]]
    reqs = [h.add_request(p, layers=(0, 1, 2)) for p in prefixes]
    ids, per_request = _whole_sequence_ids(prefixes, new, spans)
    full, windowed = h.layer(0), h.layer(1, sliding_window_size=7)
    encoder = h.layer(2, attn_type=AttentionType.ENCODER_ONLY)    # sees every key regardless
    outs, qs = h.step(mode, reqs, new, [full, windowed, encoder], block_ids=ids)
    assert_close(outs[0], h.expected(reqs, new, full, qs[0], block_ids=per_request))
    assert_close(outs[1], h.expected(reqs, new, windowed, qs[1], block_ids=per_request))
    assert_close(outs[2], h.expected(reqs, new, encoder, qs[2]))
    causal_only = h.expected(reqs, new, full, qs[0])
    assert not torch.allclose(outs[0], causal_only), "the image blocks changed nothing"


def test_image_block_ids_must_cover_whole_sequences():
    h = Harness(16, seed=221)
    reqs = [h.add_request(4)]
    ids, _ = _whole_sequence_ids([0], [6], [[(1, 3)]])        # the new tokens only: too short
    with pytest.raises(ValueError, match="bidirectional_block_ids has 6 entries"):
        h.step(ForwardMode.EXTEND, reqs, [6], [h.layer()], block_ids=ids)


def test_image_blocks_do_not_outlive_their_step():
    h = Harness(16, seed=220)
    reqs = [h.add_request(4)]
    ids, _ = _whole_sequence_ids([4], [6], [[(5, 8)]])
    layer = h.layer()
    h.step(ForwardMode.EXTEND, reqs, [6], [layer], block_ids=ids)
    outs, qs = h.step(ForwardMode.DECODE, reqs, [1], [layer])   # the model sets none now
    assert h.backend.bidirectional_block_ids is None
    assert_close(outs[0], h.expected(reqs, [1], layer, qs[0]))


def test_is_causal_reads_sglangs_layer_fields():
    # Any layer with sglang's fields (its RadixAttention has a string-valued AttentionType).
    from types import SimpleNamespace

    from compile.backend.layer import is_causal
    kind = SimpleNamespace(value="encoder_only")
    assert not is_causal(SimpleNamespace(is_cross_attention=False, attn_type=kind))
    assert is_causal(SimpleNamespace(is_cross_attention=False))
    assert not is_causal(SimpleNamespace(is_cross_attention=True))
