"""A job's start-up graph check: its declared components against the graph of its roles' code.

A :class:`~dynarl.runtime.Job` reads the pipeline graph out of the modules that define its
roles with :func:`~dynarl.sched.extract_graph` (the code is parsed, never run) and compares
it with the components it declares. Two findings:

- ``undeclared``: the code sends over a channel between a declared component and a role
  the job does not declare, in either direction — data no worker of this job puts or gets;
- ``unused``: a declared component whose class the extractor analysed puts and gets on no
  channel of the code (and no role gets its declared output channel) while another
  declared component does. A pipeline whose roles exchange nothing over channels (driven
  from the user's loop with ``submit``, ``output`` and ``call``) has no unused component.

Components are named as the runtime names them (``WorkerGroup.spec.name``), which the
extractor does not read from class keywords; the extractor's name stays for a class not
found in its module. A serving component's declared output channel counts as a put of
that component (the runtime puts its results there). Edges between two undeclared roles
(another pipeline in the same modules) are not this job's and are ignored.

A finding is a warning, never an error: AST extraction misses dynamic code. A role module
without source (compiled, typed into an interpreter) or that does not parse is skipped,
and so is every site the extractor cannot resolve (a channel named at run time, a dynamic
send): a finding is a hint to look, and a clean check says nothing of dynamic code.

:func:`read_role_graph` reads the role modules' sources (I/O); :func:`check_graph` is the
pure check; :func:`check_roles` is both, what a job calls while its workers start (in a
thread: parsing is CPU work, off the event loop).
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from dynarl.bus import WorkerGroup
from dynarl.runtime._spec import ComponentSpec
from dynarl.sched import ExtractedGraph, GraphFindingRecord, extract_graph

__all__ = [
    "DeclaredComponent",
    "GraphCheck",
    "GraphFinding",
    "RoleGraph",
    "check_graph",
    "check_roles",
    "read_role_graph",
]

FindingKind = Literal["undeclared", "unused"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DeclaredComponent:
    """A component a job declares, as the graph check sees it."""

    name: str
    """Component name (its role's ``spec.name``)."""
    output: str | None = None
    """Channel the runtime puts its served results into (serving components), else None."""

    @classmethod
    def of(cls, spec: ComponentSpec) -> DeclaredComponent:
        """The declared component of ``spec``."""
        return cls(name=spec.name, output=spec.output_channel if spec.serving else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoleGraph:
    """What the role modules' code shows."""

    graph: ExtractedGraph | None
    """The graph read from the role modules (None: no module could be read)."""
    names: Mapping[str, str] = field(default_factory=dict)
    """Runtime name of each extracted component whose class was found, by extracted name."""
    skipped: tuple[str, ...] = ()
    """Role modules not read, each as ``module: why``."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Source file of each file name the graph's sites use, where they differ."""

    def site(self, site: str) -> str:
        """``site`` (``file:line``) with its source file's path."""
        file, _, line = site.rpartition(":")
        return f"{self.files.get(file, file)}:{line}"


@dataclass(frozen=True, kw_only=True, slots=True)
class GraphFinding:
    """One difference between the declared components and the graph of the code."""

    finding: FindingKind
    """``undeclared`` or ``unused`` (see the module docstring)."""
    component: str
    """The undeclared role, or the unused declared component."""
    src: str = ""
    """Producer of the undeclared edge ("" for ``unused``)."""
    dst: str = ""
    """Consumer of the undeclared edge ("" for ``unused``)."""
    channel: str = ""
    """Channel of the undeclared edge ("" for ``unused``)."""
    sites: tuple[str, ...] = ()
    """``file:line`` of the puts and gets behind it (of the class, for ``unused``)."""

    def __str__(self) -> str:
        where = f" ({', '.join(self.sites)})" if self.sites else ""
        if self.finding == "undeclared":
            return (
                f"the code sends {self.src} -> {self.dst} over channel {self.channel!r}, "
                f"but the job declares no component {self.component!r}{where}"
            )
        return (
            f"declared component {self.component!r} puts and gets on no channel "
            f"of the roles' code{where}"
        )

    def record(self, record_id: str, time: float) -> GraphFindingRecord:
        """This finding as a ledger record with ``record_id`` at job-clock ``time``."""
        return GraphFindingRecord(
            record_id=record_id,
            time=time,
            finding=self.finding,
            component=self.component,
            src=self.src,
            dst=self.dst,
            channel=self.channel,
            sites=self.sites,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class GraphCheck:
    """The result of a graph check: its findings and what it could not judge."""

    findings: tuple[GraphFinding, ...] = ()
    """Undeclared edges (by src, dst, channel), then unused components (by name)."""
    skipped: tuple[str, ...] = ()
    """Role modules not read, each as ``module: why``."""
    num_unresolved: int = 0
    """Sites of the code the extractor could not resolve (not judged)."""


def check_graph(declared: Sequence[DeclaredComponent], code: RoleGraph) -> GraphCheck:
    """Compare ``declared`` with the graph of ``code`` (see the module docstring).

    Pure; raises nothing.
    """
    graph = code.graph
    if graph is None:
        return GraphCheck(skipped=code.skipped)
    names = {d.name for d in declared}
    edges, used = _edges(declared, graph, code.names)
    findings = [
        GraphFinding(
            finding="undeclared",
            component=dst if src in names else src,
            src=src,
            dst=dst,
            channel=channel,
            sites=tuple(code.site(s) for s in sites),
        )
        for (src, dst, channel), sites in sorted(edges.items())
        if (src in names) != (dst in names)
    ]
    if names & used:
        analysed: dict[str, str] = {}
        for comp in graph.components:
            analysed.setdefault(code.names.get(comp.name, comp.name), comp.site)
        findings += [
            GraphFinding(finding="unused", component=name, sites=(code.site(analysed[name]),))
            for name in sorted((names & set(analysed)) - used)
        ]
    return GraphCheck(
        findings=tuple(findings), skipped=code.skipped, num_unresolved=len(graph.unresolved)
    )


def _edges(
    declared: Sequence[DeclaredComponent], graph: ExtractedGraph, rename: Mapping[str, str]
) -> tuple[dict[tuple[str, str, str], tuple[str, ...]], set[str]]:
    """``{(src, dst, channel): sites}`` of the code plus the declared output channels,
    under runtime names, and every component that puts or gets on some channel."""
    edges: dict[tuple[str, str, str], tuple[str, ...]] = {}
    for edge in graph.edges:
        key = (rename.get(edge.src, edge.src), rename.get(edge.dst, edge.dst), edge.channel)
        if key[0] != key[1]:
            edges[key] = tuple(sorted({*edges.get(key, ()), *edge.sites}))
    used: set[str] = set()
    for use in graph.channels:
        consumers = {rename.get(n, n) for n in use.consumers}
        used |= consumers | {rename.get(n, n) for n in use.producers}
        for comp in declared:
            if comp.output == use.channel:
                for dst in consumers - {comp.name}:
                    edges.setdefault((comp.name, dst, use.channel), ())
                    used.add(comp.name)
    return edges, used


def read_role_graph(roles: Iterable[type[WorkerGroup]]) -> RoleGraph:
    """Extract the graph of the modules that define ``roles`` (each already imported).

    A module without source or that does not parse is skipped (and named in
    :attr:`RoleGraph.skipped`). Reads source files; runs in the caller's thread.
    """
    roles = list(roles)
    sources: dict[str, str] = {}
    files: dict[str, str] = {}
    skipped: list[str] = []
    for name in sorted({role.__module__ for role in roles}):
        try:
            module = sys.modules[name]
            text = inspect.getsource(module)
            ast.parse(text)
        except (KeyError, OSError, TypeError, SyntaxError, ValueError) as exc:
            skipped.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        sources[name] = text
        files[_file_of(name)] = inspect.getsourcefile(module) or _file_of(name)
    if not sources:
        return RoleGraph(graph=None, skipped=tuple(skipped))
    try:
        graph = extract_graph(sources)
    except (ValueError, RecursionError) as exc:
        skipped += [f"{name}: {type(exc).__name__}: {exc}" for name in sources]
        return RoleGraph(graph=None, skipped=tuple(skipped))
    names = _runtime_names(graph, roles, sources)
    return RoleGraph(graph=graph, names=names, skipped=tuple(skipped), files=files)


def _file_of(module: str) -> str:
    """The file name extract_graph gives module ``module`` read from text."""
    return module.replace(".", "/") + ".py"


def _runtime_names(
    graph: ExtractedGraph, roles: Sequence[type[WorkerGroup]], sources: Mapping[str, str]
) -> dict[str, str]:
    """``{extracted name: spec.name}`` for each extracted component whose class is one of
    ``roles`` or a ``WorkerGroup`` subclass with a spec of its own in its module."""
    known = {(role.__module__, role.__name__): role for role in roles}
    files = {_file_of(name): name for name in sources}
    names: dict[str, str] = {}
    for comp in graph.components:
        module = files.get(comp.site.rpartition(":")[0])
        for candidate in [module] if module is not None else sorted(sources):
            cls = known.get((candidate, comp.class_name)) or getattr(
                sys.modules.get(candidate), comp.class_name, None
            )
            spec = vars(cls).get("spec") if isinstance(cls, type) else None
            if isinstance(cls, type) and issubclass(cls, WorkerGroup) and spec is not None:
                names[comp.name] = spec.name
                break
    return names


def check_roles(specs: Sequence[ComponentSpec]) -> GraphCheck:
    """The graph check of a job made of ``specs``: :func:`read_role_graph` on their roles,
    then :func:`check_graph`. Reads source files; call it off the event loop."""
    declared = [DeclaredComponent.of(spec) for spec in specs]
    return check_graph(declared, read_role_graph(spec.role for spec in specs))
