"""One asynchronous (hybrid) reference run on a fresh :class:`dynarl.Job`.

:func:`async_components` places the rollout on the standalone devices and the trainer on
the others (where its state lives and sleeps while they serve as hybrid replicas);
:func:`run_async` runs an :class:`~._async_driver.AsyncGRPODriver` there and returns an
:class:`~._async_records.AsyncRunResult`. dynarl's own scheduler only observes: the hybrid
controller makes every move. Runs on the caller's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from dynarl.backends.reference import ReferenceRollout, ReferenceSetup, ReferenceTrainer
from dynarl.demo._async_driver import AsyncGRPODriver
from dynarl.demo._async_records import AsyncConfig, AsyncRunResult, AsyncStepReport
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig

__all__ = ["async_components", "run_async"]


def async_components(setup: ReferenceSetup, config: AsyncConfig) -> list[ComponentSpec]:
    """The rollout (on the standalone devices) and the trainer (on the others, where its
    state lives; it sleeps there while they serve as hybrid replicas)."""
    options = setup.to_options()
    k = config.num_standalone_devices
    return [
        ComponentSpec(
            role=ReferenceRollout,
            devices=tuple(range(k)),
            options=options,
            max_inflight=setup.engine.num_slots,
            min_devices=1,
        ),
        ComponentSpec(
            role=ReferenceTrainer,
            devices=tuple(range(k, config.num_devices)),
            options=options,
            min_devices=0,
        ),
    ]


async def run_async(
    setup: ReferenceSetup,
    config: AsyncConfig,
    *,
    run_dir: str,
    runtime: RuntimeConfig | None = None,
    observer: Callable[[AsyncStepReport], None] | None = None,
) -> AsyncRunResult:
    """Run ``config`` on a fresh job in ``run_dir``; dynarl's own scheduler only observes
    (the hybrid controller makes every move); ``observer`` gets every step's report.

    Raises BackendError and the job's start-up errors.
    """
    runtime = runtime or RuntimeConfig()
    runtime = replace(runtime, scheduler=replace(runtime.scheduler, observe_only=True))
    job_config = JobConfig(num_devices=config.num_devices, run_dir=run_dir, runtime=runtime)
    async with Job(async_components(setup, config), job_config) as job:
        driver = AsyncGRPODriver(job, setup, config, observer=observer)
        reports = await driver.run(config.num_steps)
        wall = driver.clock.now() - driver.origin
    origin = driver.origin
    k = config.num_standalone_devices
    start = {"rollout": k, "trainer": config.num_devices - k}
    timeline = [(0.0, start)] + [(t - origin, c) for t, c in driver.replicas.timeline]
    return AsyncRunResult(
        label=config.label,
        config=config,
        steps=tuple(reports),
        wall_s=wall,
        staleness=driver.queue.stats.summary(),
        activations=driver.controller.activate_count,
        deactivations=driver.controller.deactivate_count,
        aborted=tuple(driver.replicas.aborted),
        rebalanced=driver.replicas.rebalanced,
        replica_log=tuple(driver.replicas.log),
        timeline=tuple(timeline),
        run_dir=run_dir,
    )
