"""Speculative modes: target verify (chain and tree), draft decode (topk 1 and > 1), SWA trees.

Tree-masked drafts are compared with dense attention over the prefix plus the draft's
ancestors (and itself), in tree order, with the query at the last position.
"""

import pytest
import torch

from compile.batch import ForwardMode, SpecInfo
from tests.compile.oracle import Harness, assert_close, attention_oracle, random_tree


def _flatten_sglang(masks, prefixes):
    """sglang's flattened custom mask: per request [D, prefix + D] rows (prefix all visible)."""
    parts = []
    for m, p in zip(masks, prefixes):
        parts.append(torch.cat([torch.ones(m.shape[0], p, dtype=torch.bool), m], 1).reshape(-1))
    return torch.cat(parts)


def _verify(h, prefixes, d, layers, masks=None, flat=False, sinks=None, spec_kw=None):
    """Run TARGET_VERIFY (``d`` tokens per request) for every layer; returns (reqs, outputs,
    queries). ``spec_kw`` overrides the SpecInfo fields."""
    reqs = [h.add_request(p, layers=[l.layer_id for l in layers]) for p in prefixes]
    loc = torch.cat([h.alloc_slots(r, p, d) for r, p in zip(reqs, prefixes)])
    topk = 1 if masks is None else 2
    cm = None
    if masks is not None:
        cm = _flatten_sglang(masks, prefixes) if flat else torch.stack(masks)
    spec = SpecInfo(**{**dict(topk=topk, draft_token_num=d, custom_mask=cm), **(spec_kw or {})})
    fb = h.batch(ForwardMode.TARGET_VERIFY, reqs, [d] * len(reqs), loc, prefixes,
                 spec_info=spec)
    h.backend.init_forward_metadata(fb)
    outs, qs = [], []
    for layer in layers:
        t = d * len(reqs)
        q = h.rand(t, h.hq * h.d).float()
        k, v = h.rand(t, h.hkv, h.d), h.rand(t, h.hkv, h.d)
        h.poisoned_output(fb, t, layer)
        outs.append(layer(q, k.float(), v.float(), fb, sinks=sinks).double())
        h._append(reqs, [d] * len(reqs), layer.layer_id, k, v, 1.0)
        qs.append(q.double())
    return reqs, outs, qs


def _tree_expected(h, reqs, prefixes, masks, layer, q, sinks=None):
    d = masks[0].shape[0]
    w = layer.sliding_window_size
    rows = []
    for r, (req, p, m) in enumerate(zip(reqs, prefixes, masks)):
        for i in range(d):
            keep = torch.cat([torch.arange(p), p + torch.nonzero(m[i]).flatten()])
            qi = q[r * d + i].view(1, h.hq, h.d)
            o = attention_oracle(qi, req.k[layer.layer_id][keep], req.v[layer.layer_id][keep],
                                 scale=layer.scaling, softcap=layer.logit_cap, sinks=sinks,
                                 window_left=w if w >= 0 else -1)
            rows.append(o.reshape(1, -1))
    return torch.cat(rows)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_target_verify_chain(page_size):
    h = Harness(page_size, seed=20 + page_size, topk=1, draft_tokens=4)
    prefixes = [0, 17, 70]
    layer = h.layer()
    reqs, outs, qs = _verify(h, prefixes, 4, [layer])
    assert_close(outs[0], h.expected(reqs, [4] * 3, layer, qs[0]))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_target_verify_width_from_num_tokens_per_req(page_size):
    # DSpark's draft block: D = 5 drafts configured, the step packs 2 tokens per request.
    h = Harness(page_size, seed=25 + page_size, topk=1, draft_tokens=5)
    prefixes = [63, 0, 30, 64]
    layer = h.layer()
    reqs, outs, qs = _verify(h, prefixes, 2, [layer],
                             spec_kw=dict(draft_token_num=5, num_tokens_per_req=2))
    assert_close(outs[0], h.expected(reqs, [2] * 4, layer, qs[0]))


def test_target_verify_tree_width_must_be_its_mask():
    h = Harness(16, seed=26, topk=2, draft_tokens=4)
    masks = [random_tree(h.gen, 4)]
    with pytest.raises(NotImplementedError, match="num_tokens_per_req 4, got 2"):
        _verify(h, [5], 4, [h.layer()], masks, spec_kw=dict(num_tokens_per_req=2))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("flat", [False, True])
def test_target_verify_tree_cascade(page_size, flat):
    h = Harness(page_size, seed=30 + page_size, topk=2, draft_tokens=5)
    prefixes = [19, 0, 33]
    masks = [random_tree(h.gen, 5) for _ in prefixes]
    layer = h.layer(logit_cap=4.0)
    sinks = torch.randn(h.hq, generator=h.gen).float()
    reqs, outs, qs = _verify(h, prefixes, 5, [layer], masks, flat=flat, sinks=sinks)
    assert_close(outs[0], _tree_expected(h, reqs, prefixes, masks, layer, qs[0], sinks))


def test_target_verify_tree_fp8_kv_cache():
    # Both cascade passes read the fp8 cache (descaled); beyond sglang 0.5.23.
    h = Harness(16, seed=35, topk=2, draft_tokens=4, kv_dtype=torch.float8_e4m3fn)
    prefixes = [23, 0, 48]
    masks = [random_tree(h.gen, 4) for _ in prefixes]
    layer = h.layer()
    layer.set_kv_scales(1.0, 1.0)
    reqs, outs, qs = _verify(h, prefixes, 4, [layer], masks)
    assert_close(outs[0], _tree_expected(h, reqs, prefixes, masks, layer, qs[0]))


