"""A component's settings carried as one JSON text among its options (options are scalars).

The reference job's ``ReferenceSetup`` and the serving role's ``EngineSetup`` travel this
way: :func:`json_option` writes one, :func:`read_json_option` reads it back in a worker. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec

from dynarl.bus import MetaValue

__all__ = ["json_option", "read_json_option"]

T = TypeVar("T")


def json_option(key: str, value: object) -> dict[str, MetaValue]:
    """The component options that carry ``value`` (a struct or dataclass msgspec encodes)
    under ``key``."""
    return {key: msgspec.json.encode(value).decode()}


def read_json_option(options: Mapping[str, MetaValue], key: str, kind: type[T], what: str) -> T:
    """The ``kind`` under ``key`` in ``options``; ValueError naming ``what`` and the field
    when it is missing or malformed."""
    text = options.get(key)
    if not isinstance(text, str):
        raise ValueError(f"component options lack a {key!r} JSON text")
    try:
        return msgspec.json.decode(text, type=kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad {what}: {exc}") from exc
