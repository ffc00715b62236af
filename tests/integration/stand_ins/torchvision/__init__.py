"""Stand-in for ``torchvision`` in the sglang integration test (CPU machines only).

The PyPI torchvision wheel is CUDA-linked, and sglang's import chain reaches torchvision only
through multimodal helpers that the attention backends never call. Every ``torchvision.*``
module imports; every name in it is a placeholder class whose use (calling it, instantiating a
subclass) raises ``RuntimeError``, so nothing silently computes with it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0+xpu-ops-stand-in"


class _Placeholder(type):
    """Metaclass of the placeholder names: attribute chains and subscripts give placeholders."""

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{cls.__qualname__}.{attr}")

    def __getitem__(cls, item):
        return cls

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision stand-in: {cls.__qualname__} is not available here "
                           "(tests/integration/stand_ins/torchvision).")


def _placeholder(name: str) -> type:
    return _Placeholder(name, (), {"__qualname__": name, "__module__": __name__})


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``torchvision.<sub>`` module as a ``_StandInModule`` package."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _placeholder(f"{__name__}.{attr}")