@pytest.mark.parametrize("hybrid", [False, True])
def test_target_verify_tree_sliding_window(hybrid):
    kw = dict(swa_layers=(1,), num_layers=2) if hybrid else dict(num_layers=2)
    h = Harness(16, seed=40, topk=2, draft_tokens=4, window=6, **kw)
    prefixes = [21, 3, 40]
    masks = [random_tree(h.gen, 4) for _ in prefixes]
    full, swa = h.layer(0), h.layer(1, sliding_window_size=6)
    reqs, outs, qs = _verify(h, prefixes, 4, [full, swa], masks)
    assert_close(outs[0], _tree_expected(h, reqs, prefixes, masks, full, qs[0]))
    assert_close(outs[1], _tree_expected(h, reqs, prefixes, masks, swa, qs[1]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_decode_chain(page_size):
    steps, step = 3, 2
    h = Harness(page_size, seed=50, topk=1, num_steps=steps, step_id=step)
    prefixes = [0, 18, 31]
    reqs = [h.add_request(p) for p in prefixes]
    loc = torch.stack([h.alloc_slots(r, p, steps) for r, p in zip(reqs, prefixes)])  # [b, N]
    k, v = h.rand(3, steps, h.hkv, h.d), h.rand(3, steps, h.hkv, h.d)
    h.write_direct(0, loc[:, :step].reshape(-1), k[:, :step].reshape(-1, h.hkv, h.d),
                   v[:, :step].reshape(-1, h.hkv, h.d))
    fb = h.batch(ForwardMode.DECODE, reqs, [1] * 3, loc.reshape(-1), prefixes,
                 spec_info=SpecInfo(topk=1))
    h.backend.init_forward_metadata(fb)
    layer = h.layer()
    q = h.rand(3, h.hq * h.d).float()
    h.poisoned_output(fb, 3, layer)
    out = layer(q, k[:, step].float(), v[:, step].float(), fb).double()
    for i, r in enumerate(reqs):
        h._append([r], [step + 1], 0, k[i, :step + 1], v[i, :step + 1], 1.0)
    assert_close(out, h.expected(reqs, [1] * 3, layer, q.double()))


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_decode_tree_cascade(page_size):
    topk, steps, step = 3, 3, 1
    h = Harness(page_size, seed=60, topk=topk, num_steps=steps, step_id=step)
    prefixes = [25, 0]
    b = len(prefixes)
    reqs = [h.add_request(p) for p in prefixes]
    scratch = h.add_request(0)
    loc = h.alloc_slots(scratch, 0, b * topk * steps).view(b, topk, steps)
    k = h.rand(b, topk, steps, h.hkv, h.d)
    v = h.rand(b, topk, steps, h.hkv, h.d)
    h.write_direct(0, loc[..., :step].reshape(-1), k[..., :step, :, :].reshape(-1, h.hkv, h.d),
                   v[..., :step, :, :].reshape(-1, h.hkv, h.d))
    fb = h.batch(ForwardMode.DECODE, reqs, [topk] * b, loc.reshape(-1), prefixes,
                 spec_info=SpecInfo(topk=topk))
    h.backend.init_forward_metadata(fb)
    layer = h.layer(logit_cap=5.0)
    sinks = torch.randn(h.hq, generator=h.gen).float()
    q = h.rand(b * topk, h.hq * h.d).float()
    h.poisoned_output(fb, b * topk, layer)
    out = layer(q, k[:, :, step].reshape(-1, h.hkv, h.d).float(),
                v[:, :, step].reshape(-1, h.hkv, h.d).float(), fb, sinks=sinks).double()
    rows = []
    for r, req in enumerate(reqs):
        for j in range(topk):
            keys = torch.cat([req.k[0], k[r, j, :step + 1].float().double()])
            vals = torch.cat([req.v[0], v[r, j, :step + 1].float().double()])
            o = attention_oracle(q[r * topk + j].double().view(1, h.hq, h.d), keys, vals,
                                 scale=layer.scaling, softcap=5.0, sinks=sinks)
            rows.append(o.reshape(1, -1))
    assert_close(out, torch.cat(rows))


def test_sliding_window_tree_without_window_setting_not_implemented():
    """Trees on sliding-window and chunked-local layers take merged rows per query
    (tests/compile/graphs/test_spec_graphs.py); a sliding-window layer in a model runner
    without ``sliding_window_size`` has none and raises, naming the setting."""
    h = Harness(16, seed=61, topk=2, num_steps=2)
    reqs = [h.add_request(5)]
    scratch = h.add_request(0)
    loc = h.alloc_slots(scratch, 0, 4)
    fb = h.batch(ForwardMode.DECODE, reqs, [2], loc, [5], spec_info=SpecInfo(topk=2))
    h.backend.init_forward_metadata(fb)
    with pytest.raises(NotImplementedError, match="needs the model runner's sliding_window_size"):
        h.layer(sliding_window_size=4)(torch.zeros(2, h.hq * h.d), None, None, fb)


def test_deterministic_cascade_passes_one_split_each(monkeypatch):
    import xpu_ops
    from compile.backend import XPUAttentionBackend
    calls, real = [], xpu_ops.flash_attn_with_kvcache
    monkeypatch.setattr(xpu_ops, "flash_attn_with_kvcache",
                        lambda *a, **k: calls.append(k["num_splits"]) or real(*a, **k))
    h = Harness(16, seed=60, topk=2, draft_tokens=4)
    h.runner.server_args.enable_deterministic_inference = True
    h.backend = XPUAttentionBackend(h.runner)
    prefixes = [5, 40]
    masks = [random_tree(h.gen, 4) for _ in prefixes]
    layer = h.layer()
    reqs, outs, qs = _verify(h, prefixes, 4, [layer], masks)
    assert_close(outs[0], _tree_expected(h, reqs, prefixes, masks, layer, qs[0]))
    assert calls == [1, 1]                        # the prefix pass and the expand pass
