"""A stand-in for ``torchvision`` in the SGLang CPU environment (``tools/sglang_env.sh``).

SGLang imports torchvision at start-up (for multimodal models), but the PyPI build is a
CUDA build that breaks beside CPU torch. Text models never call it, so every import of
``torchvision`` or any ``torchvision.<submodule>`` succeeds, and every attribute is a class
that can be called, subclassed and read further; nothing computes. Dunder lookups fail as
usual, so introspection (``__path__``, ``__wrapped__``) behaves.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+standin"


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if _dunder(name):
            raise AttributeError(name)
        return _stub(f"{cls.__qualname__}.{name}", cls.__module__)


class _Any(metaclass=_AnyMeta):
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Any:
        return _Any()

    def __getattr__(self, name: str) -> Any:
        if _dunder(name):
            raise AttributeError(name)
        return _stub(f"{type(self).__qualname__}.{name}", type(self).__module__)


def _stub(qualname: str, module: str) -> type:
    name = qualname.rsplit(".", 1)[-1]
    return _AnyMeta(name, (_Any,), {"__qualname__": qualname, "__module__": module})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if _dunder(name):
            raise AttributeError(name)
        return _stub(name, self.__name__)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every ``torchvision.*`` module and makes it a stand-in package."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def __getattr__(name: str) -> Any:
    if _dunder(name):
        raise AttributeError(name)
    return _stub(name, __name__)


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
