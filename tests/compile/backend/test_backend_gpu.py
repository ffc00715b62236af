"""Deterministic inference on the GPU: with ``server_args.enable_deterministic_inference`` a
request's attention output is bitwise the same whether it runs alone or batched with long
requests (every call pins ``num_splits=1``, so the split-KV plan cannot depend on the batch).

Run on the GPU machine: ``python -m pytest -m gpu -q tests/compile/backend/test_backend_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compile.backend import PagedAttention, XPUAttentionBackend
from compile.batch import ForwardBatch, ForwardMode, MHATokenToKVPool, ReqToTokenPool
from compile.engine.model_runner import ModelRunnerInfo
from tests.markers import GPU_DEVICE, requires_gpu
from tests.compile.oracle import attention_oracle

pytestmark = requires_gpu

HQ, HKV, D, PAGE, CONTEXT = 32, 8, 128, 16, 8192


class World:
    """``b`` requests over shuffled pages of one bf16 pool on the GPU."""

    def __init__(self, batch: int, deterministic: bool, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        dev = torch.device(GPU_DEVICE)
        slots = batch * CONTEXT
        self.pool = MHATokenToKVPool(slots, PAGE, torch.bfloat16, HKV, D, layer_num=1,
                                     device=dev)
        on_device = torch.Generator(dev).manual_seed(seed)
        for buf in (self.pool.k_buffer[0], self.pool.v_buffer[0]):
            buf.copy_(torch.randn(buf.shape, generator=on_device, device=dev))
        self.req_pool = ReqToTokenPool(batch, CONTEXT, dev)
        pages = torch.randperm(slots // PAGE, generator=gen).view(batch, -1, 1) * PAGE
        self.req_pool.req_to_token.copy_((pages + torch.arange(PAGE)).view(batch, CONTEXT))
        runner = ModelRunnerInfo(
            model_config=SimpleNamespace(context_len=CONTEXT, num_attention_heads=HQ),
            tp_size=1, device=dev, page_size=PAGE, req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.pool, kv_cache_dtype=torch.bfloat16,
            server_args=SimpleNamespace(enable_deterministic_inference=deterministic))
        self.backend = XPUAttentionBackend(runner)
        self.layer = PagedAttention(HQ, D, D ** -0.5, HKV, 0)

    def decode(self, rows: list[int], seq_lens: list[int], q: torch.Tensor) -> torch.Tensor:
        """One decode step of requests ``rows`` (nothing written: K/V are already cached)."""
        dev = q.device
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(rows),
                          req_pool_indices=torch.tensor(rows, device=dev),
                          seq_lens=torch.tensor(seq_lens, device=dev),
                          out_cache_loc=torch.zeros(len(rows), dtype=torch.int64, device=dev))
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        return self.layer(q, None, None, fb).view(len(rows), HQ, D)

    def expected(self, row: int, seq_len: int, q: torch.Tensor) -> torch.Tensor:
        slots = self.req_pool.req_to_token[row, :seq_len].long()
        k, v = self.pool.k_buffer[0][slots].cpu(), self.pool.v_buffer[0][slots].cpu()
        return attention_oracle(q.view(1, HQ, D).cpu(), k, v, scale=D ** -0.5)


@pytest.mark.parametrize("seq_len", [300, 7000])
def test_deterministic_decode_is_batch_invariant(seq_len):
    world = World(batch=64, deterministic=True)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(64, HQ * D, generator=gen).to(GPU_DEVICE, torch.bfloat16)
    alone = world.decode([0], [seq_len], q[:1])
    others = [int(n) for n in torch.randint(1, CONTEXT, (63,), generator=gen)]
    batched = world.decode(list(range(64)), [seq_len] + others, q)
    assert torch.equal(alone[0], batched[0]), "deterministic decode depends on the batch"
    torch.testing.assert_close(alone[0].double().cpu(), world.expected(0, seq_len, q[0])[0],
                               atol=2e-2, rtol=2e-2)
