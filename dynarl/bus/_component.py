"""``WorkerGroup``: the base class user components derive.

A component declares what the scheduler needs to know about it as class keywords::

    class Rollout(dynarl.WorkerGroup, kind=ComponentKind.ROLLOUT, min_unit=2, max_workers=64):
        samples = dynarl.Channel("samples", Sample)

        async def run(self) -> None:
            while True:
                await self.samples.put(await self.generate_one(), key="train")

Keywords (all optional except ``kind`` somewhere in the class's ancestry):

- ``kind``: a ``ComponentKind`` (or its string value);
- ``name``: the logical component name (default: the class name; not inherited);
- ``interruptible``: whether it can stop at a batch/query boundary (default True); only
  interruptible components are planned;
- ``min_workers`` / ``max_workers``: elastic bounds (default 1 / unbounded);
- ``min_unit``: devices per replica (e.g. the TP size); worker counts are multiples of it;
- ``abstract``: True for an intermediate base that is not a component itself.

The result is the frozen :class:`GroupSpec` at ``cls.spec``. The scheduler's graph
extractor finds components statically (``ast``) as classes deriving ``WorkerGroup`` and
reads these keywords and the ``put``/``get`` calls on channels; the runtime instantiates a
component in each of its worker processes, calls :meth:`WorkerGroup.run`, and calls
:meth:`WorkerGroup.interrupt` before moving its devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dynarl.types import ComponentKind

__all__ = ["GroupSpec", "WorkerGroup"]

_KEYWORDS = ("kind", "interruptible", "min_workers", "max_workers", "min_unit")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """What a component declares about itself (read by the scheduler and the runtime)."""

    name: str
    """Logical component name (unique in a job)."""
    kind: ComponentKind
    """The role the component plays."""
    interruptible: bool = True
    """Whether it can reach a batch/query boundary on request; only these are planned."""
    min_workers: int = 1
    """Fewest workers it may run with."""
    max_workers: int | None = None
    """Most workers it may use (None: no bound)."""
    min_unit: int = 1
    """Devices of one replica (for instance the TP size); worker counts are multiples of it."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("GroupSpec.name must not be empty")
        if not isinstance(self.kind, ComponentKind):
            raise ValueError(f"GroupSpec.kind must be a ComponentKind, got {self.kind!r}")
        for field in ("min_workers", "min_unit"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GroupSpec.{field} must be an int >= 1, got {value!r}")
        if self.max_workers is not None and (
            not isinstance(self.max_workers, int) or self.max_workers < self.min_workers
        ):
            raise ValueError(
                f"GroupSpec.max_workers must be None or an int >= min_workers "
                f"({self.min_workers}), got {self.max_workers!r}"
            )
        if self.min_workers % self.min_unit:
            raise ValueError(
                f"GroupSpec.min_workers ({self.min_workers}) must be a multiple of "
                f"min_unit ({self.min_unit})"
            )

    @property
    def elastic(self) -> bool:
        """Whether the scheduler may change the component's worker count."""
        return self.max_workers is None or self.max_workers > self.min_workers


class WorkerGroup:
    """Base of user components; subclass it with class keywords (see the module docstring).

    Raises TypeError at class creation if no ``kind`` is declared on a concrete class,
    ValueError if a keyword is out of range.
    """

    spec: ClassVar[GroupSpec]
    """What this component declares."""
    _declared: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(
        cls,
        *,
        kind: ComponentKind | str | None = None,
        name: str | None = None,
        interruptible: bool | None = None,
        min_workers: int | None = None,
        max_workers: int | None = None,
        min_unit: int | None = None,
        abstract: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        given = {
            "kind": kind,
            "interruptible": interruptible,
            "min_workers": min_workers,
            "max_workers": max_workers,
            "min_unit": min_unit,
        }
        declared = dict(cls._declared)
        declared.update({key: value for key, value in given.items() if value is not None})
        cls._declared = declared
        if abstract:
            return
        if "kind" not in declared:
            raise TypeError(
                f"WorkerGroup subclass {cls.__name__} must declare kind=ComponentKind... "
                "(or pass abstract=True)"
            )
        cls.spec = GroupSpec(
            name=name or cls.__name__,
            kind=ComponentKind(declared["kind"]),
            **{key: declared[key] for key in _KEYWORDS[1:] if key in declared},
        )

    async def run(self) -> None:
        """The component's work loop, run by the runtime in each worker; cancel to stop.

        Raises NotImplementedError unless the subclass overrides it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement run()")

    async def interrupt(self) -> None:
        """Reach the next interruptible point (batch or query boundary) and return.

        Called by the runtime before it moves this worker's devices. The default returns
        at once (for components whose ``run`` is always at such a point when suspended).
        """
