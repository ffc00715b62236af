"""Piecewise mode: forward context, split op, graph split, per-piece compile, capture (``gpu``).

The tiny zoo Llama's ``PagedAttention`` layers take the split op (``use_split_op``, set by
``enable_split_op``), so the splitter runs on the real model structure and backend.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from compile import device as dev
from compile.forward_context import get_forward_context, has_forward_context, set_forward_context
from compile.piecewise import PiecewiseModel, compile_piecewise, split_graph
from compile.split_op import enable_split_op
from tests.compile.compile_helpers import Harness, fx_op_sequence, tiny_model


def _eager(model, layers, ids, pos, fb):
    """The model with its layers back on the backend directly (no split op)."""
    for layer in layers.values():
        layer.use_split_op = False
    try:
        with torch.no_grad():
            return model(ids, pos, fb)
    finally:
        for layer in layers.values():
            layer.use_split_op = True


class TestForwardContext(TestCase):
    def test_read_outside_scope_raises(self):
        self.assertFalse(has_forward_context())
        with self.assertRaisesRegex(RuntimeError, "no forward context is set"):
            get_forward_context()

    def test_nesting_restores(self):
        with set_forward_context({}, None, 4, graph_size=8) as outer:
            with set_forward_context({}, None, 2):
                self.assertEqual(get_forward_context().num_tokens, 2)
            self.assertIs(get_forward_context(), outer)
        self.assertFalse(has_forward_context())

    def test_split_op_outside_context_raises(self):
        q = torch.zeros(2, 8)
        with self.assertRaisesRegex(RuntimeError, "no forward context"):
            torch.ops.xpu_ops.unified_attention_with_output(q, q, q, torch.zeros(2, 8), 0)

    def test_split_op_rejects_bad_output(self):
        q = torch.zeros(2, 8)
        with self.assertRaisesRegex(ValueError, "output has shape"):
            torch.ops.xpu_ops.unified_attention_with_output(q, q, q, torch.zeros(3, 8), 0)

    def test_split_op_schema(self):
        schema = str(torch.ops.xpu_ops.unified_attention_with_output.default._schema)
        self.assertExpectedInline(schema, """xpu_ops::unified_attention_with_output(Tensor q, Tensor k, Tensor v, Tensor(a!) output, int layer_id) -> ()""")


class TestSplit(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_split_op_matches_backend_and_zeroes_padding(self):
        model = tiny_model()
        h = Harness(model)
        layers = enable_split_op(model)
        ids, pos, fb = h.decode([0, 1, 2])
        ref = _eager(model, layers, ids, pos, fb)
        pad = 5  # 3 real tokens padded to 5, as a captured bucket would be
        ids_p = torch.cat([ids, ids.new_zeros(pad - 3)])
        pos_p = torch.cat([pos, pos.new_zeros(pad - 3)])
        with set_forward_context(layers, fb, num_tokens=3, graph_size=None), torch.no_grad():
            out = model(ids_p, pos_p, fb)
        torch.testing.assert_close(out[:3], ref, rtol=1e-5, atol=1e-6)

    def test_split_count_and_identical_pieces_compile_once(self):
        num_layers = 3
        model = tiny_model(num_layers=num_layers)
        h = Harness(model)
        pw = compile_piecewise(model, inductor=False)
        ids, pos, fb = h.extend([0, 1], [6, 3])
        out = pw(ids, pos, fb)
        torch.testing.assert_close(out, _eager(model, pw.layers, ids, pos, fb))
        stats = pw.backend.stats
        self.assertEqual(stats["graphs"], 1)
        self.assertEqual(stats["pieces"], num_layers + 1)  # num_layers + 1 pieces
        self.assertEqual(stats["split_ops"], num_layers)  # one attention submodule per layer
        # first piece (embedding), one shared middle piece (num_layers - 1 identical), last
        self.assertEqual(stats["compiles"], 3)
        self.assertEqual(stats["captures"], 0)  # CPU: no capture
        split_gm = pw.backend.split_gms[0]
        self.assertExpectedInline(fx_op_sequence(split_gm), """\
