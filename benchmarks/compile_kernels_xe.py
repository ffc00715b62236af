"""Compile every Triton kernel launch of the XPU provider for Intel Xe targets, without an Intel GPU.

On an Intel GPU the Triton provider serves every call the native kernels decline, so each kernel
it can launch must lower for Xe. This script finds those launches by running the provider itself:
each op that has a Triton implementation is called with the samples of
``xpu_ops.testing.sample_inputs`` and with full-size workloads (``WORKLOADS``), its tensors moved
to the ``meta`` device (shapes and strides, no memory), once per kernel-path set (the defaults,
none, and each optional path alone). ``xpu_ops.triton._common.launch`` is replaced for the run by
a recorder, so the provider chooses tiles, splits, paths and constexprs as on a GPU that is not
CUDA (no tensor descriptors: the NVIDIA-only paths drop out as they do on XPU) and nothing runs.
Each distinct launch is then compiled with ``triton.compile`` for each target of ``TARGETS``
(Intel's Triton, ``triton-xpu``, whose ``intel`` backend turns TTIR into SPIR-V), and the script
reports per kernel: compiled or the first error, the SPIR-V size, and registers/spills where the
toolchain gives them (``ocloc``, when installed, compiles the SPIR-V to native code).

It needs Intel's Triton in place of the NVIDIA build: ``scripts/with-xe-env.sh`` installs it into
its own environment (PyPI and Debian packages only) and runs a command there:

    bash scripts/with-xe-env.sh python benchmarks/compile_kernels_xe.py --out xe-kernels

What a clean table proves: every launch the provider makes for these shapes passes Triton's Xe
front and middle end and SPIR-V generation for each target's device properties. What it does not:
that the SPIR-V compiles to native code without spills (only with ``ocloc``), that it runs, or
that it gives correct results or good speed on an Intel GPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, Optional
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import xpu_ops  # noqa: E402,F401  (registers the ops)
from xpu_ops import _registration, provider_table  # noqa: E402
from xpu_ops.testing import AttentionCase, attention_case_inputs, sample_inputs  # noqa: E402
from xpu_ops.triton import _common  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Device properties of each target, as the Intel backend reads them from a SYCL device;
# "architecture" is SYCL's ext_oneapi architecture id (device_architecture.def).
TARGETS = {
    "pvc": dict(name="Intel(R) Data Center GPU Max 1550", architecture=0x030F000700,
                gpu_eu_count=1024, gpu_subslice_count=128, max_work_group_size=1024,
                max_num_sub_groups=64, sub_group_sizes=[16, 32], has_fp64=True,
                has_subgroup_matrix_multiply_accumulate=True,
                has_subgroup_matrix_multiply_accumulate_tensor_float32=True,
                has_subgroup_2d_block_io=True, has_bfloat16_conversions=True),
    "bmg": dict(name="Intel(R) Arc(TM) B580 Graphics", architecture=0x0500400400,
                gpu_eu_count=160, gpu_subslice_count=20, max_work_group_size=1024,
                max_num_sub_groups=64, sub_group_sizes=[16, 32], has_fp64=False,
                has_subgroup_matrix_multiply_accumulate=True,
                has_subgroup_matrix_multiply_accumulate_tensor_float32=False,
                has_subgroup_2d_block_io=True, has_bfloat16_conversions=True),
    "dg2": dict(name="Intel(R) Arc(TM) A770 Graphics", architecture=0x030DC00800,
                gpu_eu_count=512, gpu_subslice_count=32, max_work_group_size=1024,
                max_num_sub_groups=128, sub_group_sizes=[8, 16, 32], has_fp64=False,
                has_subgroup_matrix_multiply_accumulate=True,
                has_subgroup_matrix_multiply_accumulate_tensor_float32=False,
                has_subgroup_2d_block_io=False, has_bfloat16_conversions=True),
}
# ocloc's name of each target's device; Debian's ocloc (intel-opencl-icd 22.43) predates Xe2.
OCLOC_DEVICES = {"pvc": "pvc", "dg2": "dg2-g10"}
# Xe cores of each target: the provider's split planning reads it as its "SM" count.
XE_CORES = {"pvc": 128, "bmg": 20, "dg2": 32}

_BF16, _E4M3 = torch.bfloat16, torch.float8_e4m3fn
# Full-size attention launches (fewer requests than the benchmarks: tiles, splits and
# constexprs depend on head sizes, page size, dtypes, flags and lengths, not on the batch).
WORKLOADS = {
    "decode 4x4096 page 16": AttentionCase(((1, 4096),) * 4, page_size=16, hq=32, hkv=8,
                                           d=128, dtype=_BF16, causal=True),
    "decode 1x32768 page 64 (split-KV)": AttentionCase(((1, 32768),), page_size=64, hq=32,
                                                       hkv=8, d=128, dtype=_BF16, causal=True),
    "decode 4x4096 page 1": AttentionCase(((1, 4096),) * 4, page_size=1, hq=32, hkv=8, d=128,
                                          dtype=_BF16, causal=True),
    "decode fp8 KV page 64": AttentionCase(((1, 4096),) * 4, page_size=64, hq=32, hkv=8, d=128,
                                           dtype=_BF16, kv_dtype=_E4M3, causal=True),
    "prefill 2x2048 page 64": AttentionCase(((2048, 2048),) * 2, page_size=64, hq=32, hkv=8,
                                            d=128, dtype=_BF16, causal=True),
    "prefill window 1023": AttentionCase(((2048, 2048),), page_size=64, hq=32, hkv=8, d=128,
                                         dtype=_BF16, causal=True, window=(1023, 0)),
    "extend 512 on 4096": AttentionCase(((512, 4608),) * 2, page_size=64, hq=32, hkv=8, d=128,
                                        dtype=_BF16, causal=True),
    "extend sinks softcap D 64": AttentionCase(((256, 1024),), page_size=16, hq=64, hkv=8, d=64,
                                               dtype=_BF16, causal=True, window=(127, 0),
                                               softcap=30.0, sinks=True),
    "MLA extend (qv) D 64 + 512": AttentionCase(((128, 2048),), page_size=64, hq=16, hkv=1,
                                                d=64, dv=512, qv=True, dtype=_BF16,
                                                causal=True),
}
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.float64: "fp64", torch.int32: "i32", torch.int64: "i64", torch.int8: "i8",
          torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
          torch.float8_e5m2: "fp8e5"}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the provider made it: the kernel and its bound arguments."""
    kernel: object
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def path_variants() -> dict[str, Optional[frozenset]]:
    """Kernel-path sets to run each call under: the defaults, none, and each optional path."""
    variants: dict[str, Optional[frozenset]] = {"default": None, "none": frozenset()}
    variants.update({name: frozenset({name}) for name in _common.OPTIONAL_PATHS})
    return variants


