"""One module per op family: schema, fake, argument checks and public wrapper side by side."""

from . import kv_cache, merge_state, mla_decode, paged_attention, swa_spec, varlen_attention  # noqa: F401
