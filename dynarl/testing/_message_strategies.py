"""Hypothesis strategies of bus messages, built from the rules declared on the types:
:func:`message_strategy` (valid messages only) and :func:`arbitrary_message_strategy`
(any value of each field's type, for fuzzing decode). Re-exported by :mod:`dynarl.testing`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import msgspec.inspect as mi
import numpy as np

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = ["arbitrary_message_strategy", "message_strategy"]

_I64 = (-(2**63), 2**63 - 1)
_EXTRA_RULES = frozenset({"packed", "max_items_of"})
"""The ``Meta.extra`` rules of bus messages (``dynarl.bus._messages`` enforces them)."""
_MAX_ITEMS = 16
"""Most items a drawn string, bytes, packed array, tuple or dict holds (small and fast)."""


def _bounds(info: mi.IntType) -> tuple[int, int]:
    low, high = _I64
    if info.ge is not None:
        low = max(low, info.ge)
    if info.gt is not None:
        low = max(low, info.gt + 1)
    if info.le is not None:
        high = min(high, info.le)
    if info.lt is not None:
        high = min(high, info.lt - 1)
    return low, high


def _sizes(min_length: int | None, max_length: int | None, most: int) -> tuple[int, int]:
    """(min, max) size to draw: the declared bounds, at most ``most`` unless more needed."""
    low = min_length or 0
    high = max(low, most)
    return low, high if max_length is None else min(high, max_length)


def _extra(info: mi.Type) -> dict[str, Any]:
    return dict(info.extra or {}) if isinstance(info, mi.Metadata) else {}


def _packed(dtype: str) -> SearchStrategy[bytes]:
    """Packed little-endian arrays of ``dtype`` (``"<i4"`` or ``"<f4"``), finite floats."""
    from hypothesis import strategies as st

    kind = np.dtype(dtype)
    if kind.kind == "i":
        info = np.iinfo(kind)
        item: SearchStrategy[Any] = st.integers(int(info.min), int(info.max))
    elif kind.kind == "f" and kind.itemsize == 4:
        item = st.floats(width=32, allow_nan=False, allow_infinity=False)
    else:
        raise NotImplementedError(f"no strategy for packed {dtype!r}")
    items = st.lists(item, max_size=_MAX_ITEMS)
    return items.map(lambda values: np.asarray(values, dtype=kind).tobytes())


def _valid(info: mi.Type) -> SearchStrategy[Any]:
    """Values of ``info`` that satisfy every rule it declares."""
    from hypothesis import strategies as st  # a dev dependency: imported only when used

    match info:
        case mi.Metadata(type=inner):
            extra = _extra(info)
            if not extra.keys() <= _EXTRA_RULES:
                raise NotImplementedError(f"no strategy for the rules {extra} of {inner!r}")
            packed = extra.get("packed")
            return _packed(str(packed)) if packed is not None else _valid(inner)
        case mi.UnionType(types=types):
            return st.one_of(*[_valid(member) for member in types])
        case mi.StructType():
            return _struct(info, valid=True)
        case mi.IntType():
            if info.multiple_of is not None:
                raise NotImplementedError(f"no strategy for {info!r}")
            low, high = _bounds(info)
            return st.integers(min_value=low, max_value=high)
        case mi.FloatType():
            if info.multiple_of is not None:
                raise NotImplementedError(f"no strategy for {info!r}")
            return st.floats(
                min_value=info.gt if info.gt is not None else info.ge,
                max_value=info.lt if info.lt is not None else info.le,
                exclude_min=info.gt is not None,
                exclude_max=info.lt is not None,
                allow_nan=False,
                allow_infinity=False,
            )
        case mi.StrType(min_length=low, max_length=high, pattern=pattern):
            if pattern is None:
                size = _sizes(low, high, _MAX_ITEMS)
                return st.text(min_size=size[0], max_size=size[1])
            return st.from_regex(pattern, fullmatch=True).filter(
                lambda text: (low or 0) <= len(text) <= (high if high is not None else len(text))
            )
        case mi.BytesType(min_length=low, max_length=high):
            size = _sizes(low, high, 4 * _MAX_ITEMS)
            return st.binary(min_size=size[0], max_size=size[1])
        case mi.VarTupleType(item_type=item, min_length=low, max_length=high):
            size = _sizes(low, high, 4)
            return st.lists(_valid(item), min_size=size[0], max_size=size[1]).map(tuple)
        case mi.DictType(key_type=key, value_type=value, min_length=low, max_length=high):
            size = _sizes(low, high, 4)
            return st.dictionaries(_valid(key), _valid(value), min_size=size[0], max_size=size[1])
    return _leaf(info)


def _arbitrary(info: mi.Type) -> SearchStrategy[Any]:
    """Any value of ``info``'s type, valid or not: its declared rules are ignored."""
    from hypothesis import strategies as st

    match info:
        case mi.Metadata(type=inner):
            packed = _extra(info).get("packed")
            rest = _arbitrary(inner)
            return st.one_of(_packed(str(packed)), rest) if packed is not None else rest
        case mi.UnionType(types=types):
            return st.one_of(*[_arbitrary(member) for member in types])
        case mi.StructType():
            return _struct(info, valid=False)
        # Valid values too, so that a message with one field broken is drawn often.
        case mi.IntType():
            return st.one_of(_valid(info), st.integers(min_value=_I64[0], max_value=_I64[1]))
        case mi.FloatType():
            # No NaN, so that the round trip of a valid message compares equal.
            return st.one_of(_valid(info), st.floats(allow_nan=False))
        case mi.StrType():
            return st.one_of(_valid(info), st.text(max_size=_MAX_ITEMS))
        case mi.BytesType():
            return st.one_of(_valid(info), st.binary(max_size=4 * _MAX_ITEMS))
        case mi.VarTupleType(item_type=item):
            return st.lists(_arbitrary(item), max_size=4).map(tuple)
        case mi.DictType(key_type=key, value_type=value):
            return st.dictionaries(_arbitrary(key), _arbitrary(value), max_size=4)
    return _leaf(info)


