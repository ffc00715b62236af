"""Model zoo: Llama-family decoders written against ``compile.backend.layer.PagedAttention``.

``ModelConfig`` describes a model; ``LlamaForCausalLM`` runs it over the paged KV cache
(``Llama4ForCausalLM`` a ``Llama4Config``: iRoPE chunked local attention, NoPE layers, MoE);
``from_hf`` copies a ``transformers`` model's weights into the matching one;
``compile.models.gguf`` finds and loads the default SmolLM2 GGUF offline.
"""

from compile.models.config import Llama4Config, ModelConfig
from compile.models.llama import LlamaForCausalLM
from compile.models.llama4 import Llama4ForCausalLM
from compile.models.loading import from_hf

__all__ = ["ModelConfig", "Llama4Config", "LlamaForCausalLM", "Llama4ForCausalLM", "from_hf"]
