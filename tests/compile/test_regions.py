"""``compile.graphs.regions``: every decoder layer is one ``invoke_subgraph``; identical layers share one
subgraph (compiled once), each layer kind gets its own; compiled == eager; split-op layers stay
inline for the piecewise split; the functionalization backport handles mutable custom ops.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._inductor.compile_fx import compile_fx

from compile.graphs import regions
from compile.graphs.forward_context import set_forward_context
from compile.backend.layer import reading_bound_kv
from compile.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from compile.graphs.split_op import enable_split_op
from tests.compile.compile_helpers import (Harness, MLAHarness, SWAHarness, pool_buffers,
                                          tiny_model)

pytestmark = pytest.mark.skipif(not regions.supported(),
                                reason="torch without usable nested_compile_region")


@pytest.fixture
def regions_on():
    """Regions are opt-in: the test runs inside ``layer_regions()`` (torch restored after) and
    ``reading_bound_kv()`` (bound layers read their buffers while traced, as in
    ``compile_model``)."""
    with regions.layer_regions(), reading_bound_kv():
        yield

MIXED = dict(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4)
# (kind, rows, extend lens): prefill past the sliding window, then decode twice (2 compiles).
STEPS = (("extend", [0, 1, 2], [6, 1, 9]), ("decode", [0, 1, 2], None),
         ("decode", [0, 1, 2], None))


class Recorder:
    """Backend that keeps each Dynamo graph, then compiles it with ``compiler``."""

    def __init__(self, compiler=aot_eager):
        self.graphs, self.compiler = [], compiler

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.compiler(gm, example_inputs)

    def subgraphs(self) -> list[str]:
        """The subgraph each ``invoke_subgraph`` node of the first graph calls, in order."""
        return [node.args[0].target for node in self.graphs[0].graph.nodes
                if node.target is torch.ops.higher_order.invoke_subgraph]


def _check_equals_eager(model, harness, backend, rtol=1e-4, atol=1e-5):
    """Run STEPS through ``torch.compile(model, backend)`` and eager on the same batches."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for kind, rows, lens in STEPS:
        ids, pos, fb = harness.extend(rows, lens) if kind == "extend" else harness.decode(rows)
        with torch.no_grad():
            out = compiled(ids, pos, fb)
            ref = model(ids, pos, fb)  # rewrites the same K/V slots with the same values
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_identical_layers_share_one_subgraph(regions_on):
    num_layers = 3
    model = tiny_model(num_layers)
    rec = Recorder()
    _check_equals_eager(model, Harness(model), rec)
    # one invoke_subgraph per layer, all calling one body
    assert len(rec.subgraphs()) == num_layers
    assert len(set(rec.subgraphs())) == 1


def test_sliding_and_full_layers_get_one_subgraph_each_and_inductor_equals_eager(regions_on):
    model = tiny_model(4, **MIXED)
    rec = Recorder(compile_fx)
    _check_equals_eager(model, Harness(model), rec)
    subgraphs = rec.subgraphs()
    assert len(subgraphs) == 4
    # layer kinds alternate (sliding, full, ...): 2 bodies, each shared by its 2 layers
    assert subgraphs[0] == subgraphs[2] != subgraphs[1] == subgraphs[3]


def test_regions_off_gives_no_subgraph(regions_on):
    model = tiny_model(2)
    rec = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(regions, "LAYER_REGIONS", False)
        _check_equals_eager(model, Harness(model), rec)
    assert rec.subgraphs() == []


def test_split_op_layers_stay_inline_for_the_piecewise_split(regions_on):
    model = tiny_model(2)
    h = Harness(model)
    layers = enable_split_op(model)
    rec = Recorder()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rec, fullgraph=True)
    ids, pos, fb = h.decode([0, 1, 2])
    with set_forward_context(layers, fb, num_tokens=3, graph_size=None), torch.no_grad():
        compiled(ids, pos, fb)
    assert rec.subgraphs() == []
    split_ops = [n for n in rec.graphs[0].graph.nodes
                 if "unified_attention_with_output" in str(n.target)]
    assert len(split_ops) == 2  # one per layer, at top level where split_graph finds them


