"""Every package's ``__all__`` lists every public member it defines or imports from dynarl
(order, duplicates and resolution: ``test_public_api.py``)."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import dynarl

PACKAGES = [
    "dynarl",
    *sorted(
        info.name
        for info in pkgutil.walk_packages(dynarl.__path__, prefix="dynarl.")
        if info.ispkg and not any(part.startswith("_") for part in info.name.split("."))
    ),
]


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