def _leaf(info: mi.Type) -> SearchStrategy[Any]:
    from hypothesis import strategies as st

    match info:
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
    raise NotImplementedError(f"no strategy for {info!r}")


def _struct(info: mi.StructType, *, valid: bool) -> SearchStrategy[Any]:
    """Instances of a struct. ``valid``: a field declared ``max_items_of`` another is drawn
    within that field's item count. Otherwise a value an ``extra`` rule refuses is set
    after construction, as a client in another language could send it."""
    from hypothesis import strategies as st

    draw_field = _valid if valid else _arbitrary
    plain = {
        f.name: draw_field(f.type) for f in info.fields if "max_items_of" not in _extra(f.type)
    }
    bound = [f for f in info.fields if "max_items_of" in _extra(f.type)]
    itemsize = {
        f.name: np.dtype(str(_extra(f.type)["packed"])).itemsize
        for f in info.fields
        if "packed" in _extra(f.type)
    }
    ruled = {f.name: (b"" if f.name in itemsize else 0) for f in info.fields if _extra(f.type)}
    cls = info.cls

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        values = {name: draw(strategy) for name, strategy in plain.items()}
        for f in bound:
            if not valid:
                values[f.name] = draw(_arbitrary(f.type))
                continue
            inner = f.type.type if isinstance(f.type, mi.Metadata) else f.type
            assert isinstance(inner, mi.IntType), f"max_items_of on {inner!r}"
            low, high = _bounds(inner)
            of = str(_extra(f.type)["max_items_of"])
            high = min(high, len(values[of]) // itemsize[of])
            values[f.name] = draw(st.integers(low, high) if low <= high else st.nothing())
        if valid:
            return cls(**values)
        message = cls(**{**values, **ruled})  # values that satisfy every extra rule
        for name in ruled:
            msgspec.structs.force_setattr(message, name, values[name])
        return message

    strategy: SearchStrategy[Any] = build()
    return strategy


def message_strategy(message_type: Any) -> SearchStrategy[Any]:
    """A hypothesis strategy of *valid* instances of a bus message type or union of them:
    messages a running job could produce, which every receiver must accept.

    Built from the rules the message types declare (``msgspec.Meta`` constraints and the
    ``packed`` and ``max_items_of`` rules of ``Meta.extra``; see ``dynarl.bus`` and
    ``docs/wire.md``), so it follows the messages as they change: every field gets values
    of its declared type within its declared bounds, floats finite, strings, bytes,
    tuples and dicts small. Every drawn message survives an encode-decode round trip equal.
    Needs hypothesis (the ``dev`` extra). Raises NotImplementedError for a field type or
    rule it does not know.
    """
    return _valid(mi.type_info(message_type))


def arbitrary_message_strategy(message_type: Any) -> SearchStrategy[Any]:
    """A hypothesis strategy of *arbitrary* instances of a bus message type or union of
    them, for fuzzing decoders: every field gets any value of its declared type, valid or
    not (floats without NaN, so that the round trip of a valid one compares equal).

    Decoding refuses the invalid ones; use :func:`message_strategy` for messages a
    receiver must accept. Needs hypothesis (the ``dev`` extra). Raises
    NotImplementedError for a field type it does not know.
    """
    return _arbitrary(mi.type_info(message_type))
