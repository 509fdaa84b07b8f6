"""Where the GRPO driver puts the devices at its phase switches, and the moves that do it.

Plan, then execute:

* the decisions are pure synchronous functions of the :class:`RunPlan`, the job's
  allocation now and what the run measured — :func:`rollout_route` (the allocations a
  rollout starts through: under dynarl a trainer grown past its home device shrinks back
  by P2P first), :func:`wake_target` (dynarl: the trainer wakes on its home device at the
  barrier) and :func:`grow_target` (then takes every device — unless, under dynarl,
  growing would cost more learning time than it saves, :func:`grow_pays`);
* :class:`DeviceMover` carries them out on the driver's event loop: each allocation is
  reached by a real migration through the runtime's coordinator and ledger
  (``Job.reallocate``, retried when the scheduler's last move made the command stale),
  every trainer reshard is checked (the state's checksum is the same before and after)
  and timed, and the mean of those timings is the move cost the next grow decision uses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable

from dynarl.demo._device_schedules import RunPlan, Schedule, grow_pays
from dynarl.errors import BackendError, IntegrityError
from dynarl.runtime import Job
from dynarl.types import Allocation

__all__ = ["DeviceMover", "grow_target", "rollout_route", "wake_target"]

_MAX_TRIES = 5
"""Reallocations tried per target before giving up (each retry follows a stale command)."""


def _at_home(plan: RunPlan) -> Allocation:
    """The trainer on its home device(s), the rollout on every other device."""
    rest = tuple(d for d in plan.devices if d not in plan.home)
    return Allocation.of({"rollout": rest, "trainer": plan.home})


def rollout_route(plan: RunPlan, now: Allocation, *, resume: bool) -> tuple[Allocation, ...]:
    """The allocations to reach, in order, to start a rollout from ``now``.

    ``resume`` (dynarl): start where the scheduler left the last rollout — the trainer
    keeps its home device if the scheduler had given it one (and learns each group as it
    completes; the scheduler may move it back when the rollout needs it). Under dynarl a
    trainer holding devices beyond its home shrinks there first, by P2P: it keeps its
    state on its home device only.
    """
    dynarl = plan.schedule is Schedule.DYNARL
    target = _at_home(plan) if dynarl and resume else plan.rollout_phase()
    if dynarl and set(now.devices("trainer")) - set(plan.home):
        return (_at_home(plan), target)
    return (target,)


def wake_target(plan: RunPlan, now: Allocation) -> Allocation | None:
    """Where the trainer wakes at the barrier: dynarl, from no device, on its home device
    (where its state sleeps; it may grow from there by P2P). None: it stays as it is."""
    if plan.schedule is Schedule.DYNARL and not now.devices("trainer"):
        return _at_home(plan)
    return None


def grow_target(
    plan: RunPlan, now: Allocation, *, remaining: int, micro_s: float | None, move_s: float
) -> Allocation | None:
    """The learner phase for the ``remaining`` micro-batches, or None to stay in ``now``.

    split never moves; sequential always takes the learner phase; dynarl takes it only
    when :func:`grow_pays` (``micro_s``: learn seconds per micro-batch on one device, None
    when unknown; ``move_s``: seconds per reshard). Raises ValueError when dynarl's
    trainer holds no device in ``now`` (wake it first: :func:`wake_target`).
    """
    if plan.schedule is Schedule.SPLIT:
        return None
    if plan.schedule is Schedule.DYNARL and not grow_pays(
        remaining=remaining,
        held=len(now.devices("trainer")),
        total=plan.num_devices,
        micro_s=micro_s,
        move_s=move_s,
    ):
        return None
    return plan.learner_phase()


class DeviceMover:
    """Carries out the driver's phase switches on ``job`` under ``plan``.

    ``on_move`` is called after every reallocation (the driver's progress display);
    ``checksum`` returns the trainer state's checksum (collective over its ranks).
    ``move_cost_s``: what one reshard is assumed to cost until one has been measured;
    ``always_grow``: grow whatever it costs. Runs on the driver's event loop.
    """

    def __init__(
        self,
        job: Job,
        plan: RunPlan,
        *,
        on_move: Callable[[], None],
        checksum: Callable[[], Awaitable[str]],
        move_cost_s: float,
        always_grow: bool,
    ) -> None:
        self.job, self.plan = job, plan
        self._on_move, self._checksum = on_move, checksum
        self.move_cost_s = move_cost_s
        self.always_grow = always_grow
        self.reshards_verified = 0
        """Trainer reshards whose state checksum was checked equal before and after."""
        self._move_s: list[float] = []
        """Seconds of every trainer reshard (P2P grow or shrink) made here."""

    @property
    def move_s(self) -> float:
        """Seconds per reshard: the mean of the measured ones, ``move_cost_s`` before one."""
        return statistics.fmean(self._move_s) if self._move_s else self.move_cost_s

    async def enter_rollout(self, *, resume: bool) -> None:
        """Reach :func:`rollout_route`; raises BackendError or IntegrityError as :meth:`reach`."""
        for target in rollout_route(self.plan, self.job.allocation, resume=resume):
            await self.reach(target)

    async def enter_learner(self, remaining: int, *, micro_s: float | None) -> None:
        """Wake the trainer (:func:`wake_target`), then give it every device for the
        ``remaining`` micro-batches when :func:`grow_target` says so (``micro_s``: the
        last measured learn time per micro-batch; ignored with ``always_grow``)."""
        wake = wake_target(self.plan, self.job.allocation)
        if wake is not None:
            await self.reach(wake)
        grow = grow_target(
            self.plan,
            self.job.allocation,
            remaining=remaining,
            micro_s=None if self.always_grow else micro_s,
            move_s=self.move_s,
        )
        if grow is not None:
            await self.reach(grow)

    async def reach(self, target: Allocation) -> None:
        """Move to ``target`` (retrying a command the scheduler's last move made stale).

        A move that reshards the trainer (devices before and after) is checked: the
        state's checksum after it must equal the one before (IntegrityError otherwise).
        Raises BackendError when a move fails or ``target`` stays out of reach.
        """
        for _ in range(_MAX_TRIES):
            if self.job.allocation == target:
                return
            before = self.job.allocation.devices("trainer")
            after_devices = target.devices("trainer")
            reshard = bool(before) and bool(after_devices) and set(before) != set(after_devices)
            began = time.perf_counter()
            checksum = await self._checksum() if reshard else ""
            outcome = await self.job.reallocate(target)
            self._on_move()
            if outcome.ok:
                if reshard:
                    await self._verify(checksum, began, before, after_devices)
                return
            if not outcome.reason.startswith("stale"):
                raise BackendError(f"move to {target.as_dict()} failed: {outcome.reason}")
        raise BackendError(f"could not reach {target.as_dict()}")

    async def _verify(
        self, checksum: str, began: float, before: tuple[int, ...], after: tuple[int, ...]
    ) -> None:
        """Check the trainer's state survived its reshard ``before`` -> ``after``."""
        now = await self._checksum()
        # What the reshard cost this run, its integrity check included.
        self._move_s.append(time.perf_counter() - began)
        if now != checksum:
            raise IntegrityError(
                f"trainer state changed across its reshard {list(before)} -> "
                f"{list(after)}: {checksum[:12]} != {now[:12]}"
            )
        self.reshards_verified += 1
