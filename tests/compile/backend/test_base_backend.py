"""``XPUAttentionBackend`` against sglang 0.5.23's ``AttentionBackend`` interface, without sglang.

``sglang_interface.json`` is generated from the 0.5.23 wheel by ``scripts/dump_sglang_interface.py``
(the integration test regenerates it from the wheel and requires it unchanged,
``tests/integration/sglang_backend_cases.py``). Here it is data: every member of sglang's base
class must exist on ``XPUAttentionBackend`` with the same kind and a signature a caller of the
base can call the same way; ``SharedReadEnds`` and ``ForwardMode`` must have sglang's members,
values and predicate truth tables; every attribute sglang's runners read on a backend must be
readable on a built one; the two backend classes take sglang's constructor arguments.
"""

from __future__ import annotations

import inspect
import json
import pathlib
from typing import Optional

import pytest

from compile.backend import XPUAttentionBackend
from compile.backend.base_backend import AttentionBackend, SharedReadEnds
from compile.batch import ForwardMode
from tests.compile.oracle import Harness

SPEC = json.loads((pathlib.Path(__file__).with_name("sglang_interface.json")).read_text())
BASE = SPEC["AttentionBackend"]
POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")

# Members whose signature here differs from 0.5.23's, each with the reason; empty when none.
KNOWN_DEVIATIONS: dict[str, str] = {}


def signature_mismatch(base_params: list, fn) -> Optional[str]:
    """Why a call valid for the base method's parameters ``base_params`` (``[name, kind,
    has_default]`` each, self excluded) could fail on ``fn``, or None.

    Positional parameters keep their position and name, keyword-only ones their name (or
    ``fn`` takes ``**kwargs``), a base default stays a default, and parameters ``fn`` adds
    have defaults.
    """
    params = list(inspect.signature(fn).parameters.values())[1:]
    ours = {p.name: p for p in params}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    for i, (name, kind, has_default) in enumerate(base_params):
        if kind == "VAR_KEYWORD":
            if not var_kw:
                return "does not take **kwargs"
            continue
        if kind == "VAR_POSITIONAL":
            if not any(p.kind is p.VAR_POSITIONAL for p in params):
                return "does not take *args"
            continue
        p = ours.get(name)
        if p is None:
            if kind == "KEYWORD_ONLY" and var_kw:
                continue
            return f"has no parameter {name!r}"
        if kind in POSITIONAL and (i >= len(params) or params[i].name != name):
            return f"parameter {name!r} is not at position {i}"
        if has_default and p.default is inspect.Parameter.empty:
            return f"parameter {name!r} lost its default"
    base_names = {name for name, _, _ in base_params}
    for p in params:
        if (p.name not in base_names and p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)):
            return f"adds the required parameter {p.name!r}"
    return None


def kind_of(cls, name: str) -> str:
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            if isinstance(value, property):
                return "property"
            return "method" if inspect.isfunction(value) else "attribute"
    return "missing"


def test_interface_data_is_sglang_0_5_23():
    assert SPEC["sglang"] == "0.5.23"
    assert len(BASE) >= 40, "the generated data lost members"


@pytest.mark.parametrize("name", sorted(BASE))
def test_member_exists_with_compatible_signature(name):
    spec = BASE[name]
    assert kind_of(XPUAttentionBackend, name) == spec["kind"], name
    if spec["kind"] != "method":
        return
    why = signature_mismatch(spec["params"], getattr(XPUAttentionBackend, name))
    if name in KNOWN_DEVIATIONS:
        assert why is not None, f"{name} is compatible now: drop it from KNOWN_DEVIATIONS"
        return
    assert why is None, f"XPUAttentionBackend.{name} {why}"


def test_base_class_itself_matches():
    """``AttentionBackend`` here has exactly sglang's public members (no extras to drift)."""
    ours = {n for n in dir(AttentionBackend) if not n.startswith("_")}
    assert ours == set(BASE)
    for name, spec in BASE.items():
        if spec["kind"] == "method":
            assert signature_mismatch(spec["params"], getattr(AttentionBackend, name)) is None


