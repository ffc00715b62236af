"""``compile/graphs/inductor_passes.py``: the residual ``addmm`` pass on FX graphs, inside an
Inductor compile (its code calls ``mm``, never ``addmm``, for a residual add) and in a
piecewise model (logits equal eager)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compile.graphs.inductor_passes import (ResidualAddmmPass, piece_config_patches,
                                            unfuse_residual_addmm)
from compile.graphs.piecewise import PiecewiseModel
from tests.compile.compile_helpers import Harness, eager_without_split_op, tiny_model
from tests.markers import GPU_DEVICE


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("m", [1, 5])
def test_residual_addmm_becomes_mm_plus_add(m):
    def f(h, x, w):
        return torch.addmm(h, x, w)
    args = (torch.randn(m, 6, dtype=torch.float64), torch.randn(m, 4, dtype=torch.float64),
            torch.randn(4, 6, dtype=torch.float64))
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert unfuse_residual_addmm(gm.graph) == 1
    gm.recompile()
    aten = torch.ops.aten
    assert _targets(gm) == [aten.mm.default, aten.add.Tensor]
    torch.testing.assert_close(gm(*args), args[0] + args[1] @ args[2], rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", ["bias_row", "bias_2d_row", "beta", "alpha"])
def test_bias_rows_and_scaled_addmm_are_kept(case):
    x, w = torch.randn(3, 4), torch.randn(4, 6)
    inp = {"bias_row": torch.randn(6), "bias_2d_row": torch.randn(1, 6)}.get(case,
                                                                            torch.randn(3, 6))
    kw = {"beta": dict(beta=0.5), "alpha": dict(alpha=2.0)}.get(case, {})
    gm = make_fx(lambda i, a, b: torch.addmm(i, a, b, **kw), tracing_mode="fake")(inp, x, w)
    assert unfuse_residual_addmm(gm.graph) == 0
    assert torch.ops.aten.addmm.default in _targets(gm)


def test_inductor_code_with_the_pass_calls_mm_not_addmm():
    # On the CPU Inductor fuses h + x @ w into addmm (its GPU rule keeps it only where a user
    # of the sum is not pointwise, e.g. a piece output); the pass undoes it on any device.
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    def f(h, x, w):
        s = h + x @ w
        return s, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    args = [torch.randn(2, 8), torch.randn(2, 16), torch.randn(16, 8)]
    ref = f(*args)
    codes = {}
    for on in (False, True):
        torch._dynamo.reset()
        gm = make_fx(f)(*args)
        patches = {"post_grad_custom_post_pass": ResidualAddmmPass()} if on else {}
        with config.patch(force_disable_caches=True):
            out, code = run_and_get_code(
                lambda: compile_fx(gm, args, config_patches=patches)(*args))
        torch.testing.assert_close(out, list(ref), rtol=1e-5, atol=1e-5)
        codes[on] = "\n".join(code)
    assert "addmm" in codes[False]  # what the pass exists for (else this test checks nothing)
    assert "addmm" not in codes[True] and "mm(" in codes[True]  # comments included


def test_piece_config_patches_by_device():
    assert piece_config_patches(torch.device("cpu")) == {}
    assert piece_config_patches(torch.device("cpu"), unfuse_addmm=False) == {}
    for patches in (piece_config_patches(torch.device("cuda")),
                    piece_config_patches(torch.device("cpu"), unfuse_addmm=True)):
        assert isinstance(patches["post_grad_custom_post_pass"], ResidualAddmmPass)
    assert ResidualAddmmPass().uuid() == ResidualAddmmPass().uuid()  # cacheable


def test_piecewise_with_the_pass_equals_eager():
    torch._dynamo.reset()
    model = tiny_model()
    h = Harness(model)
    pw = PiecewiseModel(model, unfuse_addmm=True)
    assert pw.backend.config_patches  # forced on the CPU
    steps = (lambda: h.extend([0, 1], [5, 3]), lambda: h.decode([0, 1]), lambda: h.decode([1]))
    for make_step in steps:  # each builds the backend's metadata: one at a time
        ids, pos, fb = make_step()
        with torch.no_grad():
            out = pw(ids, pos, fb)
        ref = eager_without_split_op(model, pw.layers, ids, pos, fb)
        assert not ref.isnan().any()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.gpu
@pytest.mark.skipif(GPU_DEVICE is None, reason="needs a CUDA or XPU device")
def test_gpu_piece_shape_residual_goes_through_mm(m):
    # The decode piece's shape of the problem: the residual sum is a graph output and feeds a
    # norm, so Inductor's GPU rule fuses it into addmm; with the pass the code calls mm only.
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    def f(h, x, w):
        s = h + x @ w
        return s, (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6))
    dev, bf16 = GPU_DEVICE, torch.bfloat16
    args = [torch.randn(m, 256, device=dev, dtype=bf16),
            torch.randn(m, 512, device=dev, dtype=bf16),
            torch.randn(512, 256, device=dev, dtype=bf16)]
    codes = {}
    for on in (False, True):
        torch._dynamo.reset()
        gm = make_fx(f)(*args)
        patches = piece_config_patches(torch.device(dev), unfuse_addmm=on)
        with config.patch(force_disable_caches=True):
            out, code = run_and_get_code(
                lambda: compile_fx(gm, args, config_patches=patches)(*args))
        ref = f(*args)
        torch.testing.assert_close(out[0], ref[0], rtol=2e-2, atol=2e-2)
        codes[on] = "\n".join(code)
    # the GEMM calls themselves (kernels' "Original ATen" comments also name their origins)
    assert "extern_kernels.addmm" in codes[False]  # Inductor's GPU rule (else nothing to do)
    assert "extern_kernels.addmm" not in codes[True] and "extern_kernels.mm" in codes[True]
