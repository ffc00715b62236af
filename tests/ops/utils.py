"""Helpers shared by the op tests: sample caching, cloning, fake tensors, tolerances, providers."""

from __future__ import annotations

import functools
import re
from typing import Optional

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
from torch.utils._pytree import tree_map

from xpu_ops import providers
from xpu_ops.testing import REGISTERED_OPS, op_name, sample_inputs

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")
# Output tolerances against the float64 oracle, by output dtype: about 4 ulp of the dtype at 1
# for the low-precision ones (outputs are rounded once), float32 accumulation for float32.
OUT_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
           torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
# LSE is float32 for every dtype; low-precision inputs are exact in the oracle, so only the
# accumulation order differs (looser for bf16/fp16 in case a provider dots in that dtype).
LSE_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=1e-3),
           torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@functools.lru_cache(maxsize=None)
def _samples(name: str) -> list:
    return list(sample_inputs(name, "cpu"))


def sample_indices(op) -> range:
    """Indices of ``op``'s CPU samples (``xpu_ops.testing.sample_inputs``), for parametrize."""
    return range(len(_samples(op_name(op))))


def reseeded_sample(op, index: int, seed: int) -> tuple:
    """Positional args of sample ``index`` of ``op`` drawn with ``seed``: the same shapes and
    flags as the default draw, fresh values (each test index seeds its own)."""
    args, _ = list(sample_inputs(op, "cpu", seed=seed))[index]
    return args


def sample_ids(op) -> list[str]:
    """Test ids ``<op>-<index>`` of every sample of ``op``."""
    return [f"{op_name(op)}-{i}" for i in range(len(_samples(op_name(op))))]


def all_sample_params() -> list:
    """``pytest.param(op, index)`` for every sample of every registered op."""
    return [pytest.param(op, i, id=f"{op_name(op)}-{i}") for op in REGISTERED_OPS
            for i in range(len(_samples(op_name(op))))]


def clone(x):
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def sample(op, index: int) -> tuple[tuple, dict]:
    """A fresh copy of sample ``index`` of ``op`` (safe to mutate)."""
    return clone(_samples(op_name(op))[index])


def has_fp8(args) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in FP8 for t in args)


def mutated_arg_names(op) -> set[str]:
    schema = op.default._schema
    return {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def arg_names(op) -> list[str]:
    return [a.name for a in op.default._schema.arguments]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads included; works for fp8 on CPU)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    def dense(t):  # a stride-0 [1] tensor counts as contiguous, but cannot be viewed as bytes
        return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    return torch.equal(dense(a).view(torch.uint8), dense(b).view(torch.uint8))


def fake_like(mode: FakeTensorMode, t, dynamic_dims=(), device: Optional[str] = None):
    """A fake copy of ``t`` in ``mode``; ``dynamic_dims`` get symbolic sizes (needs a ShapeEnv);
    ``device`` puts it on another device (e.g. ``"xpu"``, which needs no hardware when fake)."""
    if not isinstance(t, torch.Tensor):
        return t
    ctx = None
    if mode.shape_env is not None:
        ctx = StatelessSymbolicContext(dynamic_sizes=[
            DimDynamic.DYNAMIC if d in dynamic_dims else DimDynamic.STATIC
            for d in range(t.dim())])
    fake = mode.from_tensor(t, symbolic_context=ctx)
    if device is None:
        return fake
    with mode:
        return torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=device)


def runnable_providers(op: str, device: str = "cpu") -> list:
    """``pytest.param(name)`` for every provider of ``op``, skipped with the registry's reason
    when it cannot run on ``device`` (the reference always runs)."""
    return [pytest.param(name, id=name, marks=() if reason is None else pytest.mark.skip(
        reason=f"{name}: {reason}")) for name, reason in providers.candidates(op, device)]


def assert_matches_oracle(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                          lse: Optional[torch.Tensor] = None,
                          expected_lse: Optional[torch.Tensor] = None) -> None:
    """``out`` (and ``lse``) against the float64 oracle within the tolerance of ``dtype``;
    rows the oracle says are empty must be exactly 0 / -inf."""
    assert not out.isnan().any(), "output holds NaN (unwritten rows or garbage leaked in)"
    torch.testing.assert_close(out.double(), expected, **OUT_TOL[dtype])
    if lse is not None:
        torch.testing.assert_close(lse.double(), expected_lse, **LSE_TOL[dtype])
        empty = torch.isneginf(expected_lse)
        assert torch.isneginf(lse[empty]).all()


def case_id(case) -> str:
    """A readable test id for an ``AttentionCase``."""
    flags = [f"ps{case.page_size}", f"h{case.hq}/{case.hkv}", f"d{case.d}"]
    flags += [f"dv{case.dv}"] if case.dv else []
    flags += [str(case.dtype).split(".")[1]]
    flags += ["causal"] * case.causal + [f"w{case.window}".replace(" ", "")] * (
        case.window != (-1, -1))
    flags += ["softcap"] * (case.softcap > 0) + ["sinks"] * case.sinks + ["qv"] * case.qv
    if case.kv_dtype is not None:
        flags.append("kv_" + str(case.kv_dtype).split(".")[1])
    flags += ["q_fp8"] * case.q_fp8
    return "-".join(flags)


def assert_named_error(call, kwargs, fake, fn: str, exc: type, match: str) -> None:
    """``call(**kwargs)`` raises ``exc`` whose message starts ``"<fn>: "`` and matches ``match``;
    with ``fake``, on fake tensors, and then exactly as the eager call does (same checks)."""
    msg = error_message(call, kwargs, fake)
    assert msg.startswith(f"{exc.__name__}: {fn}: ") and re.search(match, msg), msg
    if fake:
        assert msg == error_message(call, kwargs, False)


def error_message(call, kwargs, fake) -> str:
    """The message ``call(**kwargs)`` raises, eagerly or with every tensor fake."""
    if fake:
        mode = FakeTensorMode()
        kwargs = {k: fake_like(mode, v) for k, v in kwargs.items()}
        with mode, pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
            call(**kwargs)
    else:
        with pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
            call(**kwargs)
    return f"{error_kind(info.value)}: {info.value}"


def error_kind(error: BaseException) -> str:
    """The builtin exception type a house error is (``ValueError`` for ``XpuOpsValueError``,
    which is also a ``RuntimeError``): the first builtin class in its MRO."""
    return next(c.__name__ for c in type(error).__mro__ if c.__module__ == "builtins")


def implemented(provider: str, op) -> bool:
    """``provider`` has an implementation of ``op`` (on some device; ``python -m xpu_ops info``
    lists the op families that have not reached a provider yet)."""
    return dict(providers.candidates(op_name(op), "cpu")).get(provider) != \
        "no implementation of this op"


def skip_if_unimplemented(provider: str, op) -> None:
    """Skip a generic per-op test for a provider that has no implementation of ``op``."""
    if not implemented(provider, op):
        pytest.skip(f"{op_name(op)} has no {provider} implementation")
