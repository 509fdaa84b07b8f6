"""WorkerGroup: class keywords become a validated GroupSpec the scheduler can read."""

from __future__ import annotations

import pytest

import dynarl
from dynarl import ComponentKind, WorkerGroup
from dynarl.bus import Sample, run
from dynarl.bus._component import GroupSpec


class Rollout(WorkerGroup, kind=ComponentKind.ROLLOUT, min_unit=2, min_workers=2, max_workers=8):
    samples = dynarl.Channel("samples", Sample)


class Trainer(WorkerGroup, kind="trainer", interruptible=False, name="policy"):
    pass


class Base(WorkerGroup, abstract=True, kind=ComponentKind.TOOL, min_unit=1):
    pass


class Tool(Base):
    pass


def test_keywords_become_the_spec() -> None:
    assert Rollout.spec == GroupSpec(
        name="Rollout", kind=ComponentKind.ROLLOUT, min_unit=2, min_workers=2, max_workers=8
    )
    assert Rollout.spec.elastic
    assert Trainer.spec.name == "policy" and Trainer.spec.kind is ComponentKind.TRAINER
    assert not Trainer.spec.interruptible and Trainer.spec.max_workers is None
    assert Tool.spec == GroupSpec(name="Tool", kind=ComponentKind.TOOL)
    assert not hasattr(Base, "spec")


def test_subclasses_inherit_declarations_but_not_names() -> None:
    class Bigger(Rollout, max_workers=16):
        pass

    assert Bigger.spec.name == "Bigger" and Bigger.spec.min_unit == 2
    assert Bigger.spec.max_workers == 16


def test_a_kind_is_required() -> None:
    with pytest.raises(TypeError, match="must declare kind"):

        class Nameless(WorkerGroup):
            pass


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "painter"}, "painter"),
        ({"kind": "rollout", "min_unit": 0}, "min_unit"),
        ({"kind": "rollout", "min_workers": 3, "min_unit": 2}, "multiple"),
        ({"kind": "rollout", "min_workers": 4, "max_workers": 2}, "max_workers"),
    ],
)
def test_bad_declarations_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        type("Bad", (WorkerGroup,), {}, **kwargs)


def test_run_must_be_implemented_and_interrupt_defaults_to_a_no_op() -> None:
    group = Tool()
    run(group.interrupt())
    with pytest.raises(NotImplementedError, match="Tool must implement run"):
        run(group.run())
