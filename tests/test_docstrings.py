"""Run the runnable examples (``>>>``) in the public docstrings of ``xpu_ops`` and of the
graphs wing (``compile.graphs``)."""

import doctest
import importlib
import pkgutil

import pytest

from compile import graphs as compile_graphs
import xpu_ops

MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(xpu_ops.__path__, "xpu_ops.")
                 if ".triton" not in name and not name.endswith("__main__"))
MODULES += sorted(name for _, name, _ in pkgutil.walk_packages(compile_graphs.__path__,
                                                               "compile.graphs."))
MODULES += ["compile.backend.parallel_state", "compile.backend.dcp_attention",
            "compile.backend.layer", "compile.backend.multi_step_draft", "compile.batch.kv_layout",
            "compile.models.parallel", "compile.models.tensor_parallel"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs=vars(xpu_ops), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