def test_deepseek_v2_mla_layers_share_one_subgraph(regions_on):
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(vocab_size=64, num_hidden_layers=3,
                                                   q_lora_rank=24)).eval()
    rec = Recorder()
    _check_equals_eager(model, MLAHarness(model), rec)
    assert len(rec.subgraphs()) == 3 and len(set(rec.subgraphs())) == 1


# A mutable custom op, as the KV store is: the region mutates its input through it.
_lib = torch.library.Library("test_regions", "DEF")  # noqa: TOR901
_lib.define("add_into(Tensor(a!) dst, Tensor x) -> ()")


def _add_into(dst, x):
    dst.add_(x)


_lib.impl("add_into", _add_into, "CompositeExplicitAutograd")
_lib._register_fake("add_into", lambda dst, x: None)


@torch.compiler.nested_compile_region
def _mutating_region(dst, x):
    torch.ops.test_regions.add_into(dst, x)
    return x * 2


def test_region_that_mutates_input_through_custom_op(regions_on):
    def f(bufs, x):
        for buf in bufs:
            x = _mutating_region(buf, x)
        return x

    torch._dynamo.reset()
    x = torch.randn(4)
    bufs, ref_bufs = [torch.zeros(4) for _ in range(3)], [torch.zeros(4) for _ in range(3)]
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(bufs, x)
    torch.testing.assert_close(out, f(ref_bufs, x))
    for buf, ref in zip(bufs, ref_bufs):  # each region call wrote its own buffer
        torch.testing.assert_close(buf, ref)



def test_regions_are_opt_in_and_torch_is_restored():
    from torch._higher_order_ops.auto_functionalize import FunctionalCallableWithEpilogue
    original = FunctionalCallableWithEpilogue.__call__
    needs_backport = regions._epilogue_class() is not None
    assert not regions.LAYER_REGIONS                     # off by default
    with regions.layer_regions():
        assert regions.LAYER_REGIONS
        patched = FunctionalCallableWithEpilogue.__call__
        assert (patched is not original) == needs_backport
        with regions.layer_regions(False):               # nested: flag off, patch kept
            assert not regions.LAYER_REGIONS
            assert FunctionalCallableWithEpilogue.__call__ is patched
        assert regions.LAYER_REGIONS
    assert not regions.LAYER_REGIONS
    assert FunctionalCallableWithEpilogue.__call__ is original


# ------------------------------------------------ reusable regions (docs/regions_reuse.md)

def _compiled_step_equals_eager(model, harness, backend, bind: bool, context: bool,
                                kind: str = "decode"):
    """One ``kind`` (decode or extend) step, compiled vs eager from the same KV cache: logits
    and every layer's K/V buffers afterwards equal."""
    pool = harness.kv_pool
    if bind:
        assert pool.bind_layers(model) == model.config.num_hidden_layers
    harness.extend([0, 1, 2], [5, 3, 7])
    ids, pos, fb = (harness.decode([0, 1, 2]) if kind == "decode"
                    else harness.extend([0, 1, 2], [2, 4, 1]))
    bufs = pool_buffers(pool)
    with torch.no_grad():
        for b in bufs:
            b.normal_()
        start = [b.clone() for b in bufs]
        ref = model(ids, pos, fb)
        after_eager = [b.clone() for b in bufs]
        for b, s in zip(bufs, start):
            b.copy_(s)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        ctx = (set_forward_context({}, fb, num_tokens=ids.shape[0]) if context
               else contextlib.nullcontext())
        with ctx:
            out = compiled(ids, pos, fb)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for i, (b, e) in enumerate(zip(bufs, after_eager)):  # each layer wrote its own buffers
        torch.testing.assert_close(b, e, rtol=1e-4, atol=1e-5, msg=f"KV buffer {i}")


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_bound_kv_and_forward_context_let_dynamo_reuse_the_layer_trace(regions_on, stamp_outs,
                                                                       kind):
    model = tiny_model(4)
    rec = Recorder()
    _compiled_step_equals_eager(model, Harness(model), rec, bind=True, context=True, kind=kind)
    assert stamp_outs[0] == 3                      # layer 0 traced, layers 1-3 stamped out
    assert len(rec.subgraphs()) == 4 and len(set(rec.subgraphs())) == 1


