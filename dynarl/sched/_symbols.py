"""Abstract values and source loading for the graph extractor.

The extractor never imports user code: it parses it with :mod:`ast` and interprets it
abstractly. An expression evaluates to a set of :data:`Value` s (``Vals``): a constant, a
channel with a known name, an internal module, class, function or instance, an external
symbol named by its dotted path (``dynarl.WorkerGroup``, ``queue.Queue``), a container of
values, or :class:`Unknown` with the reason it could not be resolved.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CHANNEL_OPS",
    "MAX_VALUES",
    "Args",
    "ChanV",
    "ClassV",
    "ConstV",
    "Ext",
    "FuncV",
    "InstanceV",
    "Instantiation",
    "MapV",
    "MethodV",
    "Mod",
    "ModuleSource",
    "Scope",
    "SeqV",
    "Sink",
    "Site",
    "SuperV",
    "Unknown",
    "Vals",
    "Value",
    "cap",
    "is_dynarl",
    "load_sources",
    "one",
    "parse",
    "plain_unknown",
    "truth",
    "unpack",
]

CHANNEL_OPS = frozenset({"put", "get"})
"""Channel methods whose calls are dataflow edges."""
MAX_VALUES = 64
"""Most values one expression may have before it becomes unknown."""


@dataclass(frozen=True, slots=True)
class Ext:
    """A symbol outside the analysed sources, by dotted path (``dynarl.Channel``)."""

    path: str


@dataclass(frozen=True, slots=True)
class Mod:
    """An analysed module."""

    name: str


@dataclass(frozen=True, slots=True)
class ClassV:
    """A class defined in the analysed sources (identity: its ``class`` statement)."""

    module: str
    node: ast.ClassDef


@dataclass(frozen=True, slots=True)
class FuncV:
    """A function or lambda of the analysed sources, maybe bound to an instance."""

    module: str
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
    closure: Hashable
    """The scope it was defined in (compared by identity)."""
    self_: InstanceV | None = None
    owner: ClassV | None = None
    """The class whose body defined it, for ``super()``."""


@dataclass(frozen=True, slots=True)
class InstanceV:
    """An instance of an analysed class; ``key`` names its attribute store."""

    cls: ClassV
    key: Hashable


@dataclass(frozen=True, slots=True)
class SuperV:
    """``super()`` inside a method of ``cls`` bound to ``self_``."""

    cls: ClassV
    self_: InstanceV


@dataclass(frozen=True, slots=True)
class ChanV:
    """A channel whose name is known."""

    name: str


@dataclass(frozen=True, slots=True)
class MethodV:
    """A method of a built-in value: a channel operation, ``dict.items`` and the like."""

    target: Value
    name: str


@dataclass(frozen=True, slots=True)
class ConstV:
    """A hashable constant (str, int, float, bool, None, bytes)."""

    value: Hashable


@dataclass(frozen=True, slots=True)
class SeqV:
    """A tuple or list of known length; each item is a set of values."""

    items: tuple[Vals, ...]


@dataclass(frozen=True, slots=True)
class MapV:
    """A dict with constant keys."""

    items: tuple[tuple[Hashable, Vals], ...]

    def get(self, key: Hashable) -> Vals | None:
        """The values stored under ``key``, or None."""
        for k, v in self.items:
            if k == key:
                return v
        return None

    def with_item(self, key: Hashable, value: Vals) -> MapV:
        """A copy with ``key`` set to ``value``."""
        return MapV((*((k, v) for k, v in self.items if k != key), (key, value)))


@dataclass(frozen=True, slots=True)
class Unknown:
    """A value the extractor cannot resolve.

    ``suspicious`` marks values that may be channels (parameters, attributes never
    assigned, non-constant channel names): a ``put``/``get`` on one is reported as an
    unresolved site. Results of external calls are not suspicious.
    """

    reason: str
    suspicious: bool = False


Value = (
    Ext
    | Mod
    | ClassV
    | FuncV
    | InstanceV
    | SuperV
    | ChanV
    | MethodV
    | ConstV
    | SeqV
    | MapV
    | Unknown
)
Vals = frozenset[Value]


def one(value: Value) -> Vals:
    """The set holding just ``value``."""
    return frozenset((value,))


def plain_unknown(reason: str) -> Vals:
    """An unknown value that is not suspected of being a channel."""
    return one(Unknown(reason, suspicious=False))


def is_dynarl(value: Value, name: str) -> bool:
    """Whether ``value`` is dynarl's ``name`` (``WorkerGroup``, ``Channel``), any re-export."""
    if not isinstance(value, Ext):
        return False
    parts = value.path.split(".")
    return parts[0] == "dynarl" and parts[-1] == name


