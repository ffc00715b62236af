"""``python -m compile check MODEL``: does the model trace whole, and how does it split?

    python -m compile check tiny            # 2-layer random Llama, seconds
    python -m compile check default         # SmolLM2-135M-Instruct (GGUF)

Runs the engine for one EXTEND step (two prompts) and one DECODE step (both requests) three
times over the same model:

1. eager, for the reference greedy ids;
2. ``torch.compile(model, fullgraph=True)``: a graph break raises, is reported, and the steps are
   traced again without ``fullgraph`` to count every break and name its reason; graphs compiled
   and recompiles come from ``torch._dynamo``'s counters;
3. ``compile_piecewise(model, capture=False)``: the piecewise split count per Dynamo graph,
   expected ``num_layers + 1`` pieces around ``num_layers`` attention calls.

It also reports the attention kind of every layer (global, sliding window W, chunked local C,
linear: gated delta net), for models with sliding-window layers the KV cache of one
``KV_REPORT_TOKENS``-token request in the engine's hybrid pool against a full pool
(``compile.batch.swa_pages.kv_cache_bytes``), and for models with linear-attention layers
(Qwen3-Next) the KV bytes per token of the full-attention layers and the state bytes per
request of the linear ones (``compile.batch.state_pool.LinearStateLayout.state_bytes``), and for
MLA models (DeepSeek) whether each layer attends densely or sparsely (DeepSeek-V3.2's DSA: the
indexer's top-k) with the latent KV and DSA index-key bytes per token (``mla_cache_bytes``).

The Dynamo ``eager`` backend is used unless ``--inductor`` is given: breaks, guards and splits
are decided before Inductor runs. Exit status 1 when any break, a wrong split count or an id
mismatch is found.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from typing import Callable, Optional

import torch

from compile.backend import LinearAttention, PagedAttention, kv_layout, linear_layout
from compile.batch.swa_pages import KVCacheBytes, kv_cache_bytes
from compile.engine.cli_args import DTYPES, model_name, positive_int
from xpu_ops.mla_fp8_layout import FP8_TILE, fp8_token_bytes

PROMPTS = ([1, 2, 3, 4, 5], [6, 7, 8])  # token ids: one EXTEND of 8 tokens, then DECODE b=2
KV_REPORT_TOKENS = 8192


@dataclasses.dataclass
class CheckResult:
    """What ``check_model`` found.

    Attributes:
        num_layers: decoder layers of the model.
        graph_breaks: breaks counted by Dynamo (0 when ``fullgraph=True`` traced everything).
        break_reasons: reason -> count, empty without breaks.
        graphs: Dynamo graphs compiled for the two steps; ``recompiles = graphs - 1``.
        pieces_per_graph: piecewise pieces per Dynamo graph (expected ``num_layers + 1``; 0 when
            a graph break stopped the piecewise trace).
        split_ops: attention calls per Dynamo graph (expected ``num_layers``).
        ids_match: compiled and piecewise greedy ids equal eager's.
        attention: per attention layer, its kind (``attention_kinds``).
        kv_bytes: KV cache of one ``KV_REPORT_TOKENS``-token request, hybrid vs full pool
            (None without sliding-window layers).
        kv_bytes_per_token, state_bytes_per_request: models with linear-attention layers: the
            KV cache of the full-attention layers per token, and the linear layers' state per
            request (None otherwise).
        mla_bytes: MLA models: ``mla_cache_bytes`` (None otherwise).
    """

    num_layers: int
    graph_breaks: int
    break_reasons: dict[str, int]
    graphs: int
    pieces_per_graph: float
    split_ops: float
    ids_match: bool
    attention: list[str] = dataclasses.field(default_factory=list)
    kv_bytes: Optional[KVCacheBytes] = None
    kv_bytes_per_token: Optional[int] = None
    state_bytes_per_request: Optional[int] = None
    mla_bytes: Optional["MLACacheBytes"] = None

    @property
    def ok(self) -> bool:
        return (self.graph_breaks == 0 and self.ids_match
                and self.pieces_per_graph == self.num_layers + 1)


def run_steps(model, forward: Callable, page_size: int = 16) -> list[list[int]]:
    """Greedy ids of ``PROMPTS`` after one EXTEND and one DECODE step through ``forward``."""
    from compile.engine.engine import Engine, SamplingParams

    engine = Engine(model, forward=forward, page_size=page_size, max_running=len(PROMPTS),
                    max_context_len=64, max_total_tokens=128)
    vocab = model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    return engine.generate(prompts, SamplingParams(max_new_tokens=2))


def _trace(model, backend: str, page_size: int) -> tuple[list[list[int]], int, dict[str, int]]:
    """(ids, breaks, reasons): fullgraph first; after a break, again without fullgraph."""
    from torch._dynamo.utils import counters

    for fullgraph in (True, False):
        torch._dynamo.reset()
        counters.clear()
        try:
            ids = run_steps(model, torch.compile(model, fullgraph=fullgraph, backend=backend),
                            page_size)
        except torch._dynamo.exc.Unsupported:
            continue  # counted by the second pass
        reasons = Counter({k: v for k, v in counters["graph_break"].items()})
        return ids, sum(reasons.values()), dict(reasons)
    raise AssertionError("unreachable: the pass without fullgraph cannot raise Unsupported")


def check_model(model, *, inductor: bool = False, page_size: int = 16) -> CheckResult:
    """Trace ``model`` (a zoo model) on one EXTEND and one DECODE step; see the module doc."""
    from torch._dynamo.utils import counters

    from compile.graphs.piecewise import compile_piecewise
    from compile.graphs.split_op import enable_split_op

    backend = "inductor" if inductor else "eager"
    expected = run_steps(model, model, page_size)
    ids, breaks, reasons = _trace(model, backend, page_size)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    piecewise = compile_piecewise(model, inductor=inductor, capture=False)
    try:
        pw_ids = run_steps(model, piecewise, page_size)
    except torch._dynamo.exc.Unsupported:  # a graph break: piecewise needs one whole graph
        pw_ids = None
    finally:
        enable_split_op(model, False)
    s = piecewise.backend.stats
    n = max(s["graphs"], 1)
    kinds = attention_kinds(model)
    kv, dtype = None, next(model.parameters()).dtype
    if any(k.startswith("sliding") for k in kinds):
        kv = kv_cache_bytes(kv_layout(model), KV_REPORT_TOKENS, page_size=page_size,
                            dtype=dtype)
    per_token, per_request = None, None
    linear = linear_layout(model)
    if linear is not None:
        layout = kv_layout(model)
        per_token = (len(layout.cache_layer_ids) * layout.head_num
                     * (layout.head_dim + layout.v_head_dim) * dtype.itemsize)
        per_request = linear.state_bytes(dtype)
    return CheckResult(num_layers=model.config.num_hidden_layers, graph_breaks=breaks,
                       break_reasons=reasons, graphs=graphs, pieces_per_graph=s["pieces"] / n,
                       split_ops=s["split_ops"] / n, ids_match=ids == expected == pw_ids,
                       attention=kinds, kv_bytes=kv, kv_bytes_per_token=per_token,
                       state_bytes_per_request=per_request, mla_bytes=mla_cache_bytes(model))


@dataclasses.dataclass(frozen=True)
class MLACacheBytes:
    """Cache bytes per token of an MLA model, per layer and over its layers with a cache.

    Attributes:
        latent: one layer's latent row ``(R + r) * itemsize``.
        index: one DSA layer's index key and scale ``Di + 4`` (0 without DSA).
        layers: layers with a cache of their own.
        latent_fp8: a DSA model's latent row in an fp8 latent cache (FlashMLA's token bytes,
            ``Engine(kv_dtype=torch.float8_e4m3fn)``); 0 without DSA or when R is not a
            multiple of 128.
    """

    latent: int
    index: int
    layers: int
    latent_fp8: int = 0


def mla_cache_bytes(model) -> Optional[MLACacheBytes]:
    """``MLACacheBytes`` of ``model``'s pools (``kv_layout``), None when it is not MLA."""
    layout = kv_layout(model)
    if not layout.kv_lora_rank:
        return None
    itemsize = next(model.parameters()).dtype.itemsize
    index = layout.index_head_dim + 4 if layout.index_head_dim else 0  # fp8 key, float32 scale
    rank = layout.kv_lora_rank
    fp8 = fp8_token_bytes(layout.head_dim, rank) if index and rank % FP8_TILE == 0 else 0
    return MLACacheBytes(latent=layout.head_dim * itemsize, index=index,
                         layers=len(layout.cache_layer_ids), latent_fp8=fp8)


