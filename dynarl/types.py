"""Base vocabulary shared by every layer: component kinds, allocations, parallel sizes.

Nothing here does I/O. Every type is immutable and cheap to hash, so plans built from it
can be logged, compared and sent as they are.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "Allocation",
    "ComponentKind",
    "MigrationKind",
    "ParallelDims",
]


class ComponentKind(enum.StrEnum):
    """The role a logical component plays in an RL pipeline."""

    ROLLOUT = "rollout"
    INFERENCE = "inference"
    REWARD = "reward"
    TOOL = "tool"
    TRAINER = "trainer"


class MigrationKind(enum.StrEnum):
    """How a component's resources are moved (the executors live in :mod:`dynarl.migrate`)."""

    WORKLOAD = "workload"
    """Stop routing, abort in-flight work with partial outputs, re-dispatch it elsewhere."""
    P2P = "p2p"
    """Create-before-destroy reshard of trainer state over torch.distributed p2p."""
    REBOOT = "reboot"
    """Save, stop, restart under the new resources, load."""


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Tensor-, pipeline- and data-parallel sizes of one model replica set."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    dp: int = 1
    """Data-parallel size."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive int, got {value!r}")

    @property
    def model_parallel(self) -> int:
        """Devices one model replica needs (tp × pp): the minimum unit of a move."""
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        """Devices the whole layout needs (tp × pp × dp)."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True, slots=True)
class Allocation:
    """Which devices each component holds.

    Devices are job-wide integer ids (one per GPU, or per worker process on CPU). A device
    belongs to at most one component. Build one with :meth:`of`; the stored form is sorted
    so that equal allocations compare and hash equal.
    """

    assignment: tuple[tuple[str, tuple[int, ...]], ...]
    """(component, sorted device ids) pairs, sorted by component name."""

    def __post_init__(self) -> None:
        seen: dict[int, str] = {}
        names = [name for name, _ in self.assignment]
        if names != sorted(set(names)):
            raise ValueError(f"Allocation components must be unique and sorted, got {names}")
        for name, devices in self.assignment:
            if list(devices) != sorted(set(devices)):
                raise ValueError(f"Allocation devices of {name!r} must be unique and sorted")
            for device in devices:
                if device < 0:
                    raise ValueError(f"Allocation device ids must be >= 0, got {device}")
                if device in seen:
                    raise ValueError(
                        f"device {device} is held by both {seen[device]!r} and {name!r}"
                    )
                seen[device] = name

    @classmethod
    def of(cls, mapping: Mapping[str, Iterable[int]]) -> Allocation:
        """Build from ``{component: devices}``; raises ValueError if a device is shared."""
        return cls(tuple(sorted((name, tuple(sorted(devs))) for name, devs in mapping.items())))

    @property
    def components(self) -> tuple[str, ...]:
        """Component names, sorted."""
        return tuple(name for name, _ in self.assignment)

    @property
    def total(self) -> int:
        """Number of devices held by all components together."""
        return sum(len(devices) for _, devices in self.assignment)

    def devices(self, component: str) -> tuple[int, ...]:
        """Devices held by ``component`` (empty if it holds none or is unknown)."""
        for name, devices in self.assignment:
            if name == component:
                return devices
        return ()

    def count(self, component: str) -> int:
        """Number of devices held by ``component``."""
        return len(self.devices(component))

    def counts(self) -> dict[str, int]:
        """``{component: number of devices}``."""
        return {name: len(devices) for name, devices in self.assignment}

    def as_dict(self) -> dict[str, list[int]]:
        """``{component: [devices]}``, for JSON and the wire."""
        return {name: list(devices) for name, devices in self.assignment}

    def move(self, devices: Iterable[int], src: str, dst: str) -> Allocation:
        """A new allocation with ``devices`` moved from ``src`` to ``dst``.

        Raises ValueError if ``src`` does not hold every one of ``devices``.
        """
        moving = set(devices)
        held = set(self.devices(src))
        if not moving <= held:
            raise ValueError(f"{src!r} does not hold devices {sorted(moving - held)}")
        mapping = {name: set(devs) for name, devs in self.assignment}
        mapping[src] = held - moving
        mapping.setdefault(dst, set()).update(moving)
        return Allocation.of(mapping)
