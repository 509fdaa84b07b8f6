"""Roles of the graph-check tests: the grader puts scores on a channel that only the
auditor gets. A job that declares the grader alone has an undeclared channel; the idle
role uses no channel at all.

Workers import this module (``tests/`` on their ``PYTHONPATH``); nothing here calls
``publish`` or ``audit``: the channel exists for the extractor to read.
"""

from __future__ import annotations

from dynarl import Channel, ComponentKind, WorkerGroup
from dynarl.bus import Sample
from dynarl.runtime import RoleContext

SCORES = Channel("scores", Sample)


class Grader(WorkerGroup, kind=ComponentKind.REWARD, name="grader"):
    """Puts each scored sample on ``scores``."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx

    async def publish(self, sample: Sample) -> None:
        await SCORES.put(sample)


class Auditor(WorkerGroup, kind=ComponentKind.TOOL, name="auditor"):
    """Gets the scored samples."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx

    async def audit(self) -> Sample:
        return await SCORES.get()


class Idle(WorkerGroup, kind=ComponentKind.INFERENCE, name="idle"):
    """Puts and gets on no channel."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