def attention_kinds(model) -> list[str]:
    """Per attention layer of ``model`` (``PagedAttention`` or ``LinearAttention``), in layer
    order: ``"global"``, ``"sliding window W"`` (W tokens: the query and W - 1 before it),
    ``"chunked local C"`` (C tokens), ``"linear (gated delta net)"``, ``"dense MLA"`` (an MLA
    model's layer) or ``"sparse MLA (top-k K)"`` (a DeepSeek-V3.2 layer with an indexer)."""
    chunk = getattr(model.config, "attention_chunk_size", None)
    mla = bool(getattr(model.config, "kv_lora_rank", 0))
    sparse = {id(m.attn) for m in model.modules()
              if hasattr(m, "indexer") and isinstance(getattr(m, "attn", None), PagedAttention)}
    kinds = []
    for attn in model.modules():
        if isinstance(attn, LinearAttention):
            kinds.append("linear (gated delta net)")
        if not isinstance(attn, PagedAttention):
            continue
        if attn.use_irope:
            kinds.append(f"chunked local {chunk}")
        elif attn.sliding_window_size >= 0:
            kinds.append(f"sliding window {attn.sliding_window_size + 1}")
        elif id(attn) in sparse:
            kinds.append(f"sparse MLA (top-k {model.config.index_topk})")
        elif mla:
            kinds.append("dense MLA")
        else:
            kinds.append("global")
    return kinds


