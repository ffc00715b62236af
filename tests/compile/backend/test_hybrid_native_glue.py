"""A hybrid model's decode and extend steps through the ``sgl_kernel`` provider of
``gdn_attention``: with a stand-in of sgl-kernel-xpu's native library bound (its fused
``gdn_attention`` schema, layouts and input contract; ``tests/ops/native_sgl_kernel.py``), a
bf16 Qwen3-Next with K = 32 (a head size the native kernels serve) generates through the
engine, each linear layer's step staged into the native op's layouts and written back into
the state pool; its logits equal the reference provider's engine and the native op ran for
both extend (num_prefills = b) and decode (num_decodes = b) steps. Glue test, not a hardware
result."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import xpu_ops  # noqa: E402
from compile.engine import Engine, SamplingParams  # noqa: E402
from compile.models import from_hf  # noqa: E402
from tests.compile.batch.test_swa_pages import Recorder  # noqa: E402
from tests.models.test_qwen3_next_parity import qwen3_next_hf  # noqa: E402
from tests.ops import native_gdn  # noqa: E402
from tests.ops.native_sgl_kernel import define_native_library  # noqa: E402
from xpu_ops import sgl_kernel as sk  # noqa: E402


def generate(model):
    rec = Recorder(model)
    engine = Engine(model, forward=rec, page_size=16, max_running=3, max_context_len=48,
                    max_total_tokens=160, chunked_prefill_size=16)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
               for n in (21, 6, 9)]
    return engine.generate(prompts, SamplingParams(max_new_tokens=4)), rec.logits


def test_engine_steps_through_the_native_gdn_attention_equal_the_reference():
    model = from_hf(qwen3_next_hf(linear_key_head_dim=32), dtype=torch.bfloat16)
    with xpu_ops.use_provider("reference"):
        want_ids, want = generate(model)
    with sk.bound_to(define_native_library("xpu_ops_glue_hybrid", "writes")):
        xpu_ops.refresh()
        native_gdn.CALLS.clear()
        try:
            ids, got = generate(model)
        finally:
            xpu_ops.refresh()
    kinds = {(p > 0, d > 0) for p, d, _ in native_gdn.CALLS}
    assert kinds == {(True, False), (False, True)}, native_gdn.CALLS  # extend and decode
    assert ids == want_ids
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
