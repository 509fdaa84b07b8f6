"""``extract_graph``: the static pipeline graph read from user code with :mod:`ast`.

Components are classes deriving ``dynarl.WorkerGroup`` (directly, through aliases,
re-exports or analysed base classes). A component instantiated with a constant
``name=`` is a component of that name (one per name, so groups built in a loop over a
constant list are separate components); otherwise the class is the component, named by a
constant ``name`` class attribute or the class name. A component that only serves as a
base of other components is not one itself. Each component's methods are interpreted
(see :mod:`dynarl.sched._interpreter`); a ``put`` on a channel makes it a producer of
that channel, a ``get`` a consumer, and every producer/consumer pair of a channel is an
edge (a component that both puts and gets a channel is not an edge to itself). Sites the
extractor cannot resolve are reported with file, line and reason, never guessed. The
code is never imported or run.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from dynarl.sched._graph import HyperEdge, Hypergraph, HyperNode
from dynarl.sched._interpreter import Interpreter
from dynarl.sched._symbols import (
    Args,
    ClassV,
    ConstV,
    Ext,
    FuncV,
    InstanceV,
    Instantiation,
    Sink,
    Site,
    load_sources,
)
from dynarl.types import ComponentKind

__all__ = [
    "ChannelUse",
    "ExtractedComponent",
    "ExtractedEdge",
    "ExtractedGraph",
    "UnresolvedSite",
    "extract_graph",
]

_MAX_ROUNDS = 6


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtractedComponent:
    """A component found in the sources."""

    name: str
    """Component name."""
    class_name: str
    """Name of its class."""
    site: str
    """``file:line`` of the class statement."""
    kind: ComponentKind | None = None
    """From a constant ``kind`` class attribute, if there is one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtractedEdge:
    """Dataflow from ``src`` to ``dst`` over ``channel``."""

    src: str
    dst: str
    channel: str
    sites: tuple[str, ...]
    """``file:line`` of the producing puts and consuming gets."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChannelUse:
    """Who puts on and who gets from one channel."""

    channel: str
    producers: tuple[str, ...]
    consumers: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class UnresolvedSite:
    """A place the extractor could not resolve, and why."""

    file: str
    line: int
    reason: str
    component: str | None = None
    """Component whose code it is in (None for module-level findings)."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtractedGraph:
    """Components, edges, channel uses and unresolved sites of a pipeline."""

    components: tuple[ExtractedComponent, ...]
    edges: tuple[ExtractedEdge, ...]
    channels: tuple[ChannelUse, ...]
    unresolved: tuple[UnresolvedSite, ...]

    def edge_set(self) -> frozenset[tuple[str, str, str]]:
        """``{(src, dst, channel)}``."""
        return frozenset((e.src, e.dst, e.channel) for e in self.edges)

    def to_hypergraph(self, nodes: Mapping[str, HyperNode] | None = None) -> Hypergraph:
        """A :class:`Hypergraph` of these components and edges.

        ``nodes`` supplies the run-time facts of components (bounds, units, sizes); a
        component not in it needs a constant ``kind``. Raises ValueError otherwise.
        """
        nodes = nodes or {}
        graph = Hypergraph()
        for comp in self.components:
            if comp.name in nodes:
                graph.add_component(nodes[comp.name])
            elif comp.kind is not None:
                graph.add_component(HyperNode(name=comp.name, kind=comp.kind))
            else:
                raise ValueError(f"component {comp.name!r} has no kind; pass a HyperNode for it")
        for edge in self.edges:
            graph.connect(HyperEdge(src=edge.src, dst=edge.dst, channel=edge.channel))
        return graph


@dataclass(slots=True)
class _Component:
    name: str
    cls: ClassV
    bindings: list[Args]


def extract_graph(source: str | Mapping[str, str] | os.PathLike[str]) -> ExtractedGraph:
    """Read the pipeline graph from user code without running it.

    ``source`` is source text, a ``{module name: source text}`` mapping (for packages
    and re-exports), or a path to a file or package directory. Raises ValueError for
    unparsable code (naming file and line) or an empty source.
    """
    interp = Interpreter(load_sources(source))
    for name in sorted(interp.trees):
        interp.module_scope(name)
    _run_uncalled(interp)
    interp.recording = False
    components = _components(interp)
    found = {comp.name: _analyse(interp, comp) for comp in components}
    return _assemble(interp, components, found)


def _run_uncalled(interp: Interpreter) -> None:
    """Interpret functions nobody called, to find the components they build."""
    interp.sink = Sink()
    for name, tree in sorted(interp.trees.items()):
        scope = interp.module_scopes[name]
        for stmt in tree.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                funcs = [v for v in scope.names.get(stmt.name, ()) if isinstance(v, FuncV)]
            elif isinstance(stmt, ast.ClassDef) and stmt in interp.classes:
                cls = interp.classes[stmt].value
                if interp.is_component(cls):
                    continue
                funcs = list(_methods(interp, cls, InstanceV(cls, ("standalone", stmt))).values())
            else:
                continue
            for func in funcs:
                if func.node not in interp.invoked:
                    interp.invoke(func, Args(), interp.site(scope, func.node))


def _class_constant(interp: Interpreter, cls: ClassV, attr: str) -> object:
    vals = interp.class_attr(cls, attr, bound=None, fallback=False) or frozenset()
    if len(vals) != 1:
        return None
    value = next(iter(vals))
    if isinstance(value, ConstV):
        return value.value
    if isinstance(value, Ext) and ".ComponentKind." in value.path:
        return ComponentKind[value.path.rsplit(".", 1)[1]].value
    return None