def calls(workloads: dict[str, AttentionCase], only: list[str]
          ) -> Iterator[tuple[str, str, tuple, dict]]:
    """``(label, op, args, kwargs)`` of every call to record whose label holds one of ``only``
    (all when empty): each op's samples (they cover its feature flags) and the attention
    ``workloads``."""
    def wanted(label: str) -> bool:
        return not only or any(s in label for s in only)

    for op, impls in sorted(provider_table._registry.items()):
        if "triton" not in impls:
            continue
        packet = getattr(torch.ops.xpu_ops, op)
        for i, (args, kwargs) in enumerate(sample_inputs(packet, "cpu")):
            if wanted(f"{op} sample {i}"):
                yield f"{op} sample {i}", op, args, kwargs
    for label, case in workloads.items():
        if wanted(label):
            yield (label, "flash_attn_with_kvcache", *attention_case_inputs(case, "cpu"))


def record(op: str, args: tuple, kwargs: dict, paths: Optional[frozenset], cores: int
           ) -> list[Launch]:
    """The launches the Triton provider of ``op`` makes for this call on a non-CUDA GPU."""
    seen: list[Launch] = []

    def recorder(kernel, grid, device, *largs, **lkwargs):
        seen.append(Launch(kernel, largs, tuple(sorted(lkwargs.items()))))

    modules = [m for name, m in sys.modules.items()
               if name.startswith("xpu_ops.triton.") and getattr(m, "launch", None) is _common.launch]
    # as the op's dispatcher kernel gets them: bound to the schema's positions, then its checks,
    # which may normalise some (the provider gets what they return, e.g. broadcast descales)
    args, kwargs = _bind(op, args, kwargs)
    replaced = _registration.DEFINED[f"xpu_ops::{op}"].fn(*args, **kwargs)
    args = args if replaced is None else replaced
    fn = provider_table._registry[op]["triton"].fn
    with _recording(modules, recorder, paths, cores):
        fn(*_to_meta(args), **_to_meta(kwargs))
    return seen


