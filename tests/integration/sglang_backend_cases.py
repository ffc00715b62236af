"""sglang 0.5.23's own ``XPUAttentionBackend`` on xpu-ops, through ``install_sgl_kernel_shim``.

Run by ``test_sglang_backend.py`` in a child process whose path holds ``.venv-sglang`` (sglang
and its import chain, ``scripts/with-sglang.sh``) and the torchvision stand-in; not collected
otherwise (the file name does not match ``test_*.py``). Every case builds sglang's real pools
(``MHATokenToKVPool`` poisoned with NaN, ``ReqToTokenPool`` with shuffled pages), its
``RadixAttention`` layer and ``ForwardBatch``, calls ``backend.init_forward_metadata`` and
``backend.forward`` as sglang's model runner does, and compares the output with the float64
oracle (``tests/ops/oracle.py``) over the keys the case wrote. GQA (4 query heads over 2 KV
heads), page sizes 1 and 16, each case with xpu-ops' reference and Triton providers (the parent
sets ``TRITON_INTERPRET=1`` on a CPU).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from types import SimpleNamespace

import pytest
import torch

import xpu_ops

xpu_ops.compat.install_sgl_kernel_shim()

from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config  # noqa: E402
from sglang.srt.configs.model_config import AttentionArch  # noqa: E402
from sglang.srt.layers.attention.xpu_backend import XPUAttentionBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (KVWriteLoc, MHATokenToKVPool,  # noqa: E402
                                              MLATokenToKVPool, ReqToTokenPool)
from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode,  # noqa: E402
                                                          ForwardBatch, ForwardMode)
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: E402

from ..ops import oracle  # noqa: E402

HQ, HKV, D = 4, 2, 64
CONTEXT_LEN = 64
SCALE = D ** -0.5
MLA_HEADS, MLA_R, MLA_ROPE = 4, 32, 16         # query heads, latent rank, rope dim
MLA_SCALE = (MLA_R + MLA_ROPE) ** -0.5
ATOL = 1e-5


@pytest.fixture(params=["reference", "triton"], autouse=True)
def provider(request):
    with xpu_ops.use_provider(request.param):
        yield request.param


def publish_config(**server_args) -> None:
    """Publish the process-wide config sglang's backends read (``get_parallel()``,
    ``get_spec()``, ``get_exec()``...): a ``ServerArgs`` on the CPU with device graphs off (its
    encoder-decoder path requires that) and ``server_args``, resolved as sglang's own test
    helpers do. Backends read it when built."""
    reset_context()
    args = ServerArgs(model_path="dummy", device="cpu", disable_cuda_graph=True, **server_args)
    parse_cuda_graph_config(args)
    publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))


@pytest.fixture(scope="module", autouse=True)
def published_config():
    """The default config (``publish_config()``) for every case of the module."""
    publish_config()
    yield
    reset_context()


class Harness:
    """One attention layer of ``batch`` requests on sglang's pools and backend.

    Request ``i`` owns the token slots ``slots[i]`` (its pages shuffled across the pool) and the
    row ``req_pool_indices[i]`` of ``req_to_token``; ``keys[i, t]`` / ``values[i, t]`` are what
    its token ``t`` stores. With ``mla`` the pool is sglang's MLA pool: ``keys[i, t]`` is the
    ``[1, MLA_R + MLA_ROPE]`` latent-and-rope row, ``values`` its latent part, and the layer
    has ``MLA_HEADS`` query heads.
    """

    def __init__(self, page_size: int, batch: int = 3, seed: int = 0,
                 encoder_decoder: bool = False, mla: bool = False):
        self.gen = torch.Generator().manual_seed(seed)
        self.batch, self.page_size, self.mla = batch, page_size, mla
        kw = dict(size=batch * CONTEXT_LEN, page_size=page_size, dtype=torch.float32,
                  layer_num=1, device="cpu", enable_memory_saver=False)
        if mla:
            self.pool = MLATokenToKVPool(kv_lora_rank=MLA_R, qk_rope_head_dim=MLA_ROPE, **kw)
            buffers = self.pool.kv_buffer
        else:
            self.pool = MHATokenToKVPool(head_num=HKV, head_dim=D, **kw)
            buffers = (*self.pool.k_buffer, *self.pool.v_buffer)
        for buffer in buffers:
            buffer.fill_(float("nan"))                 # never-written slots must not be read
        self.req_pool = req_pool = ReqToTokenPool(size=batch + 1, max_context_len=CONTEXT_LEN,
                                                  device="cpu", enable_memory_saver=False)
        pages = torch.randperm(batch * CONTEXT_LEN // page_size, generator=self.gen)
        self.slots = (pages.view(batch, -1, 1) * page_size
                      + torch.arange(page_size)).view(batch, CONTEXT_LEN)
        self.req_pool_indices = torch.randperm(batch, generator=self.gen) + 1   # row 0: padding
        req_pool.req_to_token[self.req_pool_indices] = self.slots.to(req_pool.req_to_token.dtype)
        runner = SimpleNamespace(
            model_config=SimpleNamespace(
                context_len=CONTEXT_LEN, attention_arch=AttentionArch.MLA if mla else
                AttentionArch.MHA, is_encoder_decoder=encoder_decoder,
                hf_text_config=SimpleNamespace(num_attention_heads=MLA_HEADS if mla else HQ)),
            sliding_window_size=None, device="cpu", req_to_token_pool=req_pool,
            token_to_kv_pool=self.pool, kv_cache_dtype=torch.float32,
            kv_cache_dtype_str="auto", page_size=page_size, is_hybrid_swa=False,
            is_draft_worker=False)
        self.runner = runner                          # for draft-step backends of the same pools
        self.backend = XPUAttentionBackend(runner)
        if mla:
            self.layer = RadixAttention(num_heads=MLA_HEADS, head_dim=MLA_R + MLA_ROPE,
                                        scaling=MLA_SCALE, num_kv_heads=1, layer_id=0,
                                        v_head_dim=MLA_R)
            self.keys = torch.randn(batch, CONTEXT_LEN, 1, MLA_R + MLA_ROPE, generator=self.gen)
            self.values = self.keys[..., :MLA_R]
        else:
            self.layer = RadixAttention(num_heads=HQ, head_dim=D, scaling=SCALE,
                                        num_kv_heads=HKV, layer_id=0)
            self.keys = torch.randn(batch, CONTEXT_LEN, HKV, D, generator=self.gen)
            self.values = torch.randn(batch, CONTEXT_LEN, HKV, D, generator=self.gen)

    def tokens(self, start, stop):
        """Slots, keys and values of tokens ``start[i]:stop[i]`` of every request, packed."""
        ranges = [torch.arange(int(a), int(b)) for a, b in zip(start, stop)]
        return tuple(torch.cat([t[i, r] for i, r in enumerate(ranges)])
                     for t in (self.slots, self.keys, self.values))

    def store_prefix(self, prefix_lens) -> None:
        """Write each request's first ``prefix_lens[i]`` tokens with the pool's own writer."""
        loc, k, v = self.tokens([0] * self.batch, prefix_lens)
        if self.mla:
            self.pool.set_mla_kv_buffer(self.layer, KVWriteLoc(loc), k[..., :MLA_R],
                                        k[..., MLA_R:])
        else:
            self.pool.set_kv_buffer(self.layer, KVWriteLoc(loc), k, v, None, None)

    def make_batch(self, mode, seq_lens: torch.Tensor, loc: torch.Tensor,
                   **batch_fields) -> ForwardBatch:
        """sglang's ``ForwardBatch`` of every request, writing the new tokens to ``loc``."""
        return ForwardBatch(
            forward_mode=mode, batch_size=self.batch, input_ids=torch.zeros_like(loc),
            req_pool_indices=self.req_pool_indices, seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(), out_cache_loc=loc, seq_lens_sum=int(seq_lens.sum()),
            **batch_fields)

    def forward(self, mode, seq_lens, new_lens, **batch_fields) -> tuple[torch.Tensor, list]:
        """``backend.forward`` of ``new_lens[i]`` new tokens per request after
        ``seq_lens[i] - new_lens[i]`` cached ones; returns ``(out [total_q, HQ, D], q)``."""
        seq_lens, new_lens = torch.tensor(seq_lens), torch.tensor(new_lens)
        loc, k, v = self.tokens(seq_lens - new_lens, seq_lens)
        q = torch.randn(loc.shape[0], HQ, D, generator=self.gen)
        batch = self.make_batch(mode, seq_lens, loc, **batch_fields)
        self.backend.init_forward_metadata(batch)
        out = self.backend.forward(q.view(-1, HQ * D), k, v, self.layer, batch)
        return out.view(-1, HQ, D), q

    def expected(self, q, total_lens, new_lens) -> torch.Tensor:
        """Float64 oracle: new token ``j`` of request ``i`` sees keys ``0 ..
        total_lens[i] - new_lens[i] + j`` (causal, bottom-right)."""
        outs, row = [], 0
        for i, (total, new) in enumerate(zip(total_lens, new_lens)):
            mask = oracle.visible_mask(new, total, causal=True)
            out, _ = oracle.attend(q[row:row + new], self.keys[i, :total], self.values[i, :total],
                                   mask, scale=SCALE)
            outs.append(out)
            row += new
        return torch.cat(outs)


