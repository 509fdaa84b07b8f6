"""RoleHost: the role instances one worker holds, exactly one of them active.

Activating a component stops the active role first (``interrupt()``, a serving role's
``abort()``, its ``run()`` cancelled, ``sleep()``) and then wakes the component's
instance, or creates it (and calls ``start()`` unless it joins by migration). A stopped
role stays asleep with its state until it is activated again or torn down (``close()``).
A role whose ``run()`` raises :class:`~dynarl.errors.EngineLostError` has lost what it
runs on: the host calls ``on_engine_lost`` (the agent leaves the job).
Every operation is idempotent. Runs on the worker's event loop; role tasks live in the
agent's task group.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from typing import Any

from dynarl.bus import WorkerGroup
from dynarl.errors import EngineLostError, WorkerError
from dynarl.runtime._worker_protocol import Activate, RoleStatus
from dynarl.runtime.worker._role import RoleContext, Serving, load_role_class, overrides_run

__all__ = ["RoleHost"]

logger = logging.getLogger(__name__)

ContextFactory = Callable[[Activate], RoleContext]


class RoleHost:
    """Role instances of one worker (see the module docstring)."""

    def __init__(
        self,
        device: int,
        group: asyncio.TaskGroup,
        context: ContextFactory,
        *,
        on_engine_lost: Callable[[EngineLostError], None] | None = None,
    ) -> None:
        self.device = device
        self._on_engine_lost = on_engine_lost
        self._group = group
        self._context = context
        self._roles: dict[str, WorkerGroup] = {}
        self._contexts: dict[str, RoleContext] = {}
        self._managers: dict[str, str] = {}
        self._active: str | None = None
        self._slept: set[str] = set()
        self._run: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def active(self) -> str | None:
        """The active component, if any."""
        return self._active

    def status(self) -> RoleStatus:
        """What this worker hosts now."""
        asleep = tuple(sorted(name for name in self._roles if name != self._active))
        return RoleStatus(device=self.device, active=self._active or "", asleep=asleep)

    def role(self, component: str) -> WorkerGroup:
        """The hosted instance of ``component``; raises WorkerError if there is none."""
        try:
            return self._roles[component]
        except KeyError:
            raise WorkerError(f"worker {self.device} hosts no {component!r} role") from None

    def hosts(self, component: str) -> bool:
        """Whether an instance of ``component`` lives here (active or asleep)."""
        return component in self._roles

    def context(self, component: str) -> RoleContext:
        """The context of the hosted instance of ``component``."""
        if component not in self._contexts:
            raise WorkerError(f"worker {self.device} hosts no {component!r} role")
        return self._contexts[component]

    def manager(self, component: str) -> str:
        """Address of ``component``'s manager endpoint ("" when unknown)."""
        return self._managers.get(component, "")

    async def activate(self, command: Activate) -> RoleStatus:
        """Make ``command.component`` active here (creating or waking its instance).

        Raises WorkerError when the role class cannot be imported or constructed; the
        previously active role is then asleep.
        """
        async with self._lock:
            name = command.component
            if self._active == name:
                self._contexts[name].devices = command.devices
                return self.status()
            await self._stop_active()
            self._managers[name] = command.manager
            if name in self._roles:
                self._contexts[name].devices = command.devices
                if name in self._slept:
                    self._slept.discard(name)
                    await _maybe(self._roles[name], "wake")
            else:
                await self._create(command, start=command.fresh)
            self._start(name)
            return self.status()

    async def adopt(self, command: Activate) -> WorkerGroup:
        """Create ``command.component``'s instance, inactive and without ``start()`` (a
        rank joining by migration; :meth:`activate` with ``fresh=False`` makes it active
        once the join commits); returns the existing instance when there is one."""
        async with self._lock:
            self._managers[command.component] = command.manager
            if command.component not in self._roles:
                await self._create(command, start=False)
            return self._roles[command.component]

    async def deactivate(self, component: str, *, keep: bool) -> RoleStatus:
        """Stop ``component`` here: asleep with its state (``keep``) or torn down."""
        async with self._lock:
            if self._active == component:
                await self._stop_active()
            if not keep and component in self._roles:
                role = self._roles.pop(component)
                self._contexts.pop(component, None)
                self._slept.discard(component)
                await _maybe(role, "close")
                del role
                gc.collect()  # a role's native resources often hang on a reference cycle
                logger.info("worker %d: %s torn down", self.device, component)
            return self.status()

    async def close(self) -> None:
        """Tear every role down (agent shutdown)."""
        for name in list(self._roles):
            await self.deactivate(name, keep=False)

    async def _create(self, command: Activate, *, start: bool) -> None:
        cls = load_role_class(command.role)
        context = self._context(command)
        try:
            role: Any = cls(context)  # type: ignore[call-arg]
        except Exception as exc:
            raise WorkerError(f"cannot construct role {command.role}: {exc!r}") from exc
        if start:
            await _maybe(role, "start")
        self._roles[command.component] = role
        self._contexts[command.component] = context
        logger.info(
            "worker %d: %s created%s", self.device, command.component, "" if start else " (joining)"
        )

    def _start(self, name: str) -> None:
        self._active = name
        role = self._roles[name]
        if overrides_run(role):
            self._run = self._group.create_task(self._guarded_run(name, role))
        logger.info("worker %d: %s active", self.device, name)

    async def _guarded_run(self, name: str, role: WorkerGroup) -> None:
        try:
            await role.run()
        except asyncio.CancelledError:
            raise
        except EngineLostError as exc:
            logger.error("worker %d: %s lost its engine: %s", self.device, name, exc)
            if self._on_engine_lost is not None:
                self._on_engine_lost(exc)
        except Exception:  # the task's boundary: the role stops, the worker stays
            logger.exception("worker %d: %s.run() failed", self.device, name)

    async def _stop_active(self) -> None:
        name, self._active = self._active, None
        if name is None:
            return
        role = self._roles[name]
        await role.interrupt()
        if isinstance(role, Serving):
            await role.abort()  # nothing may wait on a stopped engine: partials go back
        task, self._run = self._run, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await _maybe(role, "sleep")
        self._slept.add(name)
        logger.info("worker %d: %s asleep", self.device, name)


async def _maybe(role: object, hook: str) -> None:
    method = getattr(role, hook, None)
    if method is not None:
        await method()