call_module submod_0
call_function getitem
call_function getitem
call_function getitem
call_function getitem
call_function getitem
call_module submod_1
call_module submod_2
call_function getitem
call_function getitem
call_function getitem
call_function getitem
call_function getitem
call_module submod_3
call_module submod_4
call_function getitem
call_function getitem
call_function getitem
call_function getitem
call_function getitem
call_module submod_5
call_module submod_6""")
        attention = [name for name, sub in split_gm.named_children()
                     if "unified_attention_with_output" in str(sub.code)]
        self.assertEqual(attention, ["submod_1", "submod_3", "submod_5"])

    def test_split_graph_keeps_order(self):
        def f(x, out):
            y = x.sin()
            torch.ops.xpu_ops.unified_attention_with_output(y, y, y, out, 0)
            z = out.cos() + y
            torch.ops.xpu_ops.unified_attention_with_output(z, z, z, out, 1)
            return out * 2

        gm = torch.fx.symbolic_trace(f)
        split_gm, items = split_graph(gm)
        self.assertEqual([(i.name, i.is_split) for i in items],
                         [("submod_0", False), ("submod_1", True), ("submod_2", False),
                          ("submod_3", True), ("submod_4", False)])

    def test_decode_and_extend_equal_eager_with_inductor(self):
        model = tiny_model()
        h = Harness(model)
        pw = compile_piecewise(model)  # Inductor pieces
        for kind, rows, lens in (("extend", [0, 1, 2], [5, 2, 7]), ("decode", [0, 1, 2], None),
                                 ("decode", [0, 1], None)):
            ids, pos, fb = h.extend(rows, lens) if kind == "extend" else h.decode(rows)
            with torch.no_grad():
                out = pw(ids, pos, fb)
            torch.testing.assert_close(out, _eager(model, pw.layers, ids, pos, fb),
                                       rtol=1e-4, atol=1e-5)
        # extend graph: first, middle and last pieces; decode graph: only its last piece is new
        self.assertEqual(pw.backend.stats["compiles"], 3 + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not dev.supports_graphs(dev.as_device()), reason="needs CUDA/XPU graphs")
class TestPiecewiseCapture(TestCase):
    def test_capture_replay_equals_eager_with_stable_buffers(self):
        device = dev.as_device()
        model = tiny_model(device=device)
        h = Harness(model, device=device)
        pw = PiecewiseModel(model, graph_sizes=(4, 8), debug=True)
        with torch.no_grad():  # prefill: an extend step runs the pieces uncaptured
            pw(*h.extend([0, 1, 2, 3, 4], [5, 9, 3, 17, 2]))
        outputs = {}
        for step, rows in enumerate([[0, 1, 2], [0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2],
                                     [0, 1, 2, 3, 4], [3, 1], [0, 1, 2, 3, 4]]):
            ids, pos, fb = h.decode(rows)  # seq_lens grow every step
            with torch.no_grad():
                out = pw(ids, pos, fb)
            torch.testing.assert_close(out, _eager(model, pw.layers, ids, pos, fb),
                                       rtol=1e-4, atol=1e-4)
            for i, runner in enumerate(pw.compiled_pieces()):
                for size, (_, _, piece_out) in runner.graphs.items():
                    ptrs = [t.data_ptr() for t in piece_out if isinstance(t, torch.Tensor)]
                    self.assertEqual(outputs.setdefault((i, size), ptrs), ptrs)  # fixed
        self.assertEqual(len(outputs), 2 * (2 + 1))
        # buckets 4 and 8 used; every piece captured once per bucket: 2 * (num_layers + 1)
        self.assertEqual(pw.backend.stats["captures"], 2 * (2 + 1))


@pytest.mark.parametrize("kwargs", [dict(sinks=torch.zeros(4)), dict(k_rope=torch.zeros(1, 1, 2))],
                         ids=["sinks", "mla"])
def test_split_mode_rejects_what_the_split_op_cannot_carry(kwargs):
    from compile.layer import PagedAttention
    layer = PagedAttention(4, 8, 8 ** -0.5, 2, layer_id=0)
    layer.use_split_op = True
    with pytest.raises(NotImplementedError, match="piecewise mode .* does not support"):
        layer(torch.zeros(1, 32), torch.zeros(1, 16), torch.zeros(1, 16), None, **kwargs)
