"""``bench_model``'s results: Markdown tables, JSON and a plot of decode tokens/s per mode.

``write_results(args, rows, compile_s, bandwidth)`` writes ``--out`` with the suffixes .md, .json
and .png; a row is ``{"batch": b, "roofline": tokens/s, mode: tokens/s,
f"{mode}_host_ms": ms}`` for every mode of ``args.modes``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def compile_summary(args, compile_s) -> str:
    """One Markdown line per compile configuration: cold and warm seconds."""
    return "".join(f"\nCompile ({args.compile_layers} layers, {args.device}, {key}): cold "
                   f"{cold:.1f} s, warm {warm:.1f} s\n"
                   for key, (cold, warm) in (compile_s or {}).items())


def speed_table(rows, cols) -> str:
    """Markdown: tokens/s of every mode and the roofline, plus the mode ratios
    (graphs over the old whole-step graphs, pure piecewise over graphs) and graphs over its
    A/B without the residual ``addmm`` pass."""
    ratios = (("graphs", "eager", "x"), ("graphs", "graphs_compiled", ""),
              ("piecewise", "graphs", ""), ("graphs", "graphs_addmm", ""))
    table = ("| batch | " + " | ".join(cols) + " | roofline | "
             + " | ".join(f"{a} / {b}" for a, b, _ in ratios) + " |\n")
    table += "|---" * (len(cols) + 2 + len(ratios)) + "|\n"
    for r in rows:
        cells = [f"{r[a] / r[b]:.2f}{unit}" if a in r and b in r else "-"
                 for a, b, unit in ratios]
        table += (f"| {r['batch']} | " + " | ".join(f"{r[c]:.0f}" for c in cols)
                  + f" | {r['roofline']:.0f} | " + " | ".join(cells) + " |\n")
    return table


def peer_table(rows, cols) -> str:
    """Markdown: each mode as ``x of dense (fraction of the roofline)`` per batch."""
    table = "| batch | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|\n"
    for r in rows:
        cells = [(f"{r[c] / r['dense']:.2f}x" if "dense" in r else "-")
                 + f" ({r[c] / r['roofline']:.2f})" for c in cols]
        table += f"| {r['batch']} | " + " | ".join(cells) + " |\n"
    return table


def step_table(step_rows, modes) -> str:
    """Markdown: ms per extend/mixed step of each mode, and graphs' speed-up over compiled."""
    if not step_rows:
        return ""
    ratio = "graphs" in modes and "compiled" in modes
    table = ("\nExtend and mixed steps, ms per step (cache of --context tokens per request):\n\n"
             "| step | tokens | " + " | ".join(f"{m} ms" for m in modes)
             + (" | compiled / graphs |" if ratio else " |") + "\n")
    table += "|---" * (2 + len(modes) + ratio) + "|\n"
    for r in step_rows:
        table += (f"| {r['step']} | {r['tokens']} | "
                  + " | ".join(f"{r[m + '_ms']:.2f}" for m in modes)
                  + (f" | {r['compiled_ms'] / r['graphs_ms']:.2f}x |" if ratio else " |") + "\n")
    return table


def write_results(args, rows, compile_s, bandwidth, step_rows=()) -> None:
    """``--out`` .md (tables), .json (rows, extend/mixed step rows, compile seconds, bandwidth)
    and .png (plot)."""
    name = (torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device)
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "absent"
    head = (f"# bench_model: decode tokens/s, {args.layers} layers, context {args.context}\n\n"
            f"{name}, torch {torch.__version__}, Triton {tv}, {args.dtype}; copy bandwidth "
            f"{bandwidth / 1e9:.1f} GB/s; dense peer GQA layout {args.dense_gqa!r}\n\n")
    cols = args.modes
    table = speed_table(rows, cols)
    table += ("\nEach mode against the dense peer (x) and as a fraction of the roofline "
              "(weights + KV bytes per step / copy bandwidth):\n\n" + peer_table(rows, cols))
    table += ("\nHost ms per step (until forward returns; close to the step time = host-bound): "
              + "; ".join(f"b={r['batch']} " + ", ".join(f"{c} {r[c + '_host_ms']:.2f}"
                                                        for c in cols) for r in rows) + "\n")
    builds = "; ".join(f"b={r['batch']} " + ", ".join(f"{c} {r[c + '_builds']:g}" for c in cols
                                                    if c + "_builds" in r) for r in rows)
    table += f"\nMetadata builds per decode step: {builds}\n" if builds else ""
    table += step_table(step_rows, getattr(args, "step_modes", ()))
    table += compile_summary(args, compile_s)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(head + table)
    out.with_suffix(".json").write_text(json.dumps(
        {"rows": rows, "step_rows": list(step_rows), "compile_s": compile_s,
         "copy_bytes_per_s": bandwidth}))
    print(head + table)
    plot(rows, cols, out.with_suffix(".png"), f"{name}: {args.layers}-layer 1B-class Llama decode")


def plot(rows, cols, path: Path, title: str) -> None:
    """Tokens/s per batch, one line per mode and the roofline dashed (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    batches = [r["batch"] for r in rows]
    for c in cols:
        ax.plot(batches, [r[c] for r in rows], marker="o", label=c)
    ax.plot(batches, [r["roofline"] for r in rows], "k--", label="roofline")
    ax.set(xscale="log", yscale="log", xlabel="batch (requests)", ylabel="decode tokens/s",
           title=title)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


__all__ = ["write_results", "speed_table", "peer_table", "step_table", "plot"]
