"""The sample manifest against a model of injected faults, and against a scripted rollout
engine whose workload migration does (buggy) or does not (fixed) return a sequence that
sits at its length limit twice — the RLinf #303 bug class."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from dynarl.runtime.durable._manifest import Manifest

FAULTS = ("none", "none", "drop", "train_twice", "output_twice", "score_twice")


@st.composite
def stories(draw: st.DrawFn) -> tuple[list[tuple[str, str, int]], dict[str, str]]:
    """Per-sample event sequences with one injected fault each, randomly interleaved."""
    num = draw(st.integers(1, 12))
    faults = {f"s{i}": draw(st.sampled_from(FAULTS)) for i in range(num)}
    lanes: list[list[tuple[str, str, int]]] = []
    for sample_id, fault in faults.items():
        lane = [("dispatch", sample_id, 0)]
        for _ in range(draw(st.integers(0, 2))):
            lane += [("abort", sample_id, draw(st.integers(0, 3))), ("dispatch", sample_id, 0)]
        lane.append(("generated", sample_id, 4))
        if fault == "output_twice":
            lane.append(("generated", sample_id, 4))
        lane.append(("scored", sample_id, 0))
        if fault == "score_twice":
            lane.append(("scored", sample_id, 0))
        lanes.append(lane)
    events: list[tuple[str, str, int]] = []
    while any(lanes):
        lane = draw(st.sampled_from([lane for lane in lanes if lane]))
        events.append(lane.pop(0))
    return events, faults


@given(story=stories())
def test_the_report_names_exactly_the_injected_faults(
    story: tuple[list[tuple[str, str, int]], dict[str, str]],
) -> None:
    events, faults = story
    manifest = Manifest()
    attempts: dict[str, int] = {}
    for sample_id in faults:
        manifest.issue(sample_id, 0, max_tokens=8)
    for kind, sample_id, tokens in events:
        if kind == "dispatch":
            attempts[sample_id] = manifest.dispatch(sample_id)
        elif kind == "abort":
            manifest.abort(sample_id, attempts[sample_id], num_tokens=tokens)
        elif kind == "generated":
            manifest.generated(sample_id, attempts[sample_id], num_tokens=tokens)
        else:
            manifest.scored(sample_id)
    order = sorted(s for s, f in faults.items() if f != "drop")
    order += [s for s, f in faults.items() if f == "train_twice"]
    manifest.trained(0, order)
    manifest.close_step(0)
    report = manifest.report()
    assert report.lost == tuple(sorted(s for s, f in faults.items() if f == "drop"))
    dup = {"train_twice", "output_twice", "score_twice"}
    assert report.duplicated == tuple(sorted(s for s, f in faults.items() if f in dup))
    assert report.ok == all(f == "none" for f in faults.values())


# ---------------------------------------------------------------- scripted migration


@dataclass
class Request:
    sample_id: str
    attempt: int
    done_tokens: int
    max_tokens: int


@dataclass
class Engine:
    """Decodes one token per request per tick; finished requests wait to be collected."""

    buggy: bool
    running: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    def tick(self) -> None:
        for request in list(self.running):
            request.done_tokens += 1
            if request.done_tokens >= request.max_tokens:
                self.running.remove(request)
                self.finished.append(request)

    def collect(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def abort_all(self) -> list[Request]:
        """Stop everything; return the partials to re-dispatch.

        The buggy engine also hands back, as partials, the finished requests not yet
        collected (still in its batch at the limit): they come back finished from the
        resumed copy too. The fixed one keeps them as finished outputs.
        """
        partials, self.running = self.running, []
        if self.buggy:
            partials = partials + [Request(**vars(r)) for r in self.finished]
        return partials


@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=10),
    abort_at=st.integers(0, 7),
    buggy=st.booleans(),
)
def test_a_workload_migration_keeps_every_sample_once_unless_the_engine_is_buggy(
    lengths: list[int], abort_at: int, buggy: bool
) -> None:
    manifest = Manifest()
    donor, receiver = Engine(buggy=buggy), Engine(buggy=buggy)
    for index, length in enumerate(lengths):
        sample_id = f"s{index}"
        manifest.issue(sample_id, 0, max_tokens=length)
        attempt = manifest.dispatch(sample_id)
        donor.running.append(Request(sample_id, attempt, 0, length))
    at_limit: set[str] = set()
    outputs: list[Request] = []
    for tick in range(8):
        for engine in (donor, receiver):
            engine.tick()
        if tick == abort_at:
            at_limit = {r.sample_id for r in donor.finished}
            for partial in donor.abort_all():
                manifest.abort(partial.sample_id, partial.attempt, num_tokens=partial.done_tokens)
                attempt = manifest.dispatch(partial.sample_id)
                receiver.running.append(
                    Request(partial.sample_id, attempt, partial.done_tokens, partial.max_tokens)
                )
            receiver.tick()  # the resumed copy of a sequence at its limit finishes at once
        outputs += donor.collect() + receiver.collect()
    for output in outputs:
        manifest.generated(output.sample_id, output.attempt, num_tokens=output.done_tokens)
    trained = sorted({o.sample_id for o in outputs})
    for sample_id in trained:
        manifest.scored(sample_id)
    manifest.trained(0, trained)
    manifest.close_step(0)
    report = manifest.report()
    assert report.lost == ()
    expected = sorted(at_limit) if buggy else []
    assert list(report.duplicated) == expected
    if expected:
        kinds = {v.kind for v in report.violations}
        assert {"redispatch_at_limit", "stale_generation"} <= kinds
