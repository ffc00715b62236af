"""Where the host time of one decode step goes: cProfile of warm steps of ``bench_model``'s model.

    PYTHONPATH=. python benchmarks/profile_step.py --device cuda --mode piecewise --layers 16

Builds the same random-weight Llama-3.2-1B-shaped model and DECODE batch as
``benchmarks/bench_model.py``, warms the mode up (compile, capture), then profiles ``--steps``
steps (host plan included, one device sync per step) and prints the functions with the largest
own (``tottime``) and cumulative time. Host time only: on a GPU the kernels run asynchronously.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from compile import device as dev
from bench_model import build, decode_batch, make_forward


def main(argv=None) -> None:
    """Parse ``argv``, warm up, profile, print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=str(dev.as_device()))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--mode", default="piecewise")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    model = build(args)
    ids, fb = decode_batch(model, args.batch, args.context)
    forward = make_forward(model, args.mode)

    def step():
        fb.attn_backend.init_forward_metadata(fb)
        forward(ids, fb.positions, fb)
        dev.synchronize(fb.device)

    with torch.inference_mode():
        for _ in range(5):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        print(f"### {args.mode}, b={args.batch}, {args.steps} steps, sorted by {key}")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
