"""Piecewise mode serves every attention layer kind of the zoo through the one split op.

Each test runs a model piecewise (``PiecewiseModel``) and an independent deep copy of it eagerly,
each on its own pools (same seeds, so the same token ids and KV slots), over one extend step and
several decode steps, and compares the logits of every step. KV pools start NaN-poisoned, so a
split op that skips a write, writes the wrong slot or reads the wrong layer shows up as NaN or a
mismatch. Layer kinds: attention sinks (GPT-OSS), MLA (DeepSeek-V2: latent ``k``, ``q_rope``,
``k_rope``, ``v`` None), cross-layer KV sharing (``k = v = None``), sliding window + softcap.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from compile.graphs import PiecewiseModel, set_forward_context
from compile.backend import PagedAttention
from compile.batch import MLATokenToKVPool
from compile.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from compile.models.llama import LlamaAttention
from compile.graphs.split_op import enable_split_op, unified_attention
from tests.compile.compile_helpers import Harness, MLAHarness, tiny_model

# (kind, rows, extend lens): prefill three requests, decode them (and subsets), extend again.
STEPS = (("extend", [0, 1, 2], [5, 2, 7]), ("decode", [0, 1, 2], None),
         ("decode", [0, 1, 2], None), ("decode", [2, 0], None), ("extend", [1, 3], [3, 4]),
         ("decode", [0, 1, 2, 3], None))


def _kv_buffers(pool) -> list[torch.Tensor]:
    if isinstance(pool, MLATokenToKVPool):
        return list(pool.kv_buffer)
    return list(pool.k_buffer) + list(pool.v_buffer)


def _poison(h: Harness) -> Harness:
    for buf in _kv_buffers(h.kv_pool):
        buf.fill_(math.nan)
    return h


def _step(h: Harness, kind: str, rows, lens):
    return h.extend(rows, lens) if kind == "extend" else h.decode(rows)


def check_piecewise_equals_eager(model, make_harness=Harness, *, inductor=False, page_size=1,
                                 rtol=1e-5, atol=1e-5) -> PiecewiseModel:
    """Run ``STEPS`` piecewise on ``model`` and eagerly on a deep copy; logits must match."""
    eager = copy.deepcopy(model)
    pw = PiecewiseModel(model, inductor=inductor)
    h_pw = _poison(make_harness(model, page_size=page_size))
    h_eager = _poison(make_harness(eager, page_size=page_size))
    for kind, rows, lens in STEPS:
        ids, pos, fb = _step(h_pw, kind, rows, lens)
        ids_e, pos_e, fb_e = _step(h_eager, kind, rows, lens)
        torch.testing.assert_close(ids, ids_e, rtol=0, atol=0)  # same seeds: same batch
        with torch.no_grad():
            out, ref = pw(ids, pos, fb), eager(ids_e, pos_e, fb_e)
        assert not ref.isnan().any(), f"{kind} {rows}: eager logits have NaN (bad test setup)"
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, msg=lambda m: f"{kind} "
                                   f"{rows}: {m}")
    return pw


def _assert_split(pw: PiecewiseModel, num_layers: int) -> None:
    """Every Dynamo graph calls the split op once per layer, and its pieces sit in
    ``num_layers + 1`` segments around those calls (before the first, between, after the last;
    a segment may hold more than one piece where ``compile/graphs/piecewise.py`` cuts it further)."""
    assert pw.backend.split_gms, "no Dynamo graph was compiled"
    for split_gm in pw.backend.split_gms:
        items = [sub for _, sub in split_gm.named_children()]
        is_split = ["unified_attention_with_output" in str(sub.code) for sub in items]
        assert sum(is_split) == num_layers  # one attention call per layer
        segments = {sum(is_split[:i]) for i, split in enumerate(is_split) if not split}
        assert len(segments) == num_layers + 1  # num_layers + 1 pieces (segments)
    stats = pw.backend.stats
    assert stats["split_ops"] == len(pw.backend.split_gms) * num_layers


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield


# ----------------------------------------------------------------------- (a) attention sinks

def test_sinks_model_equals_eager():
    # GPT-OSS-like: learned sinks on every layer, alternating sliding/full layers, o_proj bias.
    model = tiny_model(num_layers=3, attention_sinks=True, o_proj_bias=True, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert all(layer.self_attn.sinks is not None for layer in model.model.layers)
    pw = check_piecewise_equals_eager(model, page_size=1)
    _assert_split(pw, 3)


def test_sinks_model_equals_eager_with_inductor():
    model = tiny_model(num_layers=2, attention_sinks=True)
    pw = check_piecewise_equals_eager(model, inductor=True, page_size=4, rtol=1e-4, atol=1e-5)
    _assert_split(pw, 2)
    assert pw.backend.stats["compiles"] >= 2  # Inductor compiled distinct pieces


def test_sinks_reach_the_backend():
    """Sinks change the logits; piecewise must carry them (not drop them)."""
    model = tiny_model(attention_sinks=True)
    no_sinks = copy.deepcopy(model)
    for layer in no_sinks.model.layers:
        layer.self_attn.sinks = None
    pw = PiecewiseModel(model, inductor=False)
    h_pw, h_ref = Harness(model), Harness(no_sinks)
    ids, pos, fb = h_pw.extend([0, 1], [4, 6])
    ids_r, pos_r, fb_r = h_ref.extend([0, 1], [4, 6])
    with torch.no_grad():
        out, ref = pw(ids, pos, fb), no_sinks(ids_r, pos_r, fb_r)
    assert (out - ref).abs().max() > 1e-3


# ----------------------------------------------------------------------- (b) MLA (DeepSeek-V2)

def _deepseek(num_layers=2, seed=0, **overrides) -> DeepseekV2ForCausalLM:
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=64, num_hidden_layers=num_layers, **overrides)
    return DeepseekV2ForCausalLM(cfg).eval()


def test_deepseek_v2_mla_equals_eager():
    pw = check_piecewise_equals_eager(_deepseek(num_layers=3, q_lora_rank=24), MLAHarness,
                                      page_size=4, rtol=1e-4, atol=1e-5)
    _assert_split(pw, 3)


def test_deepseek_v2_mla_equals_eager_with_inductor():
    pw = check_piecewise_equals_eager(_deepseek(), MLAHarness, inductor=True, page_size=1,
                                      rtol=1e-4, atol=1e-4)
    _assert_split(pw, 2)


# ----------------------------------------------------------------------- (c) KV sharing

class SharedKVAttention(LlamaAttention):
    """A Llama attention layer that reads ``target``'s KV cache and writes none of its own
    (``k = v = None``), as cross-layer KV sharing models call it; its k/v projections are unused.
    """

    def __init__(self, config, layer_id, rotary, target: int):
        super().__init__(config, layer_id, rotary)
        self.attn.kv_sharing_target_layer_id = target

    def forward(self, positions, hidden_states, forward_batch):
        q, k, _ = self.qkv_proj(hidden_states).split(
            [self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, _ = self.rotary_emb(positions, q.view(-1, self.hq, self.d), k.view(-1, self.hkv, self.d))
        return self.o_proj(self.attn(q.reshape(-1, self.hq * self.d), None, None, forward_batch))


def _kv_sharing_model(num_layers=4, shares=((2, 0), (3, 1))):
    """``tiny_model`` whose layer ``i`` reads layer ``target``'s cache for ``(i, target)``."""
    model = tiny_model(num_layers=num_layers)
    rotary = model.model.layers[0].self_attn.rotary_emb
    for i, target in shares:
        model.model.layers[i].self_attn = SharedKVAttention(model.config, i, rotary, target)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    return model


