"""``Req``: one request's state in an engine (prompt, sampling, output, row and pages).

Its own module so that the engine and the disaggregation roles (which rebuild requests that
arrive from a prefill engine) both import it without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from compile.engine.sampling import SamplingParams


@dataclasses.dataclass
class Req:
    """One request's state. ``row`` is its ``req_to_token`` row once admitted (None before)."""

    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    row: Optional[int] = None
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: Optional[str] = None

    @property
    def seq_len(self) -> int:
        """Tokens of the request so far (prompt + generated)."""
        return len(self.prompt_ids) + len(self.output_ids)


__all__ = ["Req"]
