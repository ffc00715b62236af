"""Whole-model ``torch.compile`` of a zoo Llama over the real ``XPUAttentionBackend`` (CPU).

No graph breaks (``fullgraph=True``), recompiles counted across token/request/cache counts,
compiled (Inductor) == eager, one decoder layer's op sequence as an inline snapshot, and the
whole model traced with fake tensors on device ``xpu``.
"""

from __future__ import annotations

import torch
from expecttest import TestCase
from torch._dynamo.testing import CompileCounter
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from compile.backend.backend_graph import _set_path
from compile.models import rope
from tests.compile.compile_helpers import Harness, fx_op_sequence, tiny_model


def _run(fn, harness, kind, rows, lens=None):
    ids, pos, fb = harness.extend(rows, lens) if kind == "extend" else harness.decode(rows)
    with torch.no_grad():
        return fn(ids, pos, fb), (ids, pos, fb)


class TestWholeModelCompile(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_fullgraph_and_recompile_counts(self):
        model = tiny_model()
        h = Harness(model)
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, fullgraph=True)  # raises on a break
        # Warm-up: each mode (extend, decode) compiles static, then once more with automatic
        # dynamic shapes when its sizes first change: 2 modes * 2 frames.
        _run(compiled, h, "extend", [0, 1, 2], [5, 3, 7])
        _run(compiled, h, "decode", [0, 1, 2])
        _run(compiled, h, "extend", [3, 4], [4, 6])
        _run(compiled, h, "decode", [0, 1, 2, 3, 4])
        self.assertEqual(counter.frame_count, 2 * 2)
        # New token, request and cache counts (all >= 2): no recompile.
        _run(compiled, h, "decode", [0, 1])
        _run(compiled, h, "extend", [5, 6, 7], [2, 2, 9])
        _run(compiled, h, "decode", [7, 6, 5, 4, 3, 2])
        _run(compiled, h, "extend", [8, 0], [11, 3])  # request 0 with a cached prefix
        self.assertEqual(counter.frame_count, 4)
        # A single request specialises size 1 (Dynamo's 0/1 rule): one recompile per mode.
        _run(compiled, h, "decode", [5])
        _run(compiled, h, "decode", [2])
        self.assertEqual(counter.frame_count, 4 + 1)
        _run(compiled, h, "extend", [9], [3])
        self.assertEqual(counter.frame_count, 4 + 2)
        self.assertEqual(counter.op_count > 0, True)

    def test_inductor_equals_eager(self):
        model = tiny_model()
        h = Harness(model)
        compiled = torch.compile(model, fullgraph=True)  # Inductor
        for kind, rows, lens in (("extend", [0, 1, 2], [5, 1, 7]), ("decode", [0, 1, 2], None),
                                 ("decode", [0, 1, 2], None)):
            out, (ids, pos, fb) = _run(compiled, h, kind, rows, lens)
            with torch.no_grad():
                ref = model(ids, pos, fb)  # rewrites the same K/V slots with the same values
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)

    def test_decoder_layer_op_sequence(self):
        model = tiny_model()
        h = Harness(model)
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm

        layer = torch.compile(model.model.layers[0], backend=capture, fullgraph=True)
        ids, pos, fb = h.decode([0, 1])
        with torch.no_grad():
            layer(pos, model.model.embed_tokens(ids), fb)
        self.assertEqual(len(graphs), 1)
        self.assertExpectedInline(fx_op_sequence(graphs[0]), """\
call_method float
call_method pow
call_method mean
call_function add
call_function rsqrt
call_function mul
call_method to
call_function mul
call_function linear
call_method split
call_function getitem
call_function getitem
call_method view
call_function getitem
call_method to
call_method unsqueeze
call_function getitem
call_method to
call_method unsqueeze
call_function mul
call_method chunk
call_function getitem
call_function getitem
call_function neg
call_function cat
call_function mul
call_function add
call_method split
call_function getitem
call_function getitem
call_method reshape
call_method reshape
call_method reshape
call_function xpu_ops.store_kv_cache
call_method reshape
call_method new_empty
call_method view
call_method view
call_function xpu_ops.flash_attn_with_kvcache.default
call_method view
call_function linear
call_function add
call_method float
call_method pow
call_method mean
call_function add
call_function rsqrt
call_function mul
call_method to
call_function mul
call_function linear
call_method chunk
call_function getitem
call_function getitem
call_function silu
call_function mul
call_function linear
call_function add""")

    def test_whole_model_traces_with_fake_tensors_on_xpu(self):
        model = tiny_model()
        h = Harness(model)
        ids, pos, fb = h.decode([0, 1, 2], init=False)
        h.backend.init_forward_metadata(fb)  # host plan on real tensors, then everything fake
        mode = FakeTensorMode()
        xpu = torch.device("xpu")

        def fake(t):
            return FakeTensor(mode, t.to("meta"), xpu)

        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                        module._parameters[name] = torch.nn.Parameter(fake(p.detach()),
                                                                  requires_grad=False)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = fake(b)
        h.kv_pool.k_buffer = [fake(t) for t in h.kv_pool.k_buffer]
        h.kv_pool.v_buffer = [fake(t) for t in h.kv_pool.v_buffer]
        meta = h.backend.forward_metadata
        for name, t in list(meta.tensors()):
            _set_path(meta, name, fake(t))
        fids, fpos = fake(ids), fake(pos)
        seen = []

        class Spy(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "xpu_ops":
                    seen.append(func.__name__)
                return func(*args, **(kwargs or {}))

        # Tensor[index_tensor] cannot run on fake xpu tensors in a torch built without XPU
        # ("not linked with support for xpu devices"); index_select is the same math.
        def angles_at(self, positions, dtype=None):
            cos = self.cos_cached.index_select(0, positions)
            sin = self.sin_cached.index_select(0, positions)
            if dtype is not None:
                cos, sin = cos.to(dtype), sin.to(dtype)
            return cos.unsqueeze(1), sin.unsqueeze(1)

        original = rope._AngleTables.angles_at
        rope._AngleTables.angles_at = angles_at
        try:
            with mode, Spy(), torch.no_grad():
                logits = model(fids, fpos, fb)
        finally:
            rope._AngleTables.angles_at = original
        self.assertIsInstance(logits, FakeTensor)
        self.assertEqual((logits.device.type, tuple(logits.shape)), ("xpu", (3, 64)))
        # num_layers * (store_kv_cache, flash_attn_with_kvcache)
        self.assertEqual(seen, ["store_kv_cache.default", "flash_attn_with_kvcache.default"] * 2)
