"""Differential: random pipelines rendered in mixed code styles extract to their true graph.

Each generated pipeline has a known set of components and channel operations; every
operation is written in one of several styles (global channel, attribute set in
``__init__``, constructor argument, helper function, wrapper object, ``getattr`` with a
constant, dict lookup, loop over a tuple). The extractor must return exactly the true
edges (100% recall, no false edge) and no unresolved site; unresolvable operations mixed
in must each be reported at their line, and must add no edge.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from dynarl.sched import extract_graph

STYLES = ("global", "attr", "ctor", "helper", "wrapper", "getattr", "dict", "loop")
BASES = ("dynarl.WorkerGroup", "WG", "Base", "dr.WorkerGroup")


@dataclass(frozen=True)
class Op:
    component: int
    channel: int
    kind: str
    style: str


def render(num_components: int, ops: list[Op], bases: list[str], broken: list[int]) -> str:
    lines = [
        "import dynarl",
        "import dynarl as dr",
        "from dynarl import WorkerGroup as WG, Channel",
        "Base = dr.WorkerGroup",
        "CH = {i: Channel(f'ch{i}') for i in range(8)}",
        "C0, C1, C2, C3, C4, C5, C6, C7 = [CH[i] for i in range(8)]",
        "def do(ch, kind):",
        "    return getattr(ch, kind)()",
        "class Box:",
        "    def __init__(self, ch):",
        "        self.ch = ch",
        "    def act(self, kind):",
        "        return do(self.ch, kind)",
    ]
    for c in range(num_components):
        mine = [op for op in ops if op.component == c]
        lines += [f"class Comp{c}({bases[c]}):", "    def __init__(self, injected=None):"]
        lines += ["        self.injected = injected"]
        for i, op in enumerate(mine):
            lines.append(f"        self.a{i} = C{op.channel}")
            lines.append(f"        self.b{i} = Box(CH[{op.channel}])")
        lines.append("    def run(self, unknown):")
        for i, op in enumerate(mine):
            lines.append("        " + statement(op, i))
        if c in broken:
            lines.append("        unknown.put(0)")
        lines.append("        return None")
    for c in range(num_components):
        ctor = [op for op in ops if op.component == c and op.style == "ctor"]
        arg = f"C{ctor[0].channel}" if ctor else "None"
        lines.append(f"comp{c} = Comp{c}(injected={arg})")
    return "\n".join(lines) + "\n"


def statement(op: Op, i: int) -> str:
    call = f"{op.kind}()"
    return {
        "global": f"C{op.channel}.{call}",
        "attr": f"self.a{i}.{call}",
        "ctor": f"self.injected.{call}",
        "helper": f"do(C{op.channel}, '{op.kind}')",
        "wrapper": f"self.b{i}.act('{op.kind}')",
        "getattr": f"getattr(self.a{i}, '{op.kind}')()",
        "dict": f"CH[{op.channel}].{call}",
        "loop": f"for ch in (C{op.channel},): ch.{call}",
    }[op.style]


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[int, list[Op], list[str], list[int]]:
    n = draw(st.integers(2, 6))
    ops = draw(
        st.lists(
            st.builds(
                Op,
                component=st.integers(0, n - 1),
                channel=st.integers(0, 7),
                kind=st.sampled_from(("put", "get")),
                style=st.sampled_from(STYLES),
            ),
            max_size=14,
        )
    )
    # One constructor-injected channel per component (the rendering injects one).
    injected: set[int] = set()
    kept = []
    for op in ops:
        if op.style == "ctor" and op.component in injected:
            op = Op(op.component, op.channel, op.kind, "global")
        elif op.style == "ctor":
            injected.add(op.component)
        kept.append(op)
    bases = draw(st.lists(st.sampled_from(BASES), min_size=n, max_size=n))
    broken = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=2))
    return n, kept, bases, broken


def true_edges(ops: list[Op]) -> set[tuple[str, str, str]]:
    puts = {(op.component, op.channel) for op in ops if op.kind == "put"}
    gets = {(op.component, op.channel) for op in ops if op.kind == "get"}
    return {
        (f"Comp{p}", f"Comp{g}", f"ch{ch}")
        for p, ch in puts
        for g, ch2 in gets
        if ch == ch2 and p != g
    }


@given(pipelines())
def test_random_pipelines_extract_exactly(
    pipeline: tuple[int, list[Op], list[str], list[int]],
) -> None:
    n, ops, bases, broken = pipeline
    source = render(n, ops, bases, broken)
    graph = extract_graph(source)
    assert {c.name for c in graph.components} == {f"Comp{c}" for c in range(n)}
    assert graph.edge_set() == true_edges(ops), source
    reported = {(u.component, u.line) for u in graph.unresolved}
    expected = {
        (f"Comp{c}", i)
        for i, line in enumerate(source.splitlines(), 1)
        for c in broken
        if line.strip() == "unknown.put(0)" and _owner(source, i) == f"Comp{c}"
    }
    assert reported == expected, source


def _owner(source: str, line: int) -> str:
    for text in reversed(source.splitlines()[:line]):
        if text.startswith("class Comp"):
            return text.split("(")[0].removeprefix("class ")
    raise AssertionError("no owner")
