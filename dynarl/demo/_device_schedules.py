"""What a reference job runs under: the device schedules (:class:`Schedule`,
:class:`RunPlan`), the components placed for one (:func:`reference_components`), and what
the GRPO driver reports (:class:`DriverProgress`, :class:`StepReport`). Pure data; runs
anywhere.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from dynarl.backends.reference import ReferenceRollout, ReferenceSetup, ReferenceTrainer
from dynarl.runtime import ComponentSpec
from dynarl.sched import ComponentProfile
from dynarl.types import Allocation

__all__ = [
    "DriverProgress",
    "RunPlan",
    "Schedule",
    "StepReport",
    "grow_pays",
    "reference_components",
]


class Schedule(enum.StrEnum):
    """How the job's devices are used (see the module docstring)."""

    DYNARL = "dynarl"
    SEQUENTIAL = "sequential"
    SPLIT = "split"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPlan:
    """A schedule over ``num_devices`` devices."""

    schedule: Schedule
    """The schedule."""
    num_devices: int = 2
    """Devices (worker processes) of the job."""
    num_rollout_devices: int = 1
    """split: devices ``0 .. k-1`` generate, the others train."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"RunPlan.num_devices must be >= 1, got {self.num_devices}")
        if self.schedule is Schedule.SPLIT and not 0 < self.num_rollout_devices < self.num_devices:
            raise ValueError("a split needs 0 < num_rollout_devices < num_devices")

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device of the job."""
        return tuple(range(self.num_devices))

    @property
    def label(self) -> str:
        """``dynarl``, ``sequential`` or ``split-<k>/<n>``."""
        if self.schedule is Schedule.SPLIT:
            return f"split-{self.num_rollout_devices}/{self.num_devices - self.num_rollout_devices}"
        return str(self.schedule)

    @property
    def home(self) -> tuple[int, ...]:
        """Where the trainer keeps its state while the rollout holds every device: the
        device the scheduler releases first (the highest), or all of them (sequential)."""
        if self.schedule is Schedule.SEQUENTIAL:
            return self.devices
        if self.schedule is Schedule.SPLIT:
            return self.devices[self.num_rollout_devices :]
        return self.devices[-1:]

    def rollout_phase(self) -> Allocation:
        """The allocation while the rollout runs (at its start, for dynarl)."""
        if self.schedule is Schedule.SPLIT:
            k = self.num_rollout_devices
            return Allocation.of({"rollout": self.devices[:k], "trainer": self.devices[k:]})
        return Allocation.of({"rollout": self.devices, "trainer": ()})

    def learner_phase(self) -> Allocation:
        """The allocation once the rollout is done."""
        if self.schedule is Schedule.SPLIT:
            return self.rollout_phase()
        return Allocation.of({"rollout": (), "trainer": self.devices})


def grow_pays(
    *, remaining: int, held: int, total: int, micro_s: float | None, move_s: float
) -> bool:
    """Whether growing the trainer from ``held`` devices onto ``total`` saves more time
    learning the ``remaining`` micro-batches (``micro_s`` seconds each on one device)
    than a grow and the shrink after the step cost (``move_s`` seconds each). Unknown
    ``micro_s`` (None): grow when a held device would learn more than one. Raises
    ValueError when ``held`` is below 1.
    """
    if held < 1:
        raise ValueError(f"grow_pays needs held >= 1, got {held}")
    if remaining <= 0 or held >= total:
        return False
    if micro_s is None:
        return remaining > held
    saved = micro_s * (math.ceil(remaining / held) - math.ceil(remaining / total))
    return saved > 2.0 * move_s


def reference_components(
    setup: ReferenceSetup,
    plan: RunPlan,
    *,
    profiles: Mapping[str, ComponentProfile] | None = None,
) -> list[ComponentSpec]:
    """The rollout and trainer components of a reference job, placed for ``plan`` at the
    start (the trainer active on its home devices, where it creates its state)."""
    profiles = profiles or {}
    options = setup.to_options()
    home = plan.home
    start = {d for d in plan.devices if d not in home}
    return [
        ComponentSpec(
            role=ReferenceRollout,
            devices=tuple(sorted(start)),
            options=options,
            profile=profiles.get("rollout"),
            max_inflight=setup.engine.num_slots,
            min_devices=1,
        ),
        ComponentSpec(
            role=ReferenceTrainer,
            devices=home,
            options=options,
            profile=profiles.get("trainer"),
            min_devices=0,
        ),
    ]


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverProgress:
    """What the driver is doing (for live displays)."""

    step: int
    """Step in progress (0-based)."""
    phase: str
    """``rollout``, ``learn``, ``step``, ``sync`` or ``switch``."""
    done: int
    """Episodes scored in this step."""
    total: int
    """Episodes of this step."""
    learned: int
    """Micro-batches learned in this step."""
    num_micros: int
    """Micro-batches of this step."""
    allocation: dict[str, list[int]]
    """Devices per component now."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepReport:
    """What one GRPO step did."""

    step: int
    """Step index."""
    mean_reward: float
    """Mean reward of its episodes."""
    rewards: tuple[float, ...]
    """Reward of every episode, in update order."""
    loss: float
    """Training loss of the step."""
    kl: float
    """KL to the reference policy."""
    grad_norm: float
    """Gradient norm before clipping."""
    version: int
    """Weight version after the step."""
    checksum: str
    """SHA-256 of the trainer state after the step (every rank agreed)."""
    manifest: tuple[str, ...]
    """Sample ids in update order (micro-batch order, ids ascending within one)."""
    micro_sizes: tuple[int, ...]
    """Samples per micro-batch, in order (the composition)."""
    wall_s: float
    """Seconds of the whole step, the switch back to the rollout included."""
    rollout_s: float
    """Seconds from the first request to the last scored episode."""
    learned_early: int
    """Micro-batches the trainer learned before the last episode was in."""
    resumed: int
    """Generations aborted by a move and resumed elsewhere."""
    turns: int
    """Generation turns the rollout served (a tool call starts another)."""
    mean_response_tokens: float
    """Mean response length, tokens."""
    max_response_tokens: int
    """Longest response, tokens."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: rollout, barrier, learn, step, sync, switch."""
    stale_tokens: int = 0
    """Trained tokens generated under another weight version than the step's rollout was
    served under (0: every token on-policy, as the schedule expects)."""
    logprob_gap: float | None = None
    """Largest gap between the engines' log-prob of a trained token and the trainer's,
    teacher-forced (real engines; None where not measured)."""
