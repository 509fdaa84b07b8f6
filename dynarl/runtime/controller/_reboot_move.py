"""RebootMove: save, stop, restart on the new devices, load — or sleep and wake in place.

The migrate :class:`~dynarl.migrate.RebootMigration` over the component's
:class:`~dynarl.runtime.controller._group_manager.RebootRoles` (its ``RebootHost``); in
place (a stateful component that shrinks to nothing, or grows back where it sleeps)
nothing is written and the roles sleep or wake where they are. Starting from nothing and
going down to nothing are the machine's sequence too; this module only builds it. Each
step asks the fault injector first (``reboot.save``, ``reboot.stop``, ``reboot.restart``,
``reboot.load``, ``reboot.commit``). Runs on the controller's loop.
"""

from __future__ import annotations

from dynarl.migrate import Migration, RebootMigration
from dynarl.runtime.controller._moves import Driver

__all__ = ["RebootMove"]


class RebootMove(Driver):
    """Save, stop, restart on the new devices, load (or sleep/wake in place)."""

    def _machine(self) -> Migration:
        roles = self.manager.reboot_host(
            self.migration_id, epochs=self.epochs, in_place=self.move.in_place
        )
        return RebootMigration(
            migration_id=self.migration_id,
            src_resources=self.move.src,
            dest_resources=self.move.dst,
            host=roles,
            lease_s=self.lease_s,
            clock=self.clock.now,
            on_step=self.fault,
        )