def _components(interp: Interpreter) -> list[_Component]:
    classes = [info.value for info in interp.classes.values() if interp.is_component(info.value)]
    built: dict[ClassV, list[Instantiation]] = defaultdict(list)
    for inst in interp.instantiations:
        built[inst.cls].append(inst)
    found: dict[str, _Component] = {}

    def add(name: str, cls: ClassV, bindings: list[Args], site: Site) -> None:
        if name in found and found[name].cls != cls:
            interp.issues.add((site, f"component name {name!r} is used by two classes"))
        found.setdefault(name, _Component(name, cls, [])).bindings.extend(bindings)

    for cls in classes:
        declared = _class_constant(interp, cls, "name")
        default = declared if isinstance(declared, str) else cls.node.name
        site = interp.site(interp.module_scopes[cls.module], cls.node)
        insts = built.get(cls, [])
        if not insts:
            if not any(o != cls and cls in interp.mro(o)[0] for o in classes):
                add(default, cls, [], site)
            continue
        for inst in insts:
            names = inst.args.keyword("name")
            if names is None:
                add(default, cls, [inst.args], inst.site)
                continue
            for v in names:
                if isinstance(v, ConstV) and isinstance(v.value, str):
                    add(v.value, cls, [inst.args], inst.site)
                else:
                    interp.issues.add((inst.site, "component name is not a constant"))
    return [found[name] for name in sorted(found)]


def _methods(interp: Interpreter, cls: ClassV, instance: InstanceV) -> dict[str, FuncV]:
    order, _ = interp.mro(cls)
    methods: dict[str, FuncV] = {}
    for current in reversed(order):
        for name, vals in interp.classes[current.node].namespace.items():
            for v in vals:
                if isinstance(v, FuncV) and not isinstance(v.node, ast.Lambda):
                    methods[name] = FuncV(
                        v.module, v.node, v.closure, self_=instance, owner=v.owner
                    )
    return methods


def _referenced(methods: dict[str, FuncV]) -> set[str]:
    """Methods some method reaches through ``self.<name>`` (analysed where used)."""
    names: set[str] = set()
    for func in methods.values():
        assert not isinstance(func.node, ast.Lambda)
        params = func.node.args.posonlyargs + func.node.args.args
        if not params:
            continue
        self_name = params[0].arg
        for node in ast.walk(func.node):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == self_name
                and node.attr != func.node.name
            ):
                names.add(node.attr)
    return names & set(methods)


def _analyse(interp: Interpreter, comp: _Component) -> Sink:
    """Interpret a component's methods until its attributes stop changing."""
    instance = InstanceV(comp.cls, ("component", comp.name))
    interp.stores.setdefault(instance.key, {})
    methods = _methods(interp, comp.cls, instance)
    entries = sorted(set(methods) - _referenced(methods) - {"__init__"})
    init = methods.get("__init__")
    scope = interp.module_scopes[comp.cls.module]
    for _ in range(_MAX_ROUNDS):
        interp.changed = False
        interp.new_round()
        interp.sink = Sink()
        if init is not None:
            for args in comp.bindings or [Args()]:
                interp.invoke(init, args, interp.site(scope, init.node))
        for name in entries:
            interp.invoke(methods[name], Args(), interp.site(scope, methods[name].node))
        if not interp.changed:
            break
    return interp.sink


def _assemble(
    interp: Interpreter, components: list[_Component], found: dict[str, Sink]
) -> ExtractedGraph:
    puts: dict[str, dict[str, set[Site]]] = defaultdict(lambda: defaultdict(set))
    gets: dict[str, dict[str, set[Site]]] = defaultdict(lambda: defaultdict(set))
    unresolved = {UnresolvedSite(file=s.file, line=s.line, reason=r) for s, r in interp.issues}
    for name, sink in found.items():
        for channel, op, site in sink.ops:
            (puts if op == "put" else gets)[channel][name].add(site)
        unresolved |= {
            UnresolvedSite(file=s.file, line=s.line, reason=r, component=name)
            for s, r in sink.unresolved
        }
    edges = []
    channels = []
    for channel in sorted(set(puts) | set(gets)):
        producers, consumers = puts[channel], gets[channel]
        channels.append(
            ChannelUse(
                channel=channel,
                producers=tuple(sorted(producers)),
                consumers=tuple(sorted(consumers)),
            )
        )
        for src in sorted(producers):
            for dst in sorted(consumers):
                if src != dst:
                    sites = sorted(producers[src] | consumers[dst])
                    edges.append(
                        ExtractedEdge(
                            src=src, dst=dst, channel=channel, sites=tuple(map(str, sites))
                        )
                    )
    extracted = []
    for comp in components:
        kind = _class_constant(interp, comp.cls, "kind")
        site = interp.site(interp.module_scopes[comp.cls.module], comp.cls.node)
        extracted.append(
            ExtractedComponent(
                name=comp.name,
                class_name=comp.cls.node.name,
                site=str(site),
                kind=ComponentKind(str(kind)) if kind in set(ComponentKind) else None,
            )
        )
    return ExtractedGraph(
        components=tuple(extracted),
        edges=tuple(edges),
        channels=tuple(channels),
        unresolved=tuple(sorted(unresolved, key=lambda u: (u.file, u.line, u.reason))),
    )