def test_signature_check_can_fail():
    base = BASE["forward_mixed"]["params"]

    def renamed(self, q, k, v, layer, batch, save_kv_cache=True):
        pass

    def swapped(self, q, v, k, layer, forward_batch, save_kv_cache=True):
        pass

    def no_default(self, q, k, v, layer, forward_batch, save_kv_cache):
        pass

    def extra(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out):
        pass

    assert "no parameter 'forward_batch'" in signature_mismatch(base, renamed)
    assert "'k' is not at position 1" in signature_mismatch(base, swapped)
    assert "lost its default" in signature_mismatch(base, no_default)
    assert "required parameter 'out'" in signature_mismatch(base, extra)
    assert signature_mismatch(base, AttentionBackend.forward_mixed) is None
    assert "**kwargs" in signature_mismatch(BASE["forward"]["params"],
                                            AttentionBackend.forward_mixed)


def test_shared_read_ends_members():
    assert {m.name: m.value for m in SharedReadEnds} == SPEC["SharedReadEnds"]
    ends = [SharedReadEnds.IN_REPLAY, SharedReadEnds.PRE_REPLAY]
    assert SharedReadEnds.max_of(ends) is SharedReadEnds.IN_REPLAY


def test_forward_mode_members_are_sglangs():
    members = SPEC["ForwardMode"]["members"]
    for mode in ForwardMode:
        assert members.get(mode.name) == int(mode), mode


PREDICATES = SPEC["ForwardMode"]["predicates"]


def _true_for_our_modes(table: dict) -> bool:
    cells = [table["values"][m.name] for m in ForwardMode]
    return any(any(c.values()) if isinstance(c, dict) else c for c in cells)


@pytest.mark.parametrize("name", sorted(PREDICATES))
def test_forward_mode_predicate_truth_table(name):
    """Every predicate that holds for one of our modes exists, with sglang's answer for each
    mode (and each ``include_draft_extend_v2``); the others (modes we lack) may be absent."""
    table = PREDICATES[name]
    fn = getattr(ForwardMode, name, None)
    if fn is None:
        assert not _true_for_our_modes(table), f"ForwardMode.{name} is missing"
        return
    assert signature_mismatch(table["params"], fn) is None
    for mode in ForwardMode:
        want = table["values"][mode.name]
        if isinstance(want, dict):
            got = {str(flag): fn(mode, include_draft_extend_v2=flag) for flag in (False, True)}
        else:
            got = fn(mode)
        assert got == want, (name, mode.name)


@pytest.mark.parametrize("name", ["XPUAttentionBackend", "XPUMultiStepDraftBackend"])
def test_constructor_takes_sglangs_arguments(name):
    from compile.backend.multi_step_draft import XPUMultiStepDraftBackend
    ours = {"XPUAttentionBackend": XPUAttentionBackend,
            "XPUMultiStepDraftBackend": XPUMultiStepDraftBackend}[name]
    why = signature_mismatch(SPEC["constructors"][name]["params"], ours.__init__)
    assert why is None, f"{name}.__init__ {why}"


def test_runner_reads_resolve_on_a_built_backend():
    backend = Harness(16).backend
    for name in SPEC["runner_reads"]:
        assert hasattr(backend, name), name
    assert backend.needs_cpu_seq_lens and backend.kv_index_translator is None
    assert not backend.supports_ragged_verify_graph


def test_declarations():
    backend = Harness(16).backend
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE):
        assert backend.shared_read_ends(mode) is SharedReadEnds.PRE_REPLAY
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND_V2):
        assert backend.shared_read_ends(mode) is SharedReadEnds.UNKNOWN
    assert "host" in backend.glue_target_verify_metadata()
    assert "host" in backend.glue_draft_metadata()
    assert backend.get_cpu_graph_seq_len_fill_value() == 1
    assert backend.verify_mask is None and backend.late_layer_num_tokens(None) is None