def test_kv_sharing_equals_eager_and_sharers_write_nothing():
    model = _kv_sharing_model()
    pw = check_piecewise_equals_eager(model)
    _assert_split(pw, 4)
    # the poisoned caches of the sharing layers 2 and 3 were never written (nor read: no NaN)
    h = _poison(Harness(model))
    with torch.no_grad():
        pw(*h.extend([0], [5]))
    for layer_id in (2, 3):
        assert h.kv_pool.get_key_buffer(layer_id).isnan().all()
        assert h.kv_pool.get_value_buffer(layer_id).isnan().all()
    assert not h.kv_pool.get_key_buffer(0)[h.req_pool.req_to_token[0, :5].long()].isnan().any()


# ----------------------------------------------------------------------- (d) window + softcap

def test_sliding_window_and_softcap_equals_eager():
    # Gemma2-like: alternating windows, attention and final logit softcaps, sandwich norms.
    model = tiny_model(num_layers=3, sliding_window=3, attn_logit_softcap=2.0,
                       final_logit_softcap=5.0, sandwich_norm=True,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    pw = check_piecewise_equals_eager(model, page_size=4)
    _assert_split(pw, 3)


# ----------------------------------------------------------------------- the op itself

def test_op_pads_with_zeros_and_attends_only_real_rows():
    """Rows >= num_tokens of ``output`` end zero (poisoned with NaN first); rows below equal the
    backend called directly; padding rows of q/k/v/sinks inputs are never read."""
    model = tiny_model(attention_sinks=True)
    h = Harness(model)
    layers = enable_split_op(model)
    ids, pos, fb = h.extend([0, 1], [3, 2])
    layer = layers[0]
    n, pad, hq, hkv, d = 5, 3, layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, heads * d, generator=gen) for heads in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen)
    nan_rows = lambda x: torch.cat([x, x.new_full((pad, x.shape[1]), math.nan)])  # noqa: E731
    output = torch.full((n + pad, hq * d), math.nan)
    with set_forward_context(layers, fb, num_tokens=n):
        torch.ops.xpu_ops.unified_attention_with_output(
            nan_rows(q), nan_rows(k), nan_rows(v), output, 0, sinks=sinks)
    ref = fb.attn_backend.forward(q, k.view(n, hkv, d), v.view(n, hkv, d), layer, fb, True,
                                  sinks=sinks)
    torch.testing.assert_close(output[:n], ref)
    assert (output[n:] == 0).all()


