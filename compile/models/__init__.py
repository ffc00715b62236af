"""Model zoo: Llama-family decoders written against ``compile.layer.PagedAttention``.

``ModelConfig`` describes a model; ``LlamaForCausalLM`` runs it over the paged KV cache;
``from_hf`` copies a ``transformers`` model's weights into it; ``compile.models.gguf`` finds and
loads the default SmolLM2 GGUF offline.
"""

from compile.models.config import ModelConfig
from compile.models.llama import LlamaForCausalLM
from compile.models.loading import from_hf

__all__ = ["ModelConfig", "LlamaForCausalLM", "from_hf"]
