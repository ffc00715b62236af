"""The reference DeepSeek-V3.2 model for parity checks: ``transformers``' own model with its DSA
indexer scoring fp8-rounded queries and keys, the engine's numerical contract.

The engine's lightning indexer (``compile.models.deepseek_v32.Indexer`` and
``compile.backend.dsa_indexer``) scores, like DeepSeek-V3.2's reference ``inference/model.py``
(``act_quant``, ``fp8_index``), sglang's ``nsa_indexer`` and DeepGEMM's
``fp8_paged_mqa_logits``, fp8 index queries and keys: after RoPE on the first
``qk_rope_head_dim`` features, each vector is Hadamard-rotated (Sylvester order, times
``index_head_dim ** -0.5``) and rounded to ``float8_e4m3fn`` with one scale per token (keys)
or per (token, head) (queries), ``scale = max(amax, 1e-4) / 448``. ``transformers``'
``DeepseekV32Indexer`` scores the same vectors in float (fp8 is "a precision optimization"
there), and the few-percent rounding of fp8 reorders near-tied scores, so a prompt longer than
``index_topk`` can select other keys and greedy ids drift apart with neither side wrong.

``fp8_indexer()`` swaps ``DeepseekV32Indexer.forward`` for one that applies that rounding
(written here from the contract above, in plain PyTorch; it shares no code with the engine's
path) while the context is open; everything else is ``transformers``' own code. The top-k
selection is ``torch.topk`` of the scores (the engine breaks exact ties to the lower position;
exact ties of float32 scores do not occur on real inputs).

Users: ``python -m compile generate --verify`` (``compile.engine.cli_verify``) for a
``model_type`` of ``deepseek_v32``, and the DeepSeek-V3.2 parity tests.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from xpu_ops.index_k_layout import AMAX_FLOOR, FP8_MAX

#: ``model_type`` of the checkpoints whose reference needs ``fp8_indexer``.
MODEL_TYPE = "deepseek_v32"


def uses_fp8_indexer(hf_model) -> bool:
    """True when ``hf_model`` (a ``transformers`` model, or None) is a DeepSeek-V3.2 model,
    whose parity reference is ``transformers`` under ``fp8_indexer``."""
    config = getattr(hf_model, "config", None)
    return getattr(config, "model_type", None) == MODEL_TYPE


def hadamard(d: int, device=None) -> torch.Tensor:
    """The ``[d, d]`` float32 Sylvester Hadamard matrix (``d`` a power of two), unnormalised."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: d must be a power of two; expected 1, 2, 4, ..., got {d}.")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` Hadamard-rotated (``x @ H / sqrt(D)``), then each row rounded to
    ``float8_e4m3fn`` with scale ``max(amax, AMAX_FLOOR) / FP8_MAX`` and back; float32.

    DeepSeek-V3.2's ``act_quant`` with one block per row (``D = index_head_dim``)."""
    d = x.shape[-1]
    x = x.float() @ hadamard(d, x.device) * d ** -0.5
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR) / FP8_MAX
    return (x * (1.0 / scale)).to(torch.float8_e4m3fn).float() * scale


def _fp8_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask,
                         position_ids=None, cache=None, past_key_values=None, **_):
    """``DeepseekV32Indexer.forward`` with its scores taken from ``fp8_round``-ed queries and
    keys: ``[B, S, index_topk]`` int32 key positions (fewer when fewer keys).

    The layer cache comes as ``cache`` (``transformers`` >= 5.24) or ``past_key_values``
    (earlier 5.x); a forward that missed it would score each decode query against its own key
    only."""
    cache = cache if cache is not None else past_key_values
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32

    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    r = self.qk_rope_head_dim
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    q_rot, k_rot = hf_v32.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = fp8_round(torch.cat([q_rot, q[..., r:]], dim=-1))
    k = fp8_round(torch.cat([k_rot, k[..., r:]], dim=-1).squeeze(2))
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    scores = F.relu(q @ k.transpose(-1, -2).unsqueeze(1) * self.softmax_scale)   # [B, S, H, T]
    weights = self.weights_proj(hidden_states.float()).float() * self.n_heads ** -0.5
    index_scores = (weights.unsqueeze(-2) @ scores).squeeze(-2)                   # [B, S, T]
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    topk = min(self.index_topk, index_scores.shape[-1])
    return index_scores.topk(topk, dim=-1).indices.to(torch.int32)


@contextlib.contextmanager
def fp8_indexer(enabled: bool = True) -> Iterator[None]:
    """While open (and ``enabled``), every ``transformers`` ``DeepseekV32Indexer`` scores
    fp8-rounded queries and keys (module docstring); the original forward is restored on exit,
    also on an error. Raises ImportError when ``transformers`` has no DeepSeek-V3.2."""
    if not enabled:
        yield
        return
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32

    cls = hf_v32.DeepseekV32Indexer
    real = cls.forward
    cls.forward = _fp8_indexer_forward
    try:
        yield
    finally:
        cls.forward = real


__all__ = ["MODEL_TYPE", "uses_fp8_indexer", "hadamard", "fp8_round", "fp8_indexer"]