def test_op_save_kv_cache_false_writes_nothing():
    model = tiny_model()
    h = _poison(Harness(model))
    layers = enable_split_op(model)
    ids, pos, fb = h.decode([0])
    layer = layers[0]
    q = torch.randn(1, layer.tp_q_head_num * layer.head_dim)
    kv = torch.randn(1, layer.tp_k_head_num * layer.head_dim)
    with set_forward_context(layers, fb, num_tokens=1):
        unified_attention(layer, q, kv, kv, save_kv_cache=False)
    assert h.kv_pool.get_key_buffer(0).isnan().all()
    with set_forward_context(layers, fb, num_tokens=1):
        unified_attention(layer, q, kv, kv)
    assert not h.kv_pool.get_key_buffer(0)[fb.out_cache_loc].isnan().any()


def test_op_schema():
    schema = str(torch.ops.xpu_ops.unified_attention_with_output.default._schema)
    assert schema == ("xpu_ops::unified_attention_with_output(Tensor q, Tensor? k, Tensor? v, "
                      "Tensor(a!) output, int layer_id, Tensor? sinks=None, Tensor? q_rope=None, "
                      "Tensor? k_rope=None, bool save_kv_cache=True, Tensor? index_q=None, "
                      "Tensor? index_k=None, Tensor? index_weights=None) -> ()")


# ----------------------------------------------------------------------- checks (fake and real)

def _call(q, k, v, out, **kwargs):
    torch.ops.xpu_ops.unified_attention_with_output(q, k, v, out, 0, **kwargs)


Q = torch.zeros(2, 8)  # q of 2 tokens


@pytest.mark.parametrize("args,kwargs,match", [
    ((Q, Q, Q, torch.zeros(3, 8)), {}, r"output has shape \(3, 8\); expected \[tokens, Hq \* Dv\]"
                                       r" with tokens = q.shape\[0\] = 2"),
    ((Q, Q, Q, torch.zeros(2, 8, dtype=torch.float64)), {}, "output is torch.float64 .* expected"
                                                            " q's torch.float32"),
    ((Q, Q, None, torch.zeros(2, 8)), {}, "k and v must both be tensors or both be None .*; got "
                                          r"k=\w*Tensor, v=NoneType"),
    ((Q, None, None, torch.zeros(2, 8)), dict(k_rope=torch.zeros(2, 1, 2)),
     "k_rope is given but k is None"),
    ((Q, torch.zeros(3, 8), Q, torch.zeros(2, 8)), {}, r"k has shape \(3, 8\); expected "
                                                       r"\[tokens, ...\] with tokens = .* = 2"),
    ((Q, Q, Q, torch.zeros(2, 8)), dict(q_rope=torch.zeros(1, 4, 2)), r"q_rope has shape"),
    ((Q, Q, None, torch.zeros(2, 8)), dict(k_rope=torch.zeros(5, 1, 2)), r"k_rope has shape"),
    ((Q, Q, Q, torch.zeros(2, 8)), dict(sinks=torch.zeros(4, dtype=torch.int32)),
     r"sinks is torch.int32 of shape \(4,\); expected \[Hq\] in a float dtype"),
    ((Q, Q, Q, torch.zeros(2, 8)), dict(sinks=torch.zeros(2, 2)), r"sinks .* shape \(2, 2\)"),
], ids=["output_rows", "output_dtype", "kv_pair", "k_rope_without_k", "k_rows", "q_rope_rows",
        "k_rope_rows", "sinks_dtype", "sinks_ndim"])
@pytest.mark.parametrize("where", ["eager", "fake"])
def test_op_checks(args, kwargs, match, where):
    if where == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            args = [None if a is None else mode.from_tensor(a) for a in args]
            kwargs = {k: mode.from_tensor(v) for k, v in kwargs.items()}
            with pytest.raises(ValueError, match=match):
                _call(*args, **kwargs)
        return
    with pytest.raises(ValueError, match=match):
        _call(*args, **kwargs)  # checked before the forward context is read


def test_layer_rejects_keywords_the_split_op_cannot_carry():
    layer = PagedAttention(4, 8, 8 ** -0.5, 2, layer_id=0)
    layer.split_op = unified_attention
    with pytest.raises(TypeError, match=r"piecewise mode got keyword\(s\) \['qv'\] on layer 0; "
                                        r"expected only \['sinks', 'q_rope', 'k_rope', "
                                        r"'index_q', 'index_k', 'index_weights'\]"):
        layer(torch.zeros(1, 32), torch.zeros(1, 16), torch.zeros(1, 16), None,
              qv=torch.zeros(1, 4))
