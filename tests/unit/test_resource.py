"""The shared open/close pattern: a failure part-way closes what opened, in reverse order;
closing is idempotent; a resource opens once; background loops end with it; a start-up
stage names itself in the error its failure raises."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from dynarl._resource import AsyncResource, background, stage
from dynarl.errors import BusError, WorkerError


class Steps(AsyncResource):
    """Opens ``steps`` things in order; the one named ``fail_at`` fails to open."""

    def __init__(self, steps: list[str], fail_at: str | None = None) -> None:
        self.steps, self.fail_at = steps, fail_at
        self.log: list[str] = []

    async def _open(self, stack: AsyncExitStack) -> None:
        for name in self.steps:
            if name == self.fail_at:
                raise OSError(f"{name} failed")
            self.log.append(f"open {name}")
            stack.callback(self.log.append, f"close {name}")


def test_a_failure_part_way_closes_what_opened_in_reverse_order() -> None:
    steps = Steps(["a", "b", "c"], fail_at="c")

    async def main() -> None:
        with pytest.raises(OSError, match="c failed"):
            async with steps:
                pytest.fail("opened")
        await steps.aclose()

    asyncio.run(main())
    assert steps.log == ["open a", "open b", "close b", "close a"]


def test_closing_closes_everything_once_in_reverse_order_and_a_resource_opens_once() -> None:
    steps = Steps(["a", "b"])

    async def main() -> None:
        async with steps:
            assert steps.log == ["open a", "open b"]
        await steps.aclose()
        with pytest.raises(RuntimeError, match="opens once"):
            async with steps:
                pytest.fail("opened again")

    asyncio.run(main())
    assert steps.log == ["open a", "open b", "close b", "close a"]


def test_background_tasks_end_with_the_group_and_its_closing_error_passes_unchanged() -> None:
    async def main() -> None:
        with pytest.raises(KeyError):
            async with background() as tasks:
                loop = tasks.create_task(asyncio.Event().wait())
                await asyncio.sleep(0)
                raise KeyError("not wrapped in an ExceptionGroup")
        assert loop.cancelled()

    asyncio.run(main())


def test_a_crashed_background_task_surfaces_when_the_group_closes() -> None:
    async def crash() -> None:
        raise ValueError("loop crashed")

    async def main() -> None:
        with pytest.raises(ExceptionGroup) as caught:
            async with background() as tasks:
                tasks.create_task(crash())
                await asyncio.sleep(1)  # cancelled by the crash
        assert caught.group_contains(ValueError, match="loop crashed")

    asyncio.run(main())


def test_a_stage_names_itself_and_chains_the_cause() -> None:
    with pytest.raises(BusError) as caught, stage("bus bind", BusError):
        raise OSError(98, "Address already in use")
    assert str(caught.value) == (
        "start-up failed at stage 'bus bind': OSError: [Errno 98] Address already in use"
    )
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(WorkerError, match=r"^start-up failed at stage 'x': TimeoutError$"):
        with stage("x", WorkerError):
            raise TimeoutError
    with pytest.raises(asyncio.CancelledError), stage("x", WorkerError):
        raise asyncio.CancelledError