def test_reuse_keeps_one_trace_per_layer_kind(regions_on, stamp_outs):
    model = tiny_model(4, **MIXED)
    rec = Recorder(compile_fx)
    _compiled_step_equals_eager(model, Harness(model), rec, bind=True, context=True)
    assert stamp_outs[0] == 2                      # sliding and full traced once each
    subgraphs = rec.subgraphs()
    assert subgraphs[0] == subgraphs[2] != subgraphs[1] == subgraphs[3]


@pytest.mark.parametrize("bind, context", [(False, True), (True, False)])
def test_without_bound_kv_or_context_every_layer_is_traced(regions_on, stamp_outs, bind,
                                                           context):
    model = tiny_model(3)
    _compiled_step_equals_eager(model, Harness(model), aot_eager, bind=bind, context=context)
    assert stamp_outs[0] == 0


def test_bind_layers_rejects_bad_input():
    model = tiny_model(2)
    pool = Harness(model).kv_pool
    with pytest.raises(TypeError, match="nn.Module"):
        pool.bind_layers(object())
    model.model.layers[1].self_attn.attn.kv_sharing_target_layer_id = 5
    with pytest.raises(ValueError, match="expected a layer id in"):
        pool.bind_layers(model)


@pytest.mark.parametrize("compiled", [False, True])
def test_context_with_another_batch_is_rejected(regions_on, compiled):
    model = tiny_model(2)
    h = Harness(model)
    h.kv_pool.bind_layers(model)
    ids, pos, fb = h.decode([0, 1])
    _, _, other = h.decode([2])
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    with set_forward_context({}, other, num_tokens=1), torch.no_grad():
        with pytest.raises(Exception, match="another ForwardBatch") as err:
            run(ids, pos, fb)
    if not compiled:
        assert err.type is ValueError


def test_reusable_regions_do_not_recompile_for_each_new_batch(regions_on):
    from torch._dynamo.testing import CompileCounterWithBackend
    model = tiny_model(2)
    h = Harness(model)
    h.kv_pool.bind_layers(model)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    run = torch.compile(model, backend=counter, fullgraph=True)
    h.extend([0, 1, 2], [3, 3, 3])
    frames = []
    for _ in range(5):  # a new ForwardBatch (and context) every step, as a server makes them
        ids, pos, fb = h.decode([0, 1, 2])
        with set_forward_context({}, fb, num_tokens=3), torch.no_grad():
            run(ids, pos, fb)
        frames.append(counter.frame_count)
    assert frames[-1] == frames[1]  # after the dynamic-shape recompile, none per batch


# ------------------------------------------- reusable regions over hybrid SWA and MLA pools

def _deepseek(num_layers: int = 3):
    torch.manual_seed(0)
    return DeepseekV2ForCausalLM(DeepseekV2Config(vocab_size=64, num_hidden_layers=num_layers,
                                                  q_lora_rank=24)).eval()


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_reuse_over_a_hybrid_swa_pool(regions_on, stamp_outs, kind):
    model = tiny_model(4, **MIXED)
    rec = Recorder()
    _compiled_step_equals_eager(model, SWAHarness(model), rec, bind=True, context=True,
                                kind=kind)
    assert stamp_outs[0] == 2                      # 4 layers - 2 kinds (sliding, full)
    subgraphs = rec.subgraphs()
    assert subgraphs[0] == subgraphs[2] != subgraphs[1] == subgraphs[3]


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_reuse_over_an_mla_pool(regions_on, stamp_outs, kind):
    model = _deepseek(3)
    rec = Recorder()
    _compiled_step_equals_eager(model, MLAHarness(model), rec, bind=True, context=True,
                                kind=kind)
    assert stamp_outs[0] == 2                      # layer 0 traced, layers 1-2 stamped out
    assert len(rec.subgraphs()) == 3 and len(set(rec.subgraphs())) == 1