def _bind(op: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` as the dispatcher passes them to the op's kernel: every argument that
    is not keyword-only by position, defaults filled in."""
    schema = getattr(torch.ops.xpu_ops, op).default._schema
    positional, keyword = list(args), {}
    for arg in schema.arguments[len(args):]:
        value = kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None)
        if arg.kwarg_only:
            keyword[arg.name] = value
        else:
            positional.append(value)
    return tuple(positional), keyword


class _recording:
    """Replace ``launch`` in each module by ``recorder``, the enabled paths by ``paths`` and the
    multiprocessor count by ``cores`` for the duration of a ``with`` block."""

    def __init__(self, modules, recorder, paths, cores):
        self._patches = [mock.patch.object(m, "launch", recorder) for m in modules]
        self._patches += [mock.patch.object(_common, "ENABLED_PATHS", paths),
                          mock.patch.object(_common, "_num_sms", lambda *a: cores)]

    def __enter__(self):
        for p in self._patches:
            p.start()

    def __exit__(self, *exc):
        for p in reversed(self._patches):
            p.stop()


def source_of(launch: Launch) -> tuple[ASTSource, dict]:
    """The ``ASTSource`` and compile options of a launch, specialised as Triton's launcher would
    (16-byte aligned pointers; ints divisible by 16; ``None`` and constexpr parameters baked in)."""
    kernel = launch.kernel
    options = {}
    bound = dict(zip(kernel.arg_names, launch.args))
    for name, value in launch.kwargs:
        if name in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
            options[name] = value
        else:
            bound[name] = value
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = bound.get(param.name, param.default)
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and value != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: argument {param.name} of type "
                            f"{type(value).__name__} has no Triton type")
    return ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), options


def native_resources(spv: bytes, device: Optional[str]) -> str:
    """GRF registers, spill bytes and instruction count of the native kernel that ``ocloc``
    (Debian's intel-opencl-icd) compiles from ``spv`` for ``device``, read from the assembly
    IGC dumps; or why there is none."""
    if device is None:
        return "native: no ocloc device for this target"
    if shutil.which("ocloc") is None:
        return "native: ocloc not installed"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.spv")
        with open(src, "wb") as f:
            f.write(spv)
        env = dict(os.environ, IGC_ShaderDumpEnable="1",
                   IGC_DumpToCustomDir=os.path.join(tmp, "dump"))
        run = subprocess.run(["ocloc", "compile", "-file", src, "-spirv_input", "-device", device,
                              "-output_no_suffix", "-output", os.path.join(tmp, "kernel")],
                             capture_output=True, text=True, env=env)
        if run.returncode != 0:
            lines = [x for x in (run.stdout + run.stderr).splitlines() if x.strip()]
            return f"native: ocloc exit {run.returncode}: {' | '.join(lines[-2:])[:200]}"
        text = "".join(open(path).read() for path in glob.glob(os.path.join(tmp, "dump",
                                                                         "*_simd*.asm")))
    grf = re.findall(r"numGRF=(\d+)", text)
    spill = re.findall(r"//\.spill size (\d+)", text)
    count = re.findall(r"//\.instCount (\d+)", text)
    return (f"native {device}: GRF {'/'.join(grf) or '?'}, spill {sum(map(int, spill))} B, "
            f"{'/'.join(count) or '?'} instructions")


def compile_launch(launch: Launch, target: str, native: bool = True) -> dict:
    """Compile one launch for one target: ``{"ok", "spv_bytes", "native", "error"}``; with
    ``native``, also to the target's native code where ``ocloc`` knows it."""
    try:
        src, options = source_of(launch)
        compiled = triton.compile(src, target=GPUTarget("xpu", TARGETS[target], 32),
                                  options=options)
        spv = compiled.asm["spv"]
        return {"ok": True, "spv_bytes": len(spv),
                "native": native_resources(spv, OCLOC_DEVICES.get(target)) if native else "",
                "error": ""}
    except Exception as e:  # report and go on: the point is to list them all
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return {"ok": False, "spv_bytes": 0, "native": "",
                "error": f"{type(e).__name__}: {(lines[-1] if lines else '')[:300]}"}


def launch_key(launch: Launch) -> tuple:
    """What makes two launches compile to the same binary: kernel, specialised signature,
    constexprs, options."""
    src, options = source_of(launch)
    return (launch.name, tuple(sorted(src.signature.items())),
            tuple(sorted((str(k), repr(v)) for k, v in src.constants.items())),
            tuple(sorted(src.attrs)), tuple(sorted(options.items())))


def collect(targets: list[str], only: list[str],
            workloads: Optional[dict[str, AttentionCase]] = None) -> tuple[dict, list[str]]:
    """Distinct launches per target: ``{(target, key): (launch, [call labels])}`` of the calls
    whose label holds one of ``only`` (all when empty), and the calls the provider itself
    refused (their errors). ``workloads`` defaults to ``WORKLOADS``."""
    found: dict = {}
    refused: list[str] = []
    for label, op, args, kwargs in calls(WORKLOADS if workloads is None else workloads, only):
        for variant, paths in path_variants().items():
            for target in targets:
                try:
                    launches = record(op, args, kwargs, paths, XE_CORES[target])
                except Exception as e:
                    refused.append(f"{label} [{variant}] {target}: {type(e).__name__}: "
                                   f"{str(e).strip().splitlines()[-1][:200]}")
                    continue
                for launch in launches:
                    key = (target, launch_key(launch))
                    found.setdefault(key, (launch, []))[1].append(f"{label} [{variant}]")
    return found, refused


def constexpr_summary(launch: Launch) -> str:
    src, options = source_of(launch)
    shown = {k: v for k, v in src.constants.items() if v is not None and
             (isinstance(k, str) and k.isupper())}
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) + (
        f", num_warps={options['num_warps']}" if "num_warps" in options else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help=f"comma list of {sorted(TARGETS)} (default: all)")
    ap.add_argument("--only", default="", help="comma list of call-label substrings")
    ap.add_argument("--out", default="", help="folder for results.json and results.md")
    ap.add_argument("--no-native", action="store_true",
                    help="SPIR-V only: skip ocloc's native compilation (the slow part)")
    args = ap.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        ap.error(f"--targets: {unknown} unknown; expected names from {sorted(TARGETS)}")
    if "intel" not in triton.backends.backends:
        print("compile_kernels_xe: the installed Triton has no 'intel' backend; run it through "
              "scripts/with-xe-env.sh (Intel's Triton, triton-xpu).", file=sys.stderr)
        return 2
    only = [s for s in args.only.split(",") if s]
    found, refused = collect(targets, only)
    rows = []
    for (target, _), (launch, labels) in found.items():
        result = compile_launch(launch, target, native=not args.no_native)
        rows.append({"target": target, "kernel": launch.name, "constexprs":
                     constexpr_summary(launch), "calls": len(labels), "first_call": labels[0],
                     **result})
        status = "ok  " if result["ok"] else "FAIL"
        print(f"{target:4s} {status} {launch.name:34s} spv {result['spv_bytes']:7d} B  "
              f"{result['native'] or result['error']}  ({labels[0]}; {len(labels)} calls)",
              flush=True)
    failed = sum(not r["ok"] for r in rows)
    counts = collections.Counter((r["target"], r["ok"]) for r in rows)
    print(f"compile_kernels_xe: {len(rows)} distinct launches, {failed} failed to compile; "
          f"{len(refused)} calls refused by the provider; triton {triton.__version__}; "
          + ", ".join(f"{t}: {counts[(t, True)]} ok / {counts[(t, False)]} failed"
                      for t in targets))
    for line in refused:
        print("refused:", line)
    if args.out:
        write_results(args.out, rows, refused, targets)
    return 1 if failed or refused else 0


def write_results(out: str, rows: list[dict], refused: list[str], targets: list[str]) -> None:
    """``results.json`` (every row) and ``results.md`` (a table per target) under ``out``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"triton": triton.__version__, "torch": torch.__version__,
                   "targets": {t: TARGETS[t]["name"] for t in targets}, "rows": rows,
                   "refused": refused}, f, indent=1)
    lines = [f"Intel Xe offline compilation (triton-xpu {triton.__version__}, "
             f"torch {torch.__version__}); command: "
             f"`bash scripts/with-xe-env.sh python benchmarks/compile_kernels_xe.py`", ""]
    for target in targets:
        mine = sorted((r for r in rows if r["target"] == target), key=lambda r: r["kernel"])
        ok = sum(r["ok"] for r in mine)
        lines += [f"### {TARGETS[target]['name']} ({target}): {ok} of {len(mine)} launches "
                  f"compile", "", "| kernel | constexprs | result | SPIR-V bytes | calls |",
                  "|---|---|---|---:|---:|"]
        lines += [f"| {r['kernel']} | {r['constexprs']} | "
                  f"{'ok' + (' ' + r['native'] if r['native'] else '') if r['ok'] else r['error']}"
                  f" | {r['spv_bytes']} | {r['calls']} |" for r in mine]
        lines.append("")
    if refused:
        lines += ["Calls the provider refused:", ""] + [f"- {line}" for line in refused]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
