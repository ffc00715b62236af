"""Inductor graph passes of the piecewise backend: ``ResidualAddmmPass``.

Why: on GPUs Inductor turns ``h + x @ w`` into ``aten.addmm(h, x, w)`` unless every user of the
sum is pointwise (``torch/_inductor/fx_passes/post_grad.py``: ``addmm`` pattern,
``should_prefer_unfused_addmm``). In a piece the residual stream ``h`` after a layer's MLP is a
piece output (the next layer's attention residual reads it in the next piece), so that add
becomes an ``addmm``; the ``addmm`` is then a non-pointwise user of the residual before it, so the
attention output projection's add becomes one too. Each ``addmm`` with a full-size input runs a
device-to-device copy of the residual into its output and a GEMM with ``beta = 1``; at decode
shapes cuBLAS picks split-K kernels for those that stream the weights at about half the rate of
the ``beta = 0`` kernels (H200 kernel profile, b = 1: the down projection's pair took
17 us for 33.5 MB, the gate/up GEMM 17.8 us for 67 MB). A whole-model graph (the dense peer) has
no piece outputs, so it keeps the plain ``mm``.

``ResidualAddmmPass`` turns every ``addmm(inp, a, b)`` whose ``inp`` has the output's full shape
(a residual, not a bias row), with ``alpha = beta = 1``, back into ``mm(a, b) + inp``. The add then
fuses into its consumer (the next RMSNorm's reduction, which also writes the sum) or becomes one
pointwise kernel in place of the copy. Bias rows (``[N]`` or ``[1, N]``) keep their ``addmm``.
Installed through Inductor's public ``post_grad_custom_post_pass`` option (``config_patches`` of
``compile_fx``), which runs after Inductor's own pattern passes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

# Bump when the pass's effect changes: Inductor's FX-graph cache keys on it (``uuid``).
_VERSION = "residual-addmm-1"


def unfuse_residual_addmm(graph: fx.Graph) -> int:
    """Rewrite each full-size-input ``addmm`` of ``graph`` as ``mm + add`` (module docstring).

    Returns:
        the number of ``addmm`` nodes rewritten.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> f = lambda h, x, w, b: (torch.addmm(h, x, w), torch.addmm(b, x, w))
    >>> args = (torch.randn(2, 4), torch.randn(2, 3), torch.randn(3, 4), torch.randn(4))
    >>> gm = make_fx(f, tracing_mode="fake")(*args)
    >>> unfuse_residual_addmm(gm.graph)  # the residual one; the bias row keeps its addmm
    1
    >>> _ = gm.recompile()
    >>> torch.allclose(gm(*args)[0], f(*args)[0])
    True
    """
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        inp, mat1, mat2 = node.args[:3]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            continue
        val, inp_val = node.meta.get("val"), _meta(inp)
        if val is None or inp_val is None or tuple(inp_val.shape) != tuple(val.shape):
            continue  # a bias row (broadcast): cuBLAS adds it in its epilogue, no copy
        if inp_val.dtype != val.dtype:
            continue
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (mat1, mat2))
            mm.meta.update(node.meta)
            mm.meta["val"] = aten.mm.default(mat1.meta["val"], mat2.meta["val"])
            mm.meta["original_aten"] = aten.mm.default
            add = graph.call_function(aten.add.Tensor, (mm, inp))
            add.meta.update(node.meta)
            add.meta["original_aten"] = aten.add.Tensor  # kernels' "Original ATen" comments
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _meta(x: Any) -> Optional[torch.Tensor]:
    return x.meta.get("val") if isinstance(x, fx.Node) else None


class ResidualAddmmPass(CustomGraphPass):
    """``unfuse_residual_addmm`` as an Inductor ``post_grad_custom_post_pass`` (what
    ``piece_config_patches`` installs)."""

    def __call__(self, graph: fx.Graph) -> None:
        unfuse_residual_addmm(graph)

    def uuid(self) -> Any:
        return _VERSION


def piece_config_patches(device: torch.device, unfuse_addmm: Optional[bool] = None) -> dict:
    """Inductor ``config_patches`` for a piece compiled for ``device``: the residual ``addmm``
    pass where ``unfuse_addmm`` (None: on GPUs, where Inductor fuses them; the CPU's ``addmm``
    adds the residual inside its GEMM call)."""
    if unfuse_addmm is None:
        unfuse_addmm = device.type in ("cuda", "xpu")
    if not unfuse_addmm:
        return {}
    return {"post_grad_custom_post_pass": ResidualAddmmPass()}


__all__ = ["ResidualAddmmPass", "unfuse_residual_addmm", "piece_config_patches"]
