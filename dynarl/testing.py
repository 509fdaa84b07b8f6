"""Test seams shipped for users: fakes, in-process transports and hypothesis strategies.

``FakeSGLangServer`` and ``FakeSGLangConfig`` (a loopback fake of SGLang 0.5.23's HTTP API)
are imported on first use, since they need the ``sglang`` extra (aiohttp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec.inspect as mi

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from dynarl.backends.sglang_fake import FakeSGLangConfig, FakeSGLangServer

__all__: list[str] = ["FakeSGLangConfig", "FakeSGLangServer", "message_strategy"]

_LAZY = {"FakeSGLangConfig", "FakeSGLangServer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from dynarl.backends import sglang_fake

        return getattr(sglang_fake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_I64 = (-(2**63), 2**63 - 1)


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


def _strategy(info: mi.Type) -> SearchStrategy[Any]:
    from hypothesis import strategies as st  # a dev dependency: imported only when used

    match info:
        case mi.UnionType(types=types):
            return st.one_of(*[_strategy(member) for member in types])
        case mi.StructType(cls=cls, fields=fields):
            return st.builds(cls, **{field.name: _strategy(field.type) for field in fields})
        case mi.IntType():
            low, high = _bounds(info)
            return st.integers(min_value=low, max_value=high)
        case mi.FloatType():
            return st.floats(allow_nan=False)
        case mi.StrType():
            return st.text(max_size=16)
        case mi.BytesType():
            return st.binary(max_size=64)
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.VarTupleType(item_type=item):
            return st.lists(_strategy(item), max_size=4).map(tuple)
        case mi.DictType(key_type=key, value_type=value):
            return st.dictionaries(_strategy(key), _strategy(value), max_size=4)
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
    raise NotImplementedError(f"no strategy for {info!r}")


def message_strategy(message_type: Any) -> SearchStrategy[Any]:
    """A hypothesis strategy of instances of a bus message type or union of them.

    Built from the ``msgspec`` type information, so it follows the messages as they
    change: every field gets arbitrary values of its declared type (floats without NaN,
    so that round trips compare equal). Needs hypothesis (the ``dev`` extra). Raises
    NotImplementedError for a field type it does not know.
    """
    return _strategy(mi.type_info(message_type))