def format_attention(kinds: list[str]) -> str:
    """``"15 x sliding window 512 (layers 0-4, 6-10, 12-16), 3 x global (layers 5, 11, 17)"``."""
    groups: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(i)
    return ", ".join(f"{len(ids)} x {kind} (layers {_spans(ids)})" for kind, ids in groups.items())


def _spans(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


def format_result(name: str, r: CheckResult, backend: str) -> str:
    """The few lines ``check`` prints."""
    lines = [f"check {name}: {r.num_layers} layers; one EXTEND (2 requests, 8 tokens) and one "
             f"DECODE (2 requests) step; backend {backend}",
             f"  graph breaks: {r.graph_breaks}"
             + ("" if r.graph_breaks else " (fullgraph=True traced every step)")]
    lines += [f"    {count} x {reason}" for reason, count in r.break_reasons.items()]
    lines.append(f"  attention: {format_attention(r.attention)}")
    if r.kv_bytes is not None:
        mib = 2.0 ** 20
        lines.append(f"  KV cache of one {KV_REPORT_TOKENS}-token request: hybrid SWA pool "
                     f"{r.kv_bytes.hybrid / mib:.1f} MiB vs full pool {r.kv_bytes.full / mib:.1f} "
                     f"MiB ({100 * r.kv_bytes.saved_fraction:.0f}% saved)")
    if r.state_bytes_per_request is not None:
        lines.append(f"  KV cache {r.kv_bytes_per_token} bytes per token (full-attention "
                     f"layers); linear-attention state {r.state_bytes_per_request} bytes per "
                     "request (conv windows and recurrent states, any length)")
    if r.mla_bytes is not None:
        m = r.mla_bytes
        if m.index:
            lines.append(f"  KV cache per token and layer: MLA latent {m.latent} bytes, DSA index "
                         f"keys {m.index} bytes; all {m.layers} layers: {m.layers * m.latent} + "
                         f"{m.layers * m.index} = {m.layers * (m.latent + m.index)} bytes per "
                         "token")
        else:  # dense MLA (DeepSeek-V2/V3): no indexer
            lines.append(f"  KV cache per token and layer: MLA latent {m.latent} bytes; all "
                         f"{m.layers} layers: {m.layers * m.latent} bytes per token")
        if m.latent_fp8:
            lines.append(f"  with an fp8 latent cache (kv_dtype float8_e4m3fn): MLA latent "
                         f"{m.latent_fp8} bytes per token and layer; all {m.layers} layers: "
                         f"{m.layers * (m.latent_fp8 + m.index)} bytes per token")
    lines.append(f"  graphs compiled: {r.graphs} ({max(r.graphs - 1, 0)} recompiles)")
    want = r.num_layers + 1
    lines.append(f"  piecewise split: {r.pieces_per_graph:g} pieces around {r.split_ops:g} "
                 f"attention calls per graph (expected num_layers + 1 = {want}: "
                 f"{'ok' if r.pieces_per_graph == want else 'WRONG'})")
    lines.append(f"  greedy ids (compiled, piecewise) equal eager: "
                 f"{'yes' if r.ids_match else 'NO'}")
    lines.append(f"check: {'ok' if r.ok else 'FAILED'}")
    return "\n".join(lines)


def cmd_check(args) -> int:
    """Entry point of ``python -m compile check MODEL``; 0 when ``CheckResult.ok``."""
    from compile.engine.cli_models import load_model, pick_device, user_model_errors
    from compile.models import from_hf

    device = pick_device(args.device)
    name = None if args.model == "default" else args.model
    with user_model_errors(name):
        hf_model, _ = load_model(name)
        model = from_hf(hf_model, dtype=getattr(torch, args.dtype), device=device)
    result = check_model(model, inductor=args.inductor, page_size=args.page_size)
    print(format_result(args.model, result, "inductor" if args.inductor else "eager"))
    return 0 if result.ok else 1


class _ModelChoice(argparse.Action):
    """Stores ``check``'s model from the positional ``MODEL`` or ``--model MODEL`` (generate's
    spelling); a model named both ways is an argument error. argparse may call the positional
    with its default after the option: then the option's model stays."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, "model", "default")
        if given != "default" and values == "default" and option_string is None:
            return  # MODEL left out after --model MODEL
        if given != "default":
            parser.error(f"argument --model: names the model a second time; expected MODEL or "
                         f"--model MODEL, got {given!r} and {values!r}")
        namespace.model = values


def add_parser(sub) -> None:
    """Register ``check`` on the ``python -m compile`` subparsers."""
    c = sub.add_parser("check", help="trace a model: graph breaks, recompiles, split count")
    c.add_argument("model", type=model_name, nargs="?", default="default", action=_ModelChoice,
                   help="'default' (SmolLM2-135M GGUF; also when left out, as for generate), "
                        "'tiny', 'gemma3' (Gemma 3 270M GGUF), a .gguf or a folder")
    c.add_argument("--model", type=model_name, action=_ModelChoice, default="default",
                   metavar="MODEL", help="the same as MODEL, spelled as for generate")
    c.add_argument("--device", choices=("auto", "cpu", "cuda", "xpu"), default="cpu")
    c.add_argument("--dtype", choices=DTYPES, default="float32")
    c.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    c.add_argument("--inductor", action="store_true",
                   help="compile with Inductor too (default: Dynamo's eager backend)")
    c.set_defaults(func=cmd_check, error=c.error, model_flag="model")


__all__ = ["CheckResult", "MLACacheBytes", "mla_cache_bytes", "check_model", "attention_kinds",
           "format_attention", "format_result", "cmd_check", "add_parser", "KV_REPORT_TOKENS"]
