"""``JobSpec``: a whole job in one module — its components, its configuration and the
user's loop that drives it.

::

    # my_pkg/jobs.py
    async def drive(job: dynarl.Job) -> None:
        job.submit("rollout", requests)
        ...

    JOB = dynarl.JobSpec(
        components=[ComponentSpec(role=MyRollout, devices=(0,)),
                    ComponentSpec(role=MyTrainer, devices=(1,))],
        config=dynarl.JobConfig(runtime=dynarl.RuntimeConfig(...)),
        driver=drive,
    )

The same object runs on this machine (``await JOB.run()``: a :class:`~dynarl.runtime.Job`
whose :class:`~dynarl.runtime.launch.LocalLauncher` spawns one worker process per device)
and across nodes (``torchrun ... -m dynarl.runtime.launch --job my_pkg.jobs:JOB``: the
controller and the driver on rank 0, a worker on every rank). Either way the driver gets the
running job; when it returns the job shuts down. Pure data; :meth:`JobSpec.run` runs on the
caller's event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from dynarl.runtime._job import Job, JobConfig
from dynarl.runtime._spec import ComponentSpec
from dynarl.runtime.launch import WorkerLauncher
from dynarl.sched import ThroughputPredictor

__all__ = ["JobSpec"]

Driver = Callable[[Job], Awaitable[None]]
"""The user's loop: gets the running job, ends it by returning."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """A job described in one module (see the module docstring).

    Raises ValueError without components, for an entry that is not a
    :class:`ComponentSpec`, for two components of one name, or for a driver that is not
    callable.
    """

    components: Sequence[ComponentSpec]
    """The job's components, as :class:`~dynarl.runtime.Job` takes them (kept as a tuple)."""
    driver: Driver
    """The user's loop, ``async def driver(job: Job) -> None``: submits work, reads
    outputs, calls components; the job ends when it returns (a raised error ends the job
    too, and is what the run raises)."""
    config: JobConfig = field(default_factory=JobConfig)
    """How the job runs (under torchrun, ``run_dir`` is ``--job-dir`` and ``num_devices``
    the world size)."""
    predictor: ThroughputPredictor | None = None
    """Replaces the scheduler's default throughput predictor (None: the default)."""

    def __post_init__(self) -> None:
        components = tuple(self.components)
        if not components:
            raise ValueError("JobSpec.components: a job needs at least one component")
        strays = [c for c in components if not isinstance(c, ComponentSpec)]
        if strays:
            raise ValueError(f"JobSpec.components must be ComponentSpecs, got {strays[0]!r}")
        names = [c.name for c in components]
        clashes = sorted({n for n in names if names.count(n) > 1})
        if clashes:
            raise ValueError(f"JobSpec.components: two components are named {clashes[0]!r}")
        if not callable(self.driver):
            raise ValueError(f"JobSpec.driver must be an async function, got {self.driver!r}")
        if not isinstance(self.config, JobConfig):
            raise ValueError(f"JobSpec.config must be a JobConfig, got {self.config!r}")
        object.__setattr__(self, "components", components)

    @property
    def num_devices(self) -> int:
        """Devices the job needs: ``config.num_devices``, else one past the highest
        device a component names."""
        held = [d for spec in self.components for d in spec.devices]
        return self.config.num_devices or (max(held) + 1 if held else 1)

    async def run(self, *, launcher: WorkerLauncher | None = None) -> None:
        """Start the job, run the driver on it, and shut the job down when the driver
        returns or raises.

        ``launcher``: who starts the workers (None: the local launcher, one process per
        device on this machine). Raises what the driver raises, and the job's start-up
        errors (see :class:`~dynarl.runtime.Job`).
        """
        job = Job(self.components, self.config, predictor=self.predictor, launcher=launcher)
        async with job:
            await self.driver(job)
