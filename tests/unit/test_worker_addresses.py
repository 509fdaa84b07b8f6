"""Where a worker sends its metrics: a manager endpoint bound on every interface is reached
at the controller's host, whatever the worker's own host resolves to."""

from __future__ import annotations

from dynarl.runtime.worker._agent import reachable


def test_a_wildcard_manager_is_reached_at_the_controllers_host() -> None:
    via = "tcp://10.213.0.1:4100"
    assert reachable("tcp://0.0.0.0:5100", via=via) == "tcp://10.213.0.1:5100"
    assert reachable("tcp://*:5100", via=via) == "tcp://10.213.0.1:5100"
    assert reachable("tcp://[::]:5100", via="tcp://[fd00::1]:4100") == "tcp://[fd00::1]:5100"


def test_a_manager_bound_on_one_address_is_reached_there() -> None:
    via = "tcp://10.213.0.1:4100"
    assert reachable("tcp://127.0.0.1:5100", via="tcp://127.0.0.1:4100") == "tcp://127.0.0.1:5100"
    assert reachable("tcp://10.213.0.1:5100", via=via) == "tcp://10.213.0.1:5100"
