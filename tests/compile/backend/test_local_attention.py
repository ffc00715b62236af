"""Chunked local attention (iRoPE): virtual batches against a brute-force chunk mask, and the
backend's chunked-local layers against the float64 oracle."""

import pytest
import torch

from compile.batch import ForwardMode
from compile.backend.local_attention import make_local_attention_virtual_batches
from tests.compile.oracle import Harness, assert_close


@pytest.mark.parametrize("chunk,page_size", [(8, 1), (32, 16), (64, 64), (16, 16)])
def test_virtual_batches_match_chunk_mask(chunk, page_size):
    gen = torch.Generator().manual_seed(chunk + page_size)
    b = 6
    k_lens = torch.randint(1, 150, (b,), generator=gen)
    q_lens = torch.minimum(torch.randint(1, 70, (b,), generator=gen), k_lens)
    q_lens[0], k_lens[0] = 1, chunk            # a query exactly at a chunk's last position
    q_lens[1], k_lens[1] = 1, chunk + 1        # ... and at the next chunk's first
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(q_lens, 0)])
    max_pages = (int(k_lens.max()) + page_size - 1) // page_size
    # Page ids encode (request, logical page) so each virtual row's chunk start is recoverable.
    table = (torch.arange(b)[:, None] * 1000 + torch.arange(max_pages)).to(torch.int32)
    vb = make_local_attention_virtual_batches(chunk, cu_q, k_lens, table, page_size)
    seen = {}
    for v in range(vb.cache_seqlens.shape[0]):
        r, first_page = divmod(int(vb.page_table[v, 0]), 1000)
        start = first_page * page_size
        vq = int(vb.cu_seqlens_q[v + 1] - vb.cu_seqlens_q[v])
        vk = int(vb.cache_seqlens[v])
        for i in range(vq):
            pos_local = vk - vq + i
            seen[(r, start + pos_local)] = set(range(start, start + pos_local + 1))
        # The table continues the request's pages from the chunk start.
        n = min(vb.page_table.shape[1], max_pages - first_page)
        assert vb.page_table[v, :n].tolist() == table[r, first_page:first_page + n].tolist()
    expected = {}
    for r in range(b):
        for pos in range(int(k_lens[r] - q_lens[r]), int(k_lens[r])):
            expected[(r, pos)] = {j for j in range(pos + 1) if j // chunk == pos // chunk}
    assert seen == expected
    # Virtual rows keep the packed query order.
    assert int(vb.cu_seqlens_q[-1]) == int(q_lens.sum())


def test_virtual_batches_padding_and_errors():
    cu = torch.tensor([0, 1, 2])
    k = torch.tensor([5, 40])
    table = torch.zeros(2, 4, dtype=torch.int32)
    vb = make_local_attention_virtual_batches(16, cu, k, table, 16, pad_to=5)
    assert vb.cache_seqlens.tolist() == [5, 8, 0, 0, 0]
    assert vb.cu_seqlens_q.tolist() == [0, 1, 2, 2, 2, 2]
    with pytest.raises(NotImplementedError, match="multiple of page_size"):
        make_local_attention_virtual_batches(24, cu, k, table, 16)
    with pytest.raises(ValueError, match="pad_to"):
        make_local_attention_virtual_batches(16, cu, k, table, 16, pad_to=1)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_backend_chunked_local_layer(page_size, mode):
    h = Harness(page_size, seed=70 + page_size, chunk=32, num_layers=2)
    prefixes = [0, 31, 40, 64, 100]
    new = [45, 1, 30, 2, 7] if mode == ForwardMode.EXTEND else [1] * 5
    reqs = [h.add_request(p, layers=(0, 1)) for p in prefixes]
    local, full = h.layer(0, use_irope=True), h.layer(1)
    outs, qs = h.step(mode, reqs, new, [local, full])
    assert_close(outs[0], h.expected(reqs, new, local, qs[0]))
    assert_close(outs[1], h.expected(reqs, new, full, qs[1]))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_backend_builds_virtual_batches_from_host_lengths(mode, monkeypatch):
    h = Harness(16, seed=71, chunk=32)
    prefixes = [0, 31, 40, 100]
    new = [45, 1, 30, 7] if mode == ForwardMode.EXTEND else [1] * 4
    reqs = [h.add_request(p) for p in prefixes]
    loc = torch.cat([h.alloc_slots(r, p, n) for r, p, n in zip(reqs, prefixes, new)])
    fb = h.batch(mode, reqs, new, loc, [p + n for p, n in zip(prefixes, new)])
    copied = []  # tensors read back to the host (a device sync on a GPU)
    to_host = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copied.append(t) or to_host(t))
    meta = h.backend.build_metadata(fb)
    monkeypatch.undo()
    main = meta.main
    assert not any(t is main.cu_seqlens_q or t is main.cache_seqlens for t in copied)
    want = make_local_attention_virtual_batches(32, main.cu_seqlens_q, main.cache_seqlens,
                                                main.page_table, 16)
    for name in ("cu_seqlens_q", "cache_seqlens", "page_table"):
        torch.testing.assert_close(getattr(meta.local, name), getattr(want, name), atol=0,
                                   rtol=0, msg=name)
    assert (meta.local.max_seqlen_q, meta.local.max_seqlen_k) == (want.max_seqlen_q, 32)
