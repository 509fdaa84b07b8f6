"""Small job files for the torchrun launcher's tests (dynarl.testing's scripted engine and
tiny trainer: nothing to warm up)."""

from __future__ import annotations

from collections.abc import Sequence

import dynarl
from dynarl.bus import GenerationRequest, pack_tokens
from dynarl.testing import ScriptedRollout, TinyTrainer

COMPONENTS = (
    dynarl.ComponentSpec(role=ScriptedRollout, devices=(0,), options={"tokens_per_s": 200.0}),
    dynarl.ComponentSpec(role=TinyTrainer, devices=(1,), options={"step_s": 0.0}),
)


async def give_up(job: dynarl.Job) -> None:
    """Serves one request, trains on it, then fails."""
    job.submit("rollout", [GenerationRequest(sample_id="a", token_ids=pack_tokens([1, 2]),
                                             max_new_tokens=4)])  # fmt: skip
    sample = await job.output("rollout").get(timeout=60)
    await job.call("trainer", "train_step", [sample])
    raise RuntimeError("the driver gave up")


def failing(args: Sequence[str]) -> dynarl.JobSpec:
    """A job whose driver raises once the job runs."""
    return dynarl.JobSpec(components=COMPONENTS, driver=give_up)


TOO_BIG = dynarl.JobSpec(
    components=(dynarl.ComponentSpec(role=TinyTrainer, devices=(0, 1, 2)),), driver=give_up
)
"""Needs three devices."""
