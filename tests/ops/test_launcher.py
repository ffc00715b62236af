"""``BoundLaunch`` (xpu_ops/triton/launcher.py): argument assembly on the CPU interpreter, and on
a GPU the fast re-launch path against ``kernel[grid](...)`` for the same arguments, including a
change of the slot tensors' alignment (which must select a separately specialised kernel)."""

from __future__ import annotations

import weakref

import pytest

from .triton_mode import INTERPRETED, tl, triton  # first: Triton in interpreter mode

import torch  # noqa: E402

from xpu_ops.triton.launcher import BoundLaunch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else None


@triton.jit
def _axpy_kernel(X, Y, OUT, alpha, n, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    y = tl.load(Y + offs, mask=mask, other=0.0)
    r = alpha * x + y
    if SQUARE:
        r = r * r
    tl.store(OUT + offs, r, mask=mask)


def _bound(device, n, square=False):
    return BoundLaunch(_axpy_kernel, (triton.cdiv(n, 16),), torch.device(device),
                       [None, None, None, 0.5, n], dict(BLOCK=16, SQUARE=square), slots=(0, 1, 2))


def test_missing_constexpr_is_a_type_error():
    with pytest.raises(TypeError, match=r"needs \['SQUARE'\] in meta"):
        BoundLaunch(_axpy_kernel, (1,), torch.device("cpu"), [None] * 5, dict(BLOCK=16), (0,))


def test_too_many_positional_arguments_is_a_type_error():
    with pytest.raises(TypeError, match="8 positional arguments"):
        BoundLaunch(_axpy_kernel, (1,), torch.device("cpu"), [None] * 8, {}, (0,))


@pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile mode first")
@pytest.mark.parametrize("square", [False, True])
def test_cpu_interpreter_fills_slots_per_call(monkeypatch, square):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    n = 37
    run = _bound("cpu", n, square)
    for seed in range(3):  # the same object re-launched with new tensors each time
        gen = torch.Generator().manual_seed(seed)
        x, y = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        out = torch.full((n,), float("nan"))
        run(x, y, out)
        want = (0.5 * x.double() + y.double())
        want = want * want if square else want
        torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device")
def test_gpu_fast_path_matches_normal_launch_across_alignments():
    n = 1000
    run = _bound(DEVICE, n)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    base_x = torch.randn(n + 3, device=DEVICE, generator=gen)
    base_y = torch.randn(n + 3, device=DEVICE, generator=gen)
    for offset in (0, 0, 1, 1, 0, 2):  # aligned, then misaligned views (another specialisation)
        x, y = base_x[offset:offset + n], base_y[offset:offset + n]
        out = torch.full((n + 3,), float("nan"), device=DEVICE)[offset:offset + n]
        run(x, y, out)
        want = torch.empty_like(out)
        _axpy_kernel[(triton.cdiv(n, 16),)](x, y, want, 0.5, n, BLOCK=16, SQUARE=False)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(out.double(), 0.5 * x.double() + y.double(), atol=1e-5,
                                   rtol=1e-5)
    assert len(run._compiled) == 2  # one kernel per alignment class of the slot tensors


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device")
def test_gpu_fast_path_passes_addresses_of_fixed_and_slot_tensors():
    n = 300
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    y = torch.randn(n, device=DEVICE, generator=gen)
    bound = _bound(DEVICE, n).bind({1: y}, slots=(0, 2))
    assert bound._fast and bound._ptrs[1] == y.data_ptr()
    for _ in range(3):  # first launch through the JIT, then the compiled kernel's launcher
        x = torch.randn(n, device=DEVICE, generator=gen)
        out = torch.full((n,), float("nan"), device=DEVICE)
        bound(x, out)
        torch.testing.assert_close(out.double(), 0.5 * x.double() + y.double(), atol=1e-5,
                                   rtol=1e-5)
    with pytest.raises(ValueError, match="argument 0 is a host tensor"):
        bound(torch.randn(n), out)
    host_fixed = _bound(DEVICE, n).bind({1: y.cpu()}, slots=(0, 2))
    assert not host_fixed._fast  # the normal path, whose launcher rejects host memory


def test_bind_fixes_tensors_and_rejects_scalars(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not INTERPRETED:
        pytest.skip("Triton was imported in compile mode first")
    n = 20
    run = _bound("cpu", n)
    y = torch.randn(n)
    bound = run.bind({1: y}, slots=(0, 2))  # y fixed, x and out per call
    assert bound._families is run._families
    x, out = torch.randn(n), torch.full((n,), float("nan"))
    bound(x, out)
    torch.testing.assert_close(out, 0.5 * x + y)
    # Compiled kernels are shared by launches whose fixed tensors Triton would specialise the
    # same way (dtype, 16-byte alignment), never across a different fixed dtype or alignment.
    assert run.bind({1: torch.randn(n)}, slots=(0, 2))._compiled is bound._compiled
    misaligned = torch.randn(n + 1)[1:]
    assert run.bind({1: misaligned}, slots=(0, 2))._compiled is not bound._compiled
    assert run.bind({1: y.double()}, slots=(0, 2))._compiled is not bound._compiled
    # A call's slot tensors are not kept alive by the launch.
    dropped = torch.randn(n)
    ref = weakref.ref(dropped)
    bound(dropped, out)
    del dropped
    assert ref() is None
    with pytest.raises(TypeError, match="fixed argument 3 is float"):
        run.bind({3: 0.25}, slots=(0, 1, 2))
    with pytest.raises(ValueError, match=r"slots \[5\] are not positions of the 5"):
        run.bind({1: y}, slots=(0, 5))
    # A bound launch of a bound launch: the meta-parameters and grid carry over.
    again = bound.bind({0: x}, slots=(2,))
    assert (again.grid, again.meta, again.slots) == (run.grid, run.meta, (2,))
    out2 = torch.full((n,), float("nan"))
    again(out2)
    torch.testing.assert_close(out2, 0.5 * x + y)


def test_construction_and_call_checks():
    with pytest.raises(ValueError, match=r"grid must be 1 to 3 ints >= 0, got \(4\.7,\)"):
        BoundLaunch(_axpy_kernel, (4.7,), torch.device("cpu"), [None] * 5,
                    dict(BLOCK=16, SQUARE=False), (0,))
    with pytest.raises(ValueError, match=r"slots \[7\] are not positions"):
        BoundLaunch(_axpy_kernel, (1,), torch.device("cpu"), [None] * 5,
                    dict(BLOCK=16, SQUARE=False), (0, 7))
    run = _bound("cpu", 8)
    with pytest.raises(TypeError, match=r"takes 3 tensors \(slots \[0, 1, 2\]\), got 1"):
        run(torch.zeros(8))
