"""Write the attention-backend interface of the installed sglang as JSON (the data that
``tests/compile/backend/test_base_backend.py`` checks ``XPUAttentionBackend`` against).

It records, from the wheel itself:

- ``AttentionBackend``: every public member of ``sglang.srt.layers.attention.base_attn_backend
  .AttentionBackend`` (kind, and for methods each parameter's name, kind and whether it has a
  default);
- ``SharedReadEnds``: its members and values;
- ``ForwardMode``: its members and values, and the truth table of every ``is_*`` predicate
  (with ``include_draft_extend_v2`` False and True where the predicate takes it);
- ``runner_reads``: the attributes that sglang's runners and speculative workers read on
  ``attn_backend`` (a scan of their sources) and that its ``XPUAttentionBackend`` provides;
- ``constructors``: the ``__init__`` parameters of its ``XPUAttentionBackend`` and
  ``XPUMultiStepDraftBackend`` (what its attention registry and workers call).

Run where sglang imports (the integration environment):
    PYTHONPATH=tests/integration/stand_ins:.venv-sglang bash scripts/with-env.sh \\
        python scripts/dump_sglang_interface.py tests/compile/backend/sglang_interface.json
"""

from __future__ import annotations

import inspect
import json
import pathlib
import re
import sys


def describe_member(value) -> dict:
    """``{"kind": ...}`` of one class member, with ``params`` for methods."""
    if isinstance(value, property):
        return {"kind": "property"}
    if inspect.isfunction(value):
        params = list(inspect.signature(value).parameters.values())[1:]    # drop self
        return {"kind": "method", "params": [
            [p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in params]}
    return {"kind": "attribute"}


def describe_class(cls) -> dict:
    """Public members defined by ``cls`` or its bases (not by ``object`` or ``abc.ABC``)."""
    members = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ in ("builtins", "abc"):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_"):
                members[name] = describe_member(value)
    return dict(sorted(members.items()))


def predicate_table(mode_cls) -> dict:
    """Truth table of every ``is_*`` predicate over every member."""
    table = {}
    for name, fn in sorted(vars(mode_cls).items()):
        if not (name.startswith("is_") and inspect.isfunction(fn)):
            continue
        takes_v2 = "include_draft_extend_v2" in inspect.signature(fn).parameters
        values = {}
        for member in mode_cls:
            if takes_v2:
                values[member.name] = {str(flag): bool(fn(member, include_draft_extend_v2=flag))
                                       for flag in (False, True)}
            else:
                values[member.name] = bool(fn(member))
        table[name] = {**describe_member(fn), "values": values}
    return table


def runner_reads(srt: pathlib.Path, backend_cls) -> list[str]:
    """Names read as ``attn_backend.<name>`` in the runners and speculative workers that
    sglang's ``XPUAttentionBackend`` provides (class members or ``self.<name> =`` in its
    module)."""
    read = set()
    for folder in ("model_executor", "speculative", "hardware_backend/xpu"):
        for path in (srt / folder).rglob("*.py"):
            read |= set(re.findall(r"\battn_backend\.(\w+)", path.read_text()))
    provided = {n for n in dir(backend_cls) if not n.startswith("_")}
    provided |= set(re.findall(r"self\.(\w+)\s*[:=]", inspect.getsource(backend_cls)))
    return sorted(read & provided)


def describe() -> dict:
    """The interface of the installed sglang (see the module docstring)."""
    import sglang
    from sglang.srt.layers.attention import base_attn_backend
    from sglang.srt.layers.attention.xpu_backend import (XPUAttentionBackend,
                                                         XPUMultiStepDraftBackend)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    srt = pathlib.Path(base_attn_backend.__file__).resolve().parents[2]
    return {
        "sglang": sglang.__version__,
        "AttentionBackend": describe_class(base_attn_backend.AttentionBackend),
        "SharedReadEnds": {m.name: m.value for m in base_attn_backend.SharedReadEnds},
        "ForwardMode": {"members": {m.name: int(m) for m in ForwardMode},
                        "predicates": predicate_table(ForwardMode)},
        "runner_reads": runner_reads(srt, XPUAttentionBackend),
        "constructors": {cls.__name__: describe_member(cls.__init__)
                         for cls in (XPUAttentionBackend, XPUMultiStepDraftBackend)},
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    import xpu_ops
    xpu_ops.compat.install_sgl_kernel_shim()      # sglang's XPU backend imports sgl_kernel
    text = json.dumps(describe(), indent=1, sort_keys=True)
    # One line per parameter ([name, kind, has_default]) keeps the file short and diffable.
    text = re.sub(r'\[\s+("\w+"),\s+("\w+"),\s+(true|false)\s+\]', r"[\1, \2, \3]", text)
    pathlib.Path(argv[1]).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
