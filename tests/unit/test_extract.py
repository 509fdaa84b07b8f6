"""extract_graph on pipelines whose nodes, edges and unresolved sites are known."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dynarl.sched import extract_graph
from dynarl.sched._extract import ExtractedGraph
from dynarl.types import ComponentKind


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def names(graph: ExtractedGraph) -> set[str]:
    return {c.name for c in graph.components}


def lines(graph: ExtractedGraph) -> set[int]:
    return {u.line for u in graph.unresolved}


def line_of(text: str, needle: str) -> int:
    """1-based line of the only line of ``text`` containing ``needle``."""
    (found,) = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return found


ALIASES = src(
    """
    import dynarl as dr
    from dynarl import Channel as Ch, WorkerGroup as WG
    from dynarl.bus import WorkerGroup

    Base = dr.WorkerGroup
    make = Ch
    PROMPTS = make("prompts")
    SAMPLES = dr.Channel(name="samples")
    SCORED = Ch("scored")

    class Rollout(Base):
        kind = dr.ComponentKind.ROLLOUT
        async def run(self):
            await SAMPLES.put(await PROMPTS.get())

    class Reward(WG):
        async def run(self):
            item = await SAMPLES.get()
            await SCORED.put(item)

    class Trainer(WorkerGroup):
        name = "actor"
        kind = "trainer"
        async def run(self):
            batch = await SCORED.get()
            cache = {}
            cache.get("x")
            return batch

    class NotAComponent:
        def run(self):
            SAMPLES.put(1)
    """
)


def test_aliases_and_declared_names() -> None:
    graph = extract_graph(ALIASES)
    assert names(graph) == {"Rollout", "Reward", "actor"}
    assert graph.edge_set() == {
        ("Rollout", "Reward", "samples"),
        ("Reward", "actor", "scored"),
    }
    kinds = {c.name: c.kind for c in graph.components}
    assert kinds == {"Rollout": ComponentKind.ROLLOUT, "Reward": None, "actor": "trainer"}
    assert graph.unresolved == ()
    uses = {u.channel: (u.producers, u.consumers) for u in graph.channels}
    assert uses["prompts"] == ((), ("Rollout",))


HELPERS = src(
    """
    from dynarl import Channel, WorkerGroup

    def channel_for(stage):
        return Channel(f"{stage}-out")

    def forward(src, dst, transform=None):
        item = src.get()
        dst.put(item)
        return item

    async def drain(ch):
        while True:
            await ch.get()

    GEN = channel_for("gen")
    REF = channel_for("ref")

    class Generator(WorkerGroup):
        def run(self):
            self.send(GEN, 1)
        def send(self, ch, item):
            ch.put(item)

    class RefModel(WorkerGroup):
        def run(self):
            forward(GEN, REF)

    class Sink(WorkerGroup):
        async def run(self):
            await drain(REF)
    """
)


def test_helper_functions_and_helper_methods() -> None:
    graph = extract_graph(HELPERS)
    assert graph.edge_set() == {
        ("Generator", "RefModel", "gen-out"),
        ("RefModel", "Sink", "ref-out"),
    }
    assert graph.unresolved == ()


REEXPORTS = {
    "pipe": src(
        """
        from dynarl import WorkerGroup as Component
        from .channels import *
        from .workers.rollout import Rollout
        """
    ),
    "pipe.channels": src(
        """
        import dynarl
        PROMPTS = dynarl.Channel("prompts")
        TRAJ = dynarl.Channel("trajectories")
        """
    ),
    "pipe.workers": "",
    "pipe.workers.rollout": src(
        """
        from .. import channels
        from ..channels import PROMPTS

        class Rollout(__import__("dynarl").WorkerGroup):
            pass

        from pipe import Component

        class RealRollout(Component):
            def run(self):
                channels.TRAJ.put(PROMPTS.get())
        Rollout = RealRollout
        """
    ),
    "train": src(
        """
        import pipe
        from pipe import Component, TRAJ
        import pipe.workers.rollout as ro

        class Learner(pipe.Component):
            def step(self):
                return TRAJ.get()

        class Tail(ro.Rollout):
            def run(self):
                super().run()

        ROLLOUT = ro.Rollout(name="rollout")
        """
    ),
}


def test_reexports_across_modules() -> None:
    graph = extract_graph(REEXPORTS)
    assert names(graph) == {"Learner", "rollout", "Tail"}
    assert graph.edge_set() == {
        ("rollout", "Learner", "trajectories"),
        ("Tail", "Learner", "trajectories"),
    }
    # `__import__("dynarl").WorkerGroup` is an external call result: reported, not guessed.
    (issue,) = graph.unresolved
    assert issue.file == "pipe/workers/rollout.py"
    assert issue.line == line_of(REEXPORTS["pipe.workers.rollout"], "__import__")
    assert "base `__import__('dynarl').WorkerGroup`" in issue.reason


def test_package_directory(tmp_path: Path) -> None:
    for module, text in REEXPORTS.items():
        parts = module.split(".")
        is_package = any(other.startswith(module + ".") for other in REEXPORTS)
        path = tmp_path.joinpath(*parts, "__init__.py") if is_package else None
        path = path or tmp_path.joinpath(*parts[:-1], parts[-1] + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = extract_graph(tmp_path)
    assert graph.edge_set() == extract_graph(REEXPORTS).edge_set()
    assert {u.line for u in graph.unresolved} == {4}


WRAPPERS = src(
    """
    import functools
    from dataclasses import dataclass
    import dynarl

    A = dynarl.Channel("a")
    B = dynarl.Channel("b")
    C = dynarl.Channel("c")

    def traced(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)
        return inner

    def retrying(fn, attempts=3):
        def call(*args):
            for _ in range(attempts):
                return fn(*args)
        return call

    def raw_send(ch, item):
        return ch.put(item)

    send = retrying(raw_send)

    class Outbox:
        def __init__(self, channel):
            self.channel = channel
        def emit(self, item):
            self.channel.put(item)

    @dataclass
    class Ports:
        inbox: dynarl.Channel
        outbox: dynarl.Channel

    class Producer(dynarl.WorkerGroup):
        def __init__(self):
            self.out = Outbox(A)
        @traced
        def run(self):
            self.out.emit(1)
            send(B, 2)

    class Consumer(dynarl.WorkerGroup):
        def __init__(self):
            self.ports = Ports(A, C)
        def run(self):
            x = self.ports.inbox.get()
            traced(self.ports.outbox.put)(x)

    class Last(dynarl.WorkerGroup):
        def run(self):
            C.get()
            B.get()
    """
)


def test_wrappers_decorators_and_holder_objects() -> None:
    graph = extract_graph(WRAPPERS)
    assert graph.edge_set() == {
        ("Producer", "Consumer", "a"),
        ("Producer", "Last", "b"),
        ("Consumer", "Last", "c"),
    }
    assert graph.unresolved == ()


DISPATCH = src(
    """
    import dynarl
    OUT = {"fast": dynarl.Channel("fast"), "slow": dynarl.Channel("slow")}
    IN = dynarl.Channel("in")

    class Router(dynarl.WorkerGroup):
        def __init__(self):
            self.inbox = IN
        def run(self, kind):
            item = getattr(self.inbox, "get")()
            for k in ("fast", "slow"):
                getattr(self, "emit_" + k)(item)
            getattr(self, kind)(item)
            getattr(self.inbox, kind)()
        def emit_fast(self, item):
            OUT["fast"].put(item)
        def emit_slow(self, item):
            OUT["slow"].put(item)

    class Feeder(dynarl.WorkerGroup):
        def run(self):
            IN.put(0)

    class Fast(dynarl.WorkerGroup):
        def run(self):
            OUT["fast"].get()

    class Slow(dynarl.WorkerGroup):
        def run(self):
            OUT.get("slow").get()
    """
)


def test_getattr_dispatch() -> None:
    graph = extract_graph(DISPATCH)
    assert graph.edge_set() == {
        ("Feeder", "Router", "in"),
        ("Router", "Fast", "fast"),
        ("Router", "Slow", "slow"),
    }
    # getattr(self, kind)(item) and getattr(self.inbox, kind)() cannot be resolved.
    assert lines(graph) == {
        line_of(DISPATCH, "getattr(self, kind)"),
        line_of(DISPATCH, "getattr(self.inbox, kind)"),
    }
    assert all(u.component == "Router" for u in graph.unresolved)
    assert all("non-constant attribute" in u.reason for u in graph.unresolved)


LOOPS = src(
    """
    import dynarl
    from dynarl import Channel

    STAGES = ["gen", "score", "filter", "train"]
    CH = {s: Channel(f"{s}-out") for s in STAGES}
    QUEUES = []
    for i in range(2):
        QUEUES.append(Channel(f"q{i}"))

    class Relay(dynarl.WorkerGroup):
        def __init__(self, name, src, dst):
            self.src, self.dst = src, dst
        async def run(self):
            await self.dst.put(await self.src.get())

    class Source(dynarl.WorkerGroup):
        async def run(self):
            await CH["gen"].put(0)
            for q in QUEUES:
                await q.put(1)

    class Sink(dynarl.WorkerGroup):
        async def run(self):
            await CH["train"].get()
            await QUEUES[1].get()

    def build():
        groups = []
        for up, down in zip(STAGES[:-1], STAGES[1:]):
            groups.append(Relay(name=up + "->" + down, src=CH[up], dst=CH[down]))
        return groups

    for extra in ("a", "b"):
        globals()[extra] = type(extra, (dynarl.WorkerGroup,), {})
    """
)


def test_components_built_in_a_loop() -> None:
    graph = extract_graph(LOOPS)
    assert names(graph) == {"Source", "Sink", "gen->score", "score->filter", "filter->train"}
    assert graph.edge_set() == {
        ("Source", "gen->score", "gen-out"),
        ("gen->score", "score->filter", "score-out"),
        ("score->filter", "filter->train", "filter-out"),
        ("filter->train", "Sink", "train-out"),
        ("Source", "Sink", "q1"),
    }
    (issue,) = graph.unresolved
    assert issue.line == line_of(LOOPS, "type(extra") and "type()" in issue.reason


UNRESOLVABLE = src(
    """
    import os
    import queue
    import dynarl

    NAMED = dynarl.Channel(os.environ["CHANNEL"])
    KNOWN = dynarl.Channel("known")

    class Worker(dynarl.WorkerGroup):
        def __init__(self, out: dynarl.Channel, size: int = 3):
            self.out = out
            self.local = queue.Queue()
        def run(self, ch, table: dict):
            NAMED.put(1)
            self.out.put(2)
            ch.get()
            self.missing.put(3)
            self.local.put(4)
            table.get("k")
            KNOWN.put(5)

    class Reader(dynarl.WorkerGroup):
        def run(self):
            KNOWN.get()
    """
)


def test_unresolvable_sites_are_reported_with_reasons() -> None:
    graph = extract_graph(UNRESOLVABLE)
    assert graph.edge_set() == {("Worker", "Reader", "known")}
    by_line = {u.line: u.reason for u in graph.unresolved}
    at = {needle: line_of(UNRESOLVABLE, needle) for needle in ("NAMED.put", "self.out.put")}
    at |= {needle: line_of(UNRESOLVABLE, needle) for needle in ("ch.get", "self.missing")}
    assert set(by_line) == set(at.values())
    assert "channel name `os.environ['CHANNEL']` is not a constant" in by_line[at["NAMED.put"]]
    assert "`out` is a parameter of `__init__`" in by_line[at["self.out.put"]]
    assert "`ch` is a parameter of `run`" in by_line[at["ch.get"]]
    assert "`missing` comes from base `dynarl.WorkerGroup`" in by_line[at["self.missing"]]
    assert all(str(u).startswith(f"<source>:{u.line}: ") for u in graph.unresolved)


def test_branches_union_and_constant_branches_prune() -> None:
    graph = extract_graph(
        src(
            """
            import dynarl
            DEBUG = False
            A, B, C = dynarl.Channel("a"), dynarl.Channel("b"), dynarl.Channel("c")

            class P(dynarl.WorkerGroup):
                def run(self, flag: bool):
                    ch = A if flag else B
                    ch.put(0)
                    if DEBUG:
                        C.put(0)

            class Q(dynarl.WorkerGroup):
                def run(self):
                    A.get(); B.get(); C.get()
            """
        )
    )
    assert graph.edge_set() == {("P", "Q", "a"), ("P", "Q", "b")}


def test_abstract_bases_are_not_components() -> None:
    graph = extract_graph(
        src(
            """
            import dynarl
            X = dynarl.Channel("x")
            class Base(dynarl.WorkerGroup):
                out = X
                def run(self):
                    self.out.put(0)
            class Left(Base):
                pass
            class Right(dynarl.WorkerGroup):
                def run(self):
                    X.get()
            """
        )
    )
    assert names(graph) == {"Left", "Right"}
    assert graph.edge_set() == {("Left", "Right", "x")}


def test_to_hypergraph_and_bad_input() -> None:
    graph = extract_graph(ALIASES)
    with pytest.raises(ValueError, match="'Reward' has no kind"):
        graph.to_hypergraph()
    from dynarl.sched import HyperNode

    hyper = graph.to_hypergraph({"Reward": HyperNode(name="Reward", kind=ComponentKind.REWARD)})
    assert hyper.successors("Rollout") == ("Reward",)
    assert hyper.predecessors("actor") == ("Reward",)
    with pytest.raises(ValueError, match="<source>:1: cannot parse"):
        extract_graph("def (:\n")
    with pytest.raises(ValueError, match="at least one module"):
        extract_graph({})


BOUNDED = src(
    """
    import dynarl
    A = dynarl.Channel("a")

    def ping(n, ch):
        return pong(n, ch) if n else ch

    def pong(n, ch):
        return ping(n - 1, ch)

    def fan(ch, k):
        ch.put(k)

    class P(dynarl.WorkerGroup):
        def run(self):
            ping(10, A).put(0)
            while True:
                for i in range(10_000):
                    fan(A, i)
            for k in range(20):
                fan(A, k)

    class Q(dynarl.WorkerGroup):
        def run(self):
            A.get()
    """
)


def test_recursion_and_huge_loops_terminate() -> None:
    graph = extract_graph(BOUNDED)
    assert graph.edge_set() == {("P", "Q", "a")}
    assert graph.unresolved == ()


def test_widening_and_budget_are_reported_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    import dynarl.sched._interpreter as interpreter

    monkeypatch.setattr(interpreter, "MAX_CONTEXTS", 4)
    widened = extract_graph(BOUNDED)
    # `fan` and the ping/pong recursion met more than 4 argument contexts: each is then
    # analysed once with unknown arguments, and the channel sites inside are reported.
    by_line = {u.line: u.reason for u in widened.unresolved}
    assert set(by_line) == {line_of(BOUNDED, "ch.put(k)"), line_of(BOUNDED, "ping(10, A)")}
    assert "`ch` is a parameter of `fan`" in by_line[line_of(BOUNDED, "ch.put(k)")]
    assert widened.edge_set() == {("P", "Q", "a")}  # Q's get and fan's early contexts
    monkeypatch.setattr(interpreter, "MAX_STEPS", 5)
    spent = extract_graph(BOUNDED)
    assert any("analysis budget of 5 statements spent" in u.reason for u in spent.unresolved)