@dataclass(frozen=True, slots=True, order=True)
class Site:
    """A place in the sources."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(slots=True)
class Sink:
    """Channel operations and unresolved sites found while analysing some code."""

    ops: set[tuple[str, str, Site]] = field(default_factory=set)
    unresolved: set[tuple[Site, str]] = field(default_factory=set)

    def merge(self, other: Sink) -> None:
        """Add everything ``other`` found."""
        self.ops |= other.ops
        self.unresolved |= other.unresolved


@dataclass(frozen=True, slots=True)
class Args:
    """Evaluated call arguments; ``open`` when a ``*x``/``**x`` could not be expanded."""

    positional: tuple[Vals, ...] = ()
    keywords: tuple[tuple[str, Vals], ...] = ()
    open: bool = False

    def keyword(self, name: str) -> Vals | None:
        """The values passed as ``name=``, or None."""
        return next((v for k, v in self.keywords if k == name), None)


@dataclass(frozen=True, slots=True)
class Instantiation:
    """A call that builds a component."""

    cls: ClassV
    args: Args
    site: Site


class Scope:
    """Name bindings of a module, class or call; lookups fall through to ``parent``."""

    __slots__ = ("is_class", "module", "names", "owner", "parent", "returns", "self_")

    def __init__(
        self,
        module: str,
        parent: Scope | None,
        *,
        is_class: bool = False,
        owner: ClassV | None = None,
        self_: InstanceV | None = None,
    ) -> None:
        self.module = module
        self.parent = parent
        self.names: dict[str, Vals] = {}
        self.is_class = is_class
        self.owner = owner
        self.self_ = self_
        self.returns: set[Value] = set()

    def lookup(self, name: str) -> Vals | None:
        """The innermost binding of ``name``; class scopes are skipped from inside."""
        scope: Scope | None = self
        while scope is not None:
            if (scope is self or not scope.is_class) and name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None

    def fork(self) -> Scope:
        """A copy whose bindings can diverge (one branch)."""
        copy = Scope(self.module, self.parent, is_class=self.is_class, owner=self.owner)
        copy.self_ = self.self_
        copy.names = dict(self.names)
        copy.returns = self.returns
        return copy

    def join(self, branches: Iterable[Scope]) -> None:
        """Replace the bindings by the union of the branches' (in place)."""
        joined: dict[str, set[Value]] = {}
        for branch in branches:
            for name, vals in branch.names.items():
                joined.setdefault(name, set()).update(vals)
        self.names.clear()
        self.names.update({name: cap(vals) for name, vals in joined.items()})


def cap(values: Iterable[Value]) -> Vals:
    vals = frozenset(values)
    if len(vals) <= MAX_VALUES:
        return vals
    return one(Unknown("too many possible values to track", suspicious=True))


def truth(vals: Vals) -> bool | None:
    truths = {bool(v.value) for v in vals if isinstance(v, ConstV)}
    if len(truths) == 1 and all(isinstance(v, ConstV) for v in vals):
        return truths.pop()
    return None


def unpack(vals: Vals, index: int, length: int) -> Vals:
    out: set[Value] = set()
    for v in vals:
        if isinstance(v, SeqV) and len(v.items) == length:
            out |= v.items[index]
        elif isinstance(v, Unknown):
            out.add(v)
        else:
            out.add(Unknown("unpacked from a value of unknown shape", suspicious=True))
    return cap(out)


@dataclass(frozen=True, slots=True)
class ModuleSource:
    """One module to analyse."""

    name: str
    """Dotted module name."""
    file: str
    """File name used in reports."""
    text: str
    """Source text."""
    is_package: bool = False
    """Whether it is a package's ``__init__``."""


def load_sources(source: str | Mapping[str, str] | os.PathLike[str]) -> list[ModuleSource]:
    """The modules of ``source``: source text, ``{module: text}``, a file or a directory.

    A plain string is one module called ``__main__`` unless it names an existing path.
    In a mapping a module is a package when another module's name extends it. Raises
    ValueError for an empty mapping or a path without Python files.
    """
    if isinstance(source, Mapping):
        if not source:
            raise ValueError("extract_graph needs at least one module")
        names = set(source)
        return [
            ModuleSource(
                name=name,
                file=name.replace(".", "/") + ".py",
                text=text,
                is_package=any(other.startswith(name + ".") for other in names),
            )
            for name, text in sorted(source.items())
        ]
    if isinstance(source, str) and ("\n" in source or not Path(source).exists()):
        return [ModuleSource(name="__main__", file="<source>", text=source)]
    return _load_path(Path(source))


def _load_path(path: Path) -> list[ModuleSource]:
    if path.is_file():
        return [ModuleSource(name=path.stem, file=str(path), text=path.read_text())]
    files = sorted(path.rglob("*.py"))
    if not files:
        raise ValueError(f"no Python files under {path}")
    root = path.parent if (path / "__init__.py").exists() else path
    modules = []
    for file in files:
        parts = list(file.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        if not parts:
            continue
        modules.append(
            ModuleSource(
                name=".".join(parts),
                file=str(file),
                text=file.read_text(),
                is_package=is_package,
            )
        )
    return modules


def parse(module: ModuleSource) -> ast.Module:
    """Parse one module; raises ValueError naming the file and line of a syntax error."""
    try:
        return ast.parse(module.text, filename=module.file)
    except SyntaxError as err:
        raise ValueError(f"{module.file}:{err.lineno}: cannot parse: {err.msg}") from None
