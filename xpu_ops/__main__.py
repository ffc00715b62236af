"""``python -m xpu_ops info``: the devices, and for each op the provider chosen and why."""

from __future__ import annotations

import argparse
import sys
import textwrap

import torch

from . import REGISTERED_OPS, providers


DESCRIPTION = ("Print the devices and, for each operator, the provider a call would run "
               "(sgl_kernel, triton or reference) and why the preferred ones were skipped.")
WIDTH = 100  # columns of the reasons printed under each device


def describe_choice(op: str, device_type: str, forced, notes: dict | None = None) -> str:
    """``-> provider`` plus why higher-priority providers were skipped, or the error a call
    would raise when the forced provider cannot run there.

    With ``notes`` (reason -> number, filled here), a skip is written as ``provider [n]`` and
    its reason is printed once per device under the op table (``info``)."""
    rows = providers.candidates(op, device_type)
    if forced is not None:
        why = dict(rows)[forced]
        return (f"-> {forced} (forced)" if why is None
                else f"-> error: forced provider {forced} cannot run on {device_type}: {why}")
    chosen = next((name for name, why in rows if why is None), None)
    if chosen is None:
        return "-> error: no provider can run here"
    rank = providers.PROVIDER_ORDER.index(chosen)
    skipped = [(name, why) for name, why in rows
               if why is not None and providers.PROVIDER_ORDER.index(name) < rank]
    if notes is None:
        text = "; ".join(f"{name}: {why}" for name, why in skipped)
    else:
        text = ", ".join(f"{name} [{notes.setdefault(f'{name}: {why}', len(notes) + 1)}]"
                         for name, why in skipped)
    return f"-> {chosen}" + (f"   (skipped {text})" if text else "")


def _devices() -> list[str]:
    found = ["cpu"]
    for name in ("cuda", "xpu"):
        module = getattr(torch, name, None)
        if module is not None and module.is_available():
            found.append(name)
    return found


def info(device_types: list[str], out=sys.stdout) -> None:
    """Print versions, the forced provider, and per device and op the chosen provider and why
    every higher-priority provider was skipped; then the fallbacks recorded in this process."""
    import importlib.util
    triton = "installed" if importlib.util.find_spec("triton") else "not installed"
    print(f"torch {torch.__version__}; triton {triton}; provider order "
          f"{', '.join(providers.PROVIDER_ORDER)}", file=out)
    forced = providers.forced_provider()
    if forced:
        print(f"forced provider: {forced} (XPU_OPS_PROVIDER or use_provider)", file=out)
    available = _devices()
    for device_type in device_types:
        note = "" if device_type in available else " (not available in this process)"
        print(f"\ndevice {device_type}{note}:", file=out)
        notes: dict[str, int] = {}
        for packet in REGISTERED_OPS:
            op = packet._qualified_op_name.split("::")[-1]
            print(f"  {op:30s} {describe_choice(op, device_type, forced, notes)}", file=out)
        for reason, number in notes.items():
            print(textwrap.fill(reason, WIDTH, initial_indent=f"  [{number}] ",
                                subsequent_indent="      "), file=out)
    for (op, name, reason), count in providers.fallbacks().items():
        print(textwrap.fill(f"fallback: {op}: {name} declined {count} call(s): {reason}", WIDTH,
                            subsequent_indent="    "), file=out)


def main(argv=None) -> int:
    """Entry point of ``python -m xpu_ops``; returns the exit status (2: bad XPU_OPS_PROVIDER)."""
    parser = argparse.ArgumentParser(prog="python -m xpu_ops", description=DESCRIPTION)
    parser.add_argument("command", choices=["info"], help="info: providers per device and op")
    parser.add_argument("--device", action="append", choices=sorted(providers.DISPATCH_KEYS),
                        help="device type(s) to report (default: cpu plus every available "
                             "accelerator)")
    args = parser.parse_args(argv)
    try:
        info(args.device or _devices())
    except ValueError as e:       # a bad XPU_OPS_PROVIDER: say so without a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(argv=None) -> int:
    """``main``, with stdout flushed inside it; a reader that closed the pipe early (``python -m
    xpu_ops info | head``) ends the command quietly with status 1 instead of a
    ``BrokenPipeError`` traceback (the recipe of Python's ``signal`` documentation: point
    stdout at ``os.devnull`` so the interpreter's final flush does not fail again)."""
    import os
    try:
        status = main(argv)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(run())
