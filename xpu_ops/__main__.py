"""``python -m xpu_ops info``: the devices, and for each op the provider chosen and why."""

from __future__ import annotations

import argparse
import sys

import torch

from . import REGISTERED_OPS, providers


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
    for device_type in device_types:
        print(f"\ndevice {device_type}:", file=out)
        for packet in REGISTERED_OPS:
            op = packet._qualified_op_name.split("::")[-1]
            rows = providers.candidates(op, device_type)
            chosen = forced or next((name for name, why in rows if why is None), "none")
            skipped = "; ".join(f"{name}: {why}" for name, why in rows
                                if why is not None and providers.PROVIDER_ORDER.index(name)
                                < providers.PROVIDER_ORDER.index(chosen))
            print(f"  {op:30s} -> {chosen}" + (f"   (skipped {skipped})" if skipped else ""),
                  file=out)
    for (op, name, reason), count in providers.fallbacks().items():
        print(f"fallback: {op}: {name} declined {count} call(s): {reason}", file=out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xpu_ops", description=__doc__)
    parser.add_argument("command", choices=["info"], help="info: providers per device and op")
    parser.add_argument("--device", action="append", help="device type(s) to report "
                        "(default: cpu plus every available accelerator)")
    args = parser.parse_args(argv)
    info(args.device or _devices())
    return 0


if __name__ == "__main__":
    sys.exit(main())
