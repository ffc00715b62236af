"""Model zoo: Llama-family decoders written against ``compile.backend.PagedAttention``.

``ModelConfig`` describes a model; ``LlamaForCausalLM`` runs it over the paged KV cache
(``Llama4ForCausalLM`` a ``Llama4Config``: iRoPE chunked local attention, NoPE layers, MoE;
``Gemma3ForCausalLM`` a ``Gemma3Config``: 5:1 sliding-window/global layers, local RoPE base);
``from_hf`` copies a ``transformers`` model's weights into the matching one;
``compile.models.gguf`` finds and loads the packaged GGUFs (SmolLM2, Gemma 3 270M) offline.
"""

from compile.models.config import (SUPPORTED_MODEL_TYPES, Gemma3Config, Llama4Config,
                                   ModelConfig)
from compile.models.gemma3 import Gemma3ForCausalLM
from compile.models.llama import LlamaForCausalLM
from compile.models.llama4 import Llama4ForCausalLM
from compile.models.loading import from_hf

__all__ = ["ModelConfig", "Llama4Config", "Gemma3Config", "LlamaForCausalLM",
           "Llama4ForCausalLM", "Gemma3ForCausalLM", "SUPPORTED_MODEL_TYPES", "from_hf"]
