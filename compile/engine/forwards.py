"""The callable an engine runs per ``--mode``: ``make_forward(model, mode)``.

Shared by ``python -m compile generate`` and its disaggregated roles
(``compile.engine.cli_disagg``), which build their own engines in each process.
"""

from __future__ import annotations

from typing import Callable

from compile.graphs import compile_model, compile_piecewise, full_and_piecewise

MODES = ("eager", "compile", "piecewise", "graphs", "full_and_piecewise")  # the last: an alias


def _backend(inductor: bool) -> str:
    return "inductor" if inductor else "eager"


# mode -> (model, inductor) -> forward. Compiled modes turn dynamic after their first recompile.
FORWARDS: dict[str, Callable] = {
    "eager": lambda model, inductor: model,
    "compile": lambda model, inductor: compile_model(model, backend=_backend(inductor)),
    "piecewise": lambda model, inductor: compile_piecewise(model, inductor=inductor),
    "graphs": lambda model, inductor: full_and_piecewise(model, inductor=inductor),
    "full_and_piecewise": lambda model, inductor: full_and_piecewise(model, inductor=inductor),
}


def make_forward(model, mode: str, *, inductor: bool = True) -> Callable:
    """The callable the engine runs for ``--mode`` (see ``FORWARDS``).

    Args:
        model: the zoo model. mode: one of ``MODES``.
        inductor: False compiles with the ``eager`` backend instead (Dynamo traces, no Inductor;
            fast smoke runs). Device graphs are captured on CUDA/XPU either way.
    Raises:
        ValueError: ``mode`` is not one of ``MODES`` (the CLI's choices check it first).
    """
    if mode not in FORWARDS:
        raise ValueError(f"make_forward: mode is unknown; expected one of {', '.join(MODES)}, "
                         f"got {mode!r}.")
    return FORWARDS[mode](model, inductor)


__all__ = ["MODES", "FORWARDS", "make_forward"]
