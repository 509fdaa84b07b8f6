"""Every package's ``__all__`` is complete, sorted and importable."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import dynarl

PACKAGES = ["dynarl"] + [
    f"dynarl.{info.name}" for info in pkgutil.iter_modules(dynarl.__path__) if info.ispkg
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_importable(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    assert len(exported) == len(set(exported)), f"{name}.__all__ has duplicates"
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ names missing {attr!r}"


@pytest.mark.parametrize("name", PACKAGES)
def test_all_lists_every_public_member(name: str) -> None:
    module = importlib.import_module(name)
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", "").startswith("dynarl")
    }
    assert public <= set(module.__all__), f"{name} exports {public - set(module.__all__)}"
