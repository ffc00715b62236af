"""compile_kernels_xe without Intel's Triton: the kernels keep the two rules that let Triton 3.3
(``triton-xpu``) compile them, and the launch recorder finds the provider's launches, specialised
as a launch on a GPU that is not CUDA would be. The compilation itself needs
``scripts/with-xe-env.sh`` (see the script's docstring)."""

import ast
from pathlib import Path

import pytest
import torch

import compile_kernels_xe as xe

TRITON_DIR = Path(__file__).resolve().parents[2] / "xpu_ops" / "triton"


def _jit_functions():
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                yield path.name, node


def test_the_kernels_are_found():
    names = {fn.name for _, fn in _jit_functions()}
    assert {"_paged_attention_kernel", "_paged_attention_plain_kernel",
            "_merge_state_kernel"} <= names


def test_no_chained_boolean_operator_in_a_kernel():
    # Triton 3.3's front end rejects `A and B and C` (UnsupportedLanguageConstruct).
    chained = [f"{file}:{node.lineno} {ast.unparse(node)}" for file, fn in _jit_functions()
               for node in ast.walk(fn) if isinstance(node, ast.BoolOp) and len(node.values) > 2]
    assert chained == []


def test_descriptors_are_not_spelled_through_tl():
    # Triton 3.3 resolves every `tl.<name>` of a kernel while hashing it; it has no
    # make_tensor_descriptor, so the kernel spells it `triton.language.make_tensor_descriptor`.
    through_tl = [f"{file}:{node.lineno}" for file, fn in _jit_functions()
                  for node in ast.walk(fn)
                  if isinstance(node, ast.Attribute) and node.attr == "make_tensor_descriptor"
                  and isinstance(node.value, ast.Name) and node.value.id == "tl"]
    assert through_tl == []


# Small stand-ins for the script's full-size workloads (the recorder is shape-generic).
DECODE = {"decode": xe.AttentionCase(((1, 70), (1, 33)), page_size=16, hq=8, hkv=2, d=128,
                                     dtype=torch.bfloat16, causal=True)}
PREFILL = {"prefill": xe.AttentionCase(((40, 40),), page_size=16, hq=4, hkv=2, d=64,
                                       dtype=torch.bfloat16, causal=True)}


def _constant(source, launch, name):
    index = launch.kernel.arg_names.index(name)
    return source.constants.get((index,), source.constants.get(name))


def test_recorder_finds_the_launches_of_a_decode_and_a_merge():
    found, refused = xe.collect(["pvc"], ["merge_state_v2 sample 0", "decode"], DECODE)
    assert refused == []
    kernels = {launch.name for launch, _ in found.values()}
    # a decode takes the plain kernel by default, the general one under some path variants
    assert kernels in ({"_merge_state_kernel", "_paged_attention_plain_kernel"},
                       {"_merge_state_kernel", "_paged_attention_plain_kernel",
                        "_paged_attention_kernel"})
    for launch, labels in found.values():
        source, options = xe.source_of(launch)
        assert set(source.signature) == set(launch.kernel.arg_names)
        if launch.name == "_paged_attention_plain_kernel":
            assert source.signature["K"] == "*bf16" and "num_warps" in options
            assert _constant(source, launch, "D_PAD") == 128
    plain_labels = [label for launch, labels in found.values()
                    if launch.name == "_paged_attention_plain_kernel" for label in labels]
    assert "decode [default]" in plain_labels


def test_a_gpu_that_is_not_cuda_takes_no_tensor_descriptor():
    found, refused = xe.collect(["pvc"], ["prefill"], PREFILL)
    assert refused == []
    general = [(launch, labels) for launch, labels in found.values()
               if launch.name == "_paged_attention_kernel"]
    assert general, "the prefill took the general kernel"
    variants = {label.split("[")[1] for _, labels in general for label in labels}
    assert {"tma]", "tma_ws]", "default]"} <= variants  # each asked for, none refused
    for launch, _ in general:
        source, _ = xe.source_of(launch)
        assert _constant(source, launch, "TMA") is False
        assert _constant(source, launch, "WS") is False


def test_source_of_types_every_argument():
    found, _ = xe.collect(["pvc"], ["merge_state_v2 sample 0"])
    launch, _ = next(iter(found.values()))
    source, _ = xe.source_of(launch)
    tensors = [a for a in launch.args if isinstance(a, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert all(kind == "constexpr" or kind.startswith("*") or kind in ("i1", "i32", "i64", "fp32")
               for kind in source.signature.values())


@pytest.mark.parametrize("value,kind", [(3, "i32"), (2**31, "i64"), (True, "i1"), (0.5, "fp32")])
def test_scalar_kinds(value, kind):
    class Param:
        def __init__(self, name):
            self.name, self.is_constexpr, self.default = name, False, None

    class Kernel:
        arg_names = ["x"]
        params = [Param("x")]
        __name__ = "k"

    source, _ = xe.source_of(xe.Launch(Kernel(), (value,), ()))
    assert source.signature == {"x": kind}


def test_warp_specialize_only_in_a_taken_branch():
    # Triton 3.3's tl.range has no warp_specialize keyword: a kernel may name it only inside a
    # branch its constexpr removes elsewhere (`if WS:` ... `warp_specialize=True`), never as
    # `warp_specialize=WS` on the one loop every launch compiles.
    passed_through = [f"{file}:{node.lineno}" for file, fn in _jit_functions()
                      for node in ast.walk(fn) if isinstance(node, ast.keyword)
                      and node.arg == "warp_specialize"
                      and not (isinstance(node.value, ast.Constant) and node.value.value is True)]
    assert passed_through == []