def test_swa_and_mla_bind_layers_bind_thepool_buffers():
    model = tiny_model(4, **MIXED)
    pool = SWAHarness(model).kv_pool
    assert pool.bind_layers(model) == 4
    for i, layer in enumerate(model.model.layers):
        attn, sliding = layer.self_attn.attn, i % 2 == 0
        inner = pool.swa_kv_pool if sliding else pool.full_kv_pool
        assert attn.bound_kv_is_swa is sliding
        assert attn.bound_k_buffer is inner.k_buffer[i // 2]
        assert attn.bound_v_buffer is inner.v_buffer[i // 2]
    shared = model.model.layers[3].self_attn.attn   # cross-layer KV sharing: layer 1's cache
    shared.kv_sharing_target_layer_id = 1
    pool.bind_layers(model)
    assert shared.bound_k_buffer is pool.full_kv_pool.k_buffer[0] and not shared.bound_kv_is_swa
    mla = _deepseek(2)
    pool = MLAHarness(mla).kv_pool
    assert pool.bind_layers(mla) == 2
    for i, layer in enumerate(mla.model.layers):
        attn = layer.self_attn.attn
        assert attn.bound_k_buffer is pool.kv_buffer[i] and attn.bound_v_buffer is None
        assert not attn.bound_kv_is_swa


@pytest.mark.parametrize("make", [lambda: (tiny_model(4, **MIXED), SWAHarness),
                                  lambda: (_deepseek(2), MLAHarness)],
                         ids=["swa", "mla"])
def test_swa_and_mla_bind_layers_reject_bad_input(make):
    model, harness = make()
    pool = harness(model).kv_pool
    with pytest.raises(TypeError, match="nn.Module"):
        pool.bind_layers(object())
    attn = model.model.layers[1].self_attn.attn
    attn.kv_sharing_target_layer_id = 5
    with pytest.raises(ValueError, match=r"bind_layers: layer 1 reads KV layer 5; expected a "
                                         r"layer id in .*, got 5"):
        pool.bind_layers(model)
    assert model.model.layers[0].self_attn.attn.bound_k_buffer is None  # all or nothing


def _replace_mha(pool):
    pool.v_buffer[1] = pool.v_buffer[1].clone()


def _replace_swa(pool):
    pool.swa_kv_pool.k_buffer[0] = pool.swa_kv_pool.k_buffer[0].clone()


def _replace_mla(pool):
    pool.kv_buffer[1] = pool.kv_buffer[1].clone()


@pytest.mark.parametrize("make, replace", [
    (lambda: (tiny_model(2), Harness), _replace_mha),
    (lambda: (tiny_model(4, **MIXED), SWAHarness), _replace_swa),
    (lambda: (_deepseek(2), MLAHarness), _replace_mla)], ids=["mha", "swa", "mla"])
def test_is_bound_detects_stale_bindings(make, replace):
    model, harness = make()
    pool = harness(model).kv_pool
    assert not pool.is_bound(model)                # nothing bound yet
    pool.bind_layers(model)
    assert pool.is_bound(model)
    assert not harness(model).kv_pool.is_bound(model)  # bound to another pool's buffers
    replace(pool)                                  # the pool re-allocated one buffer
    assert not pool.is_bound(model)
    pool.bind_layers(model)
    assert pool.is_bound(model)
    assert not pool.is_bound(torch.nn.Linear(2, 2))  # no PagedAttention at all
    with pytest.raises(TypeError, match="is_bound: model must be an nn.Module"):
        pool.is_bound(object())


def test_swa_is_bound_checks_which_pool():
    model = tiny_model(4, **MIXED)
    pool = SWAHarness(model).kv_pool
    pool.bind_layers(model)
    model.model.layers[0].self_attn.attn.bound_kv_is_swa = False   # right buffers, wrong pool
    assert not pool.is_bound(model)
