"""Fault injection at named phases: fail once, stall past the lease, kill a worker."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynarl.runtime._faults import Fault, FaultAction, FaultInjector, InjectedFault


def test_faults_fire_at_their_phase_as_often_as_armed() -> None:
    killed: list[int] = []
    injector = FaultInjector(
        [
            Fault(phase="p2p.transfer", times=2),
            Fault(phase="workload.drain", action=FaultAction.KILL, device=3),
        ],
        kill=killed.append,
    )

    async def main() -> None:
        far = time.monotonic() + 60
        await injector.at("p2p.prepare", deadline=far)
        for _ in range(2):
            with pytest.raises(InjectedFault, match=r"p2p\.transfer"):
                await injector.at("p2p.transfer", deadline=far)
        await injector.at("p2p.transfer", deadline=far)
        await injector.at("workload.drain", deadline=far)
        injector.arm(Fault(phase="reboot.load", action=FaultAction.STALL))
        deadline = time.monotonic() + 0.05
        await injector.at("reboot.load", deadline=deadline)
        assert time.monotonic() > deadline

    asyncio.run(main())
    assert killed == [3]
    assert [f.phase for f in injector.fired] == ["p2p.transfer"] * 2 + [
        "workload.drain",
        "reboot.load",
    ]


def test_a_fault_names_a_phase_and_a_kill_names_a_device() -> None:
    with pytest.raises(ValueError, match="phase"):
        Fault(phase="transfer")
    with pytest.raises(ValueError, match="device"):
        Fault(phase="p2p.commit", action=FaultAction.KILL)
    with pytest.raises(ValueError, match="times"):
        Fault(phase="p2p.commit", times=0)


def test_a_cut_goes_through_the_hook_and_disarm_drops_what_did_not_fire() -> None:
    cut: list[int] = []
    injector = FaultInjector([Fault(phase="p2p.verify", action=FaultAction.CUT, device=2)])

    async def main() -> None:
        far = time.monotonic() + 60
        with pytest.raises(InjectedFault, match="no network hook"):
            await injector.at("p2p.verify", deadline=far)
        injector.cut = cut.append
        injector.arm(Fault(phase="p2p.verify", action=FaultAction.CUT, device=2))
        injector.arm(Fault(phase="p2p.commit", times=2))
        assert await injector.at("p2p.verify", deadline=far) is not None
        assert injector.disarm() == [Fault(phase="p2p.commit", times=2)]
        assert await injector.at("p2p.commit", deadline=far) is None

    asyncio.run(main())
    assert cut == [2]
    with pytest.raises(ValueError, match="a cut fault needs a device"):
        Fault(phase="p2p.verify", action=FaultAction.CUT)
