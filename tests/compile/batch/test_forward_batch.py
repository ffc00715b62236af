"""``SpecInfo`` (verify/draft input, per-request width) and ``ForwardBatch.is_draft_extend``
(sglang 0.5.23's rule: DRAFT_EXTEND_V2, or EXTEND with a draft input)."""

from types import SimpleNamespace

import pytest
import torch

from compile.batch import ForwardBatch, ForwardMode, SpecInfo, SpecInputType, is_draft_extend


def test_spec_info_kind_and_width():
    verify = SpecInfo(topk=1, draft_token_num=4)
    assert verify.is_verify_input() and not verify.is_draft_input()
    assert verify.num_tokens_per_req == 4                     # -1 auto-fills from D
    assert SpecInfo(draft_token_num=4, num_tokens_per_req=3).num_tokens_per_req == 3
    draft = SpecInfo(topk=2)
    assert draft.is_draft_input() and draft.num_tokens_per_req == -1
    forced = SpecInfo(draft_token_num=4, spec_input_type=SpecInputType.EAGLE_DRAFT)
    assert forced.is_draft_input() and forced.num_tokens_per_req == -1


def _batch(mode, spec_info=None) -> ForwardBatch:
    one = torch.ones(1, dtype=torch.int64)
    return ForwardBatch(forward_mode=mode, batch_size=1, req_pool_indices=one, seq_lens=one,
                        out_cache_loc=one, spec_info=spec_info)


@pytest.mark.parametrize("mode,spec,expected", [
    (ForwardMode.DRAFT_EXTEND_V2, None, True),
    (ForwardMode.EXTEND, SpecInfo(topk=1), True),              # a draft input
    (ForwardMode.EXTEND, SpecInfo(draft_token_num=3), False),  # a verify input
    (ForwardMode.EXTEND, None, False),
    (ForwardMode.MIXED, SpecInfo(topk=1), False),
    (ForwardMode.DECODE, SpecInfo(topk=1), False),             # a draft decode step
])
def test_is_draft_extend(mode, spec, expected):
    assert _batch(mode, spec).is_draft_extend() is expected
    # Any batch with sglang's two fields, e.g. sglang's own ForwardBatch.
    assert is_draft_extend(SimpleNamespace(forward_mode=mode, spec_info=spec)) is expected
