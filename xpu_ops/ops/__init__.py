"""One module per op family: schema, fake, argument checks and public wrapper side by side."""

from . import paged_attention  # noqa: F401
