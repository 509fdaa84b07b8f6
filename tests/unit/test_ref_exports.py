"""``dynarl.backends.reference`` exports a sorted, complete ``__all__``."""

from __future__ import annotations

import types

import dynarl.backends.reference as reference


def test_reference_all_is_sorted_complete_and_importable() -> None:
    exported = list(reference.__all__)
    assert exported == sorted(exported)
    assert all(hasattr(reference, name) for name in exported)
    public = {
        name
        for name, value in vars(reference).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", "").startswith("dynarl")
    }
    assert public <= set(exported)