def _assert_close(out, expected):
    assert not out.isnan().any(), "NaN in the backend's output (garbage slots were read)"

    def diagnosis(message: str) -> str:  # which packed rows, and the process's CPU math setup
        error = (out.double() - expected).abs().flatten(1).amax(1)
        rows = (error > ATOL).nonzero().flatten().tolist()
        return (f"{message}\nrows over atol: {rows} of {error.shape[0]}; intra-op threads "
                f"{torch.get_num_threads()}, float32 matmul precision "
                f"{torch.get_float32_matmul_precision()}, CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}")
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0, msg=diagnosis)


@pytest.mark.parametrize("prefix,new", [([5, 0, 20], [4, 17, 1]), ([0, 0, 0], [5, 1, 33])],
                         ids=["cached-prefix", "no-prefix"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend(page_size, prefix, new):
    # cached-prefix: one request without a prefix, one with a single new token.
    h = Harness(page_size, seed=1 + sum(prefix))
    h.store_prefix(prefix)
    total = [p + n for p, n in zip(prefix, new)]
    out, q = h.forward(ForwardMode.EXTEND, total, new, extend_prefix_lens=torch.tensor(prefix),
                       extend_prefix_lens_cpu=prefix, extend_seq_lens=torch.tensor(new),
                       extend_seq_lens_cpu=new, extend_num_tokens=sum(new))
    _assert_close(out, h.expected(q, total, new))


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode(page_size):
    h = Harness(page_size, seed=3)
    prefix = [9, 17, 1]
    h.store_prefix(prefix)
    total = [p + 1 for p in prefix]
    out, q = h.forward(ForwardMode.DECODE, total, [1, 1, 1])
    _assert_close(out, h.expected(q, total, [1, 1, 1]))


def _verify_input(batch: int, num_draft: int, prefix) -> EagleVerifyInput:
    """A chain (topk 1) of ``num_draft`` draft tokens per request, as EAGLE's draft worker hands
    it to the target model."""
    positions = torch.cat([torch.arange(p, p + num_draft) for p in prefix])
    chain = torch.arange(num_draft)
    return EagleVerifyInput(
        draft_token=torch.zeros(batch * num_draft, dtype=torch.long),
        custom_mask=torch.ones(sum((p + num_draft) * num_draft for p in prefix), dtype=torch.bool),
        positions=positions, retrieve_index=(chain + num_draft * torch.arange(batch)[:, None]),
        retrieve_next_token=torch.where(chain + 1 < num_draft, chain + 1, -1).repeat(batch, 1),
        retrieve_next_sibling=torch.full((batch, num_draft), -1),
        retrieve_cum_len=None, spec_steps=num_draft - 1, topk=1, draft_token_num=num_draft,
        capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=sum(prefix),
        seq_lens_cpu=torch.tensor(prefix))


@pytest.mark.parametrize("page_size", [1, 16])
def test_target_verify_topk1(page_size):
    h = Harness(page_size, seed=4)
    prefix, num_draft = [10, 1, 22], 3
    h.store_prefix(prefix)
    total = [p + num_draft for p in prefix]
    # TARGET_VERIFY batches carry the lengths before the drafts; the backend adds them.
    seq_lens, drafts = torch.tensor(prefix), torch.tensor([num_draft] * 3)
    loc, k, v = h.tokens(seq_lens, seq_lens + drafts)
    q = torch.randn(loc.shape[0], HQ, D, generator=h.gen)
    batch = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=3, input_ids=torch.zeros_like(loc),
        req_pool_indices=h.req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=loc, seq_lens_sum=sum(prefix),
        spec_info=_verify_input(3, num_draft, prefix))
    h.backend.init_forward_metadata(batch)
    out = h.backend.forward(q.view(-1, HQ * D), k, v, h.layer, batch).view(-1, HQ, D)
    _assert_close(out, h.expected(q, total, [num_draft] * 3))


def test_interface_data_matches_the_wheel():
    """``tests/compile/backend/sglang_interface.json`` (the CPU test's data) is what
    ``scripts/dump_sglang_interface.py`` reads from this sglang now."""
    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "dump_sglang_interface", root / "scripts" / "dump_sglang_interface.py")
    dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dump)
    stored = json.loads((root / "tests/compile/backend/sglang_interface.json").read_text())
    assert dump.describe() == stored
