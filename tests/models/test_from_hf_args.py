"""``compile.models.from_hf`` takes a loaded ``transformers`` model: a folder's path or any
other object without a ``config`` is a one-line ``TypeError`` that says how to load it, not an
``AttributeError`` from inside the function."""

from __future__ import annotations

import pathlib

import pytest

from compile.models import from_hf


@pytest.mark.parametrize("arg, got", [("/tmp/some-model", r"got '/tmp/some-model'"),
                                      (pathlib.Path("/tmp/m"), r"got '/tmp/m'"),
                                      (object(), r"got object")])
def test_from_hf_refuses_what_is_not_a_loaded_model(arg, got):
    with pytest.raises(TypeError, match=rf"^from_hf: hf_model expected a loaded transformers "
                                        rf"model \(one with a \.config\), {got}\. Load a folder "
                                        rf"first: transformers\.AutoModelForCausalLM"):
        from_hf(arg)
