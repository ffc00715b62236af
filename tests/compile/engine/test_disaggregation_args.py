"""``Engine(disaggregation=..., disaggregation_peer=...)`` argument checks, before anything is
sent: a role needs a process group; without a peer the world must split into prefill and
decode halves; a peer must be another rank of the group (an int, not a bool)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from compile.engine import Engine
from compile.engine.cli_disagg import free_port
from tests.compile.compile_helpers import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(num_layers=1, vocab_size=32)


def _engine(model, role, peer=None):
    return Engine(model, page_size=4, max_context_len=32, max_total_tokens=64,
                  disaggregation=role, disaggregation_peer=peer)


def test_a_role_needs_a_process_group(model):
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"^Engine: disaggregation='prefill' needs "
                                         r"torch.distributed"):
        _engine(model, "prefill")


@pytest.fixture()
def world_of_one(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("role, peer, error, pattern", [
    ("both", None, ValueError, r"disaggregation is 'both'; expected None, 'prefill' or"),
    ("prefill", None, ValueError, r"disaggregation='prefill' pairs rank i with rank i \+ "
     r"world / 2 when disaggregation_peer is None; expected an even world of 2 or more "
     r"ranks, got 1"),
    ("decode", 0, ValueError, r"disaggregation_peer is not another rank of the group; "
     r"expected an int in \[0, 1\) other than this rank \(0\), got 0"),
    ("prefill", 5, ValueError, r"disaggregation_peer is not another rank .*got 5"),
    ("decode", -1, ValueError, r"disaggregation_peer is not another rank .*got -1"),
    ("prefill", True, TypeError, r"disaggregation_peer has type bool; expected an int rank"),
    ("prefill", "1", TypeError, r"disaggregation_peer has type str"),
])
def test_bad_roles_and_peers_are_refused(model, world_of_one, role, peer, error, pattern):
    with pytest.raises(error, match=f"^Engine: {pattern}"):
        _engine(model, role, peer)
