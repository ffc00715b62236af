"""A small Qwen3-Next-shaped model on the GPU in every compiled mode: greedy ids equal
``transformers``' ``generate``.

Qwen3-Next-80B's linear-attention and attention head shapes (16 key / 32 value heads of 128,
full attention 16 / 2 heads of 256 with a quarter rotated), a narrow hidden size and MLP, 8
layers (6 gated-delta-net, 2 full), a small MoE with a shared expert; float32, random weights
(N(0, 0.1), wider than the default init, so greedy choices have clear margins).
The engine runs it with the GPU's providers (Triton kernels of the linear-attention ops) and,
in the graph modes, decode steps replayed as device graphs whose linear layers update their
state slots inside the graph. One prompt is longer than the prefill chunk and than the delta
rule's 64-token chunk.
Run on the GPU machine: ``python -m pytest -m gpu tests/models/test_qwen3_next_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.markers import requires_gpu_graphs

transformers = pytest.importorskip("transformers")

from compile.__main__ import make_forward  # noqa: E402
from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.graphs import device as dev  # noqa: E402
from compile.models import from_hf  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=128,
             shared_expert_intermediate_size=256, max_position_embeddings=4096)
PROMPT_LENS = (300, 37, 5)
NEW_TOKENS = 16


def hf_greedy(hf_model, prompts, device) -> list[list[int]]:
    """``generate``'s greedy tokens, its convolutions in full float32 (cuDNN would otherwise
    run the depthwise conv in TF32, about 1e-3 off: enough to flip a close greedy choice)."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode(), torch.backends.cudnn.flags(enabled=True,
                                                                allow_tf32=False):
            y = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


@requires_gpu_graphs
@pytest.mark.parametrize("mode", ["eager", "compile", "piecewise", "graphs"])
def test_qwen3_next_shape_modes_match_transformers(mode):
    device = dev.as_device()
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**SHAPE))
    with torch.no_grad():  # wider than the default init: clear greedy margins
        for name, p in hf.named_parameters():
            p.uniform_(-1.0, 1.0) if name.endswith("A_log") else p.normal_(0.0, 0.1)
    hf = hf.to(device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    expected = hf_greedy(hf, prompts, device)
    model = from_hf(hf)
    torch._dynamo.reset()
    forward = make_forward(model, mode)
    engine = Engine(model, forward=forward, page_size=16, max_running=len(prompts),
                    max_context_len=512, max_total_tokens=3 * 512, chunked_prefill_size=256)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert got == expected
    if mode == "graphs":
        assert forward.captures >= 1 and forward.replays >= 1
