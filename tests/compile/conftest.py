"""Fixtures shared by the compile tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def stamp_outs(monkeypatch):
    """Counts Dynamo's region reuses (a stamped-out copy of an already traced layer)."""
    from torch._dynamo.variables import invoke_subgraph
    count = [0]
    original = invoke_subgraph.stamp_out_subgraph

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(invoke_subgraph, "stamp_out_subgraph", counting)
    return count
