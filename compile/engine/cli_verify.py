"""``generate --verify``: compare the engine's greedy ids with ``transformers``' own ``generate``.

The reference is the ``transformers`` model as loaded, in float32, whatever ``--dtype`` is:

- under float32 the check is exact: every prompt's ids must equal the reference's;
- under a 16-bit ``--dtype`` rounding can flip a greedy choice where the two best tokens are
  nearly tied, after which the continuations differ. The check then judges each prompt at its
  first difference: the ids before it must be equal, and at it the reference's own float32
  logits (of the common prefix) must rate the engine's token within ``LOGIT_TOLERANCE[dtype]``
  of the reference's choice. A wrong model or kernel picks tokens the reference rates far lower
  and fails; a rounding flip between near-equal tokens passes and is reported as such.

A DeepSeek-V3.2 model (``model_type`` ``deepseek_v32``) is compared with ``transformers`` under
``compile.models.deepseek_v32_reference.fp8_indexer``: its DSA indexer scores fp8-rounded
queries and keys, the engine's numerical contract (plain ``transformers`` scores them in float,
and near-tied scores then pick other keys, so its ids drift from the engine's on prompts longer
than ``index_topk``). The printed reference line names it.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from compile.models.deepseek_v32_reference import fp8_indexer, uses_fp8_indexer

# Largest float32 logit gap (reference's best minus the engine's token) accepted at the first
# difference. bfloat16 keeps 8 significant bits (relative step 2**-8) and float16 11: over a
# model's layers the logits of a 16-bit run differ from float32 by up to a few tenths
# (bfloat16) or hundredths (float16), so only tokens that close can swap places. A wrong
# token in a working model trails by several logits.
LOGIT_TOLERANCE = {"float32": 0.0, "bfloat16": 0.5, "float16": 0.125}

PLAIN_REFERENCE = "float32 transformers"
FP8_INDEXER_REFERENCE = ("float32 transformers with its DSA indexer scoring fp8-rounded queries "
                         "and keys, as the engine's does (compile.models.deepseek_v32_reference)")


def reference_of(hf_model) -> tuple[str, contextlib.AbstractContextManager]:
    """(what the reference is, the context to run ``hf_model`` in as that reference):
    ``fp8_indexer`` for DeepSeek-V3.2 (module docstring), else ``transformers`` as it is."""
    if uses_fp8_indexer(hf_model):
        return FP8_INDEXER_REFERENCE, fp8_indexer()
    return PLAIN_REFERENCE, contextlib.nullcontext()


def hf_generate(hf_model, prompt_ids, max_new_tokens: int, stops) -> list[list[int]]:
    """Greedy ids from ``transformers``' own ``generate``, one prompt at a time (no padding)."""
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.inference_mode():
            y = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=list(stops) or None,
                                  pad_token_id=stops[0] if stops else 0)  # pad: unused, b=1
        outs.append(y[0, len(ids):].tolist())
    return outs


def first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where ``a`` and ``b`` differ (or the shorter length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def logit_gap(hf_model, prefix: list[int], want: int, got: int) -> float:
    """Reference logit of ``want`` minus that of ``got`` for the token after ``prefix``."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prefix])).logits[0, -1].float()
    return float(logits[want] - logits[got])


def judge(hf_model, prompt: list[int], want: list[int], got: list[int],
          tolerance: float) -> tuple[bool, str]:
    """(passes, what to print) for one prompt's reference ids ``want`` and engine ids ``got``."""
    if want == got:
        return True, "match"
    k = first_diff(want, got)
    where = f"first difference at token {k}"
    if tolerance == 0 or k >= min(len(want), len(got)):
        return False, f"MISMATCH ({where})"
    gap = logit_gap(hf_model, prompt + want[:k], want[k], got[k])
    verdict = (f"{where}: the reference rates the engine's token {got[k]} {gap:.3f} logits "
               f"below its own {want[k]}; tolerance {tolerance}")
    if gap <= tolerance:
        return True, f"match up to a near tie ({verdict})"
    return False, f"MISMATCH ({verdict})"


def verify(hf_model, prompt_ids, outputs, max_new_tokens: int, stops,
           dtype: str = "float32", expected: Optional[list[list[int]]] = None) -> bool:
    """Print per prompt whether the engine's ids pass (module docstring); True when all do.

    Args:
        hf_model: the float32 ``transformers`` model. prompt_ids, outputs: token ids per prompt
            (prompt and engine output). dtype: ``--dtype`` of the engine run, which picks the
            tolerance. expected: the reference ids when already computed (else generated here).
    """
    name, context = reference_of(hf_model)
    tolerance = LOGIT_TOLERANCE[dtype]
    if tolerance or name != PLAIN_REFERENCE:
        rule = (f"; under --dtype {dtype} ids must be equal up to the first difference, where "
                f"the engine's token must be within {tolerance} logits of the reference's"
                if tolerance else "; ids must be equal")
        print(f"verify: reference: {name}{rule}")
    ok = True
    with context:
        if expected is None:
            expected = hf_generate(hf_model, prompt_ids, max_new_tokens, stops)
        for i, (prompt, want, got) in enumerate(zip(prompt_ids, expected, outputs)):
            passed, text = judge(hf_model, list(prompt), want, got, tolerance)
            ok &= passed
            print(f"verify: prompt {i}: {text}")
    print("verify: all prompts match" if ok else "verify: MISMATCH")
    return ok


__all__ = ["verify", "judge", "reference_of", "hf_generate", "first_diff", "logit_gap",
           "LOGIT_TOLERANCE", "PLAIN_REFERENCE", "FP8_INDEXER_REFERENCE"]
