"""The public surface: each public package's ``__all__`` is sorted, resolves, exports only
dynarl's own objects and stays small; implementation lives in private modules; and the
surface matches the checked-in snapshot ``tests/public_api.txt`` (anyio
``tests/test_all_attributes.py``, httpx ``tests/test_exported_members.py``).

Each package is imported once for the whole file (``importlib`` caches it), torch and
megatron included.
"""

from __future__ import annotations

import importlib
import types

import pytest
import update_public_api as api

MAX_EXPORTS = 60

MODULES = api.public_modules()


def load(name: str) -> types.ModuleType:
    return importlib.import_module(name)


def test_public_packages_are_found() -> None:
    packages = api.public_packages()
    assert "dynarl" in packages
    assert "dynarl.sched" in packages
    assert not [name for name in packages if "._" in name]


@pytest.mark.parametrize("name", MODULES)
def test_all_is_isort_sorted_without_duplicates(name: str) -> None:
    module = load(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    exported = list(module.__all__)
    duplicates = sorted({attr for attr in exported if exported.count(attr) > 1})
    assert not duplicates, f"{name}.__all__ lists {duplicates} more than once"
    expected = sorted(exported, key=api.isort_key)
    assert exported == expected, (
        f"{name}.__all__ is not in ruff RUF022 (isort-style) order: SCREAMING_CASE, then "
        f"CamelCase, then the rest, each naturally sorted; expected {expected}"
    )


@pytest.mark.parametrize("name", MODULES)
def test_every_exported_name_resolves(name: str) -> None:
    module = load(name)
    missing = [attr for attr in module.__all__ if not hasattr(module, attr)]
    assert not missing, f"{name}.__all__ names {missing}, which do not resolve"


@pytest.mark.parametrize("name", MODULES)
def test_dir_lists_every_exported_name(name: str) -> None:
    # A lazily resolved name (a module ``__getattr__``) needs a ``__dir__`` too.
    module = load(name)
    absent = sorted(set(module.__all__) - set(dir(module)))
    assert not absent, f"dir({name}) lacks {absent}: add them to its __dir__()"


@pytest.mark.parametrize("name", MODULES)
def test_exports_only_dynarl_objects(name: str) -> None:
    module = load(name)
    foreign = {}
    for attr in module.__all__:
        origin = api.defining_module(getattr(module, attr, None))
        if origin is not None and origin != "dynarl" and not origin.startswith("dynarl."):
            foreign[attr] = origin
    assert not foreign, f"{name} re-exports objects defined outside dynarl: {foreign}"


def test_implementation_lives_in_private_modules() -> None:
    root = api.package_root()
    public_files = {
        root.joinpath(*name.split(".")[1:]).with_suffix(".py") for name in api.PUBLIC_MODULES
    }
    assert all(path.is_file() for path in public_files), f"missing one of {public_files}"
    public = sorted(
        str(path.relative_to(root.parent))
        for path in root.rglob("*.py")
        if path.name not in {"__init__.py", "__main__.py"}
        and path not in public_files
        and not path.name.startswith("_")
    )
    assert not public, (
        f"module files without a leading underscore: {public}; rename them to _name.py and "
        f"re-export what users need from the package's __init__"
    )


def test_no_package_exports_too_many_names() -> None:
    counts = {name: len(load(name).__all__) for name in MODULES}
    table = "\n".join(
        f"  {count:3d}  {name}" for name, count in sorted(counts.items(), key=lambda kv: -kv[1])
    )
    over = sorted(name for name, count in counts.items() if count > MAX_EXPORTS)
    assert not over, f"{over} export more than {MAX_EXPORTS} names:\n{table}"


def test_snapshot_matches_the_live_surface() -> None:
    live = api.surface(MODULES)
    recorded = api.SNAPSHOT.read_text(encoding="utf-8") if api.SNAPSHOT.exists() else ""
    changes = api.differences(recorded, live)
    regenerate = (
        f"If the change is intended, regenerate the snapshot and commit it with the change:\n"
        f"  {api.COMMAND}"
    )
    assert not changes, (
        "the public API differs from tests/public_api.txt (+ in the code only, - in the file "
        "only):\n" + "\n".join(changes) + "\n" + regenerate
    )
    assert recorded == api.render(live), (
        f"tests/public_api.txt has the same names but not the generated layout.\n{regenerate}"
    )
