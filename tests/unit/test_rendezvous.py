"""The store rendezvous: admissions keyed by nonce, stale keys ignored, refusals, deadlines."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import TCPStore

from dynarl.errors import DeadlineExceeded, WorkerError
from dynarl.runtime.launch._rendezvous import Admission, AdmissionDesk, request_admission

PREFIX = "dynarl/test/rendezvous"
SERVER, ALICE, MALLORY = b"S" * 40, b"A" * 40, b"M" * 40


@pytest.fixture
def store() -> Iterator[TCPStore]:
    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                   timeout=timedelta(seconds=10))  # fmt: skip


def desk(store: TCPStore, session: str, **kwargs: object) -> AdmissionDesk:
    options: dict[str, object] = {"server_key": SERVER, "allowed": frozenset({ALICE})}
    options.update(kwargs)
    return AdmissionDesk(
        store, prefix=PREFIX, address=f"tcp://ctrl-{session}:1", session=session, **options
    )


def ask(store: TCPStore, key: bytes | None = ALICE, **kwargs: object) -> Callable[..., object]:
    """Start a worker's request in a thread; the returned function joins it."""
    out: list[object] = []
    options: dict[str, object] = {"trusted": frozenset({SERVER}), "timeout_s": 10.0}
    options.update(kwargs)

    def target() -> None:
        try:
            out.append(
                request_admission(store, prefix=PREFIX, rank=1, node_rank=1, public_key=key,
                                  **options)
            )  # fmt: skip
        except Exception as err:
            out.append(err)

    thread = threading.Thread(target=target)
    thread.start()

    def join(serve: AdmissionDesk | None = None) -> object:
        while thread.is_alive():
            if serve is not None:
                serve.poll()
            thread.join(0.02)
        return out[0]

    return join


def test_a_worker_takes_only_the_answer_to_its_own_request(store: TCPStore) -> None:
    old = desk(store, "old")
    first = ask(store)(old)
    assert isinstance(first, Admission) and first.session == "old"
    new = desk(store, "new")  # a restarted controller: the store still holds old keys
    second = ask(store)(new)
    assert isinstance(second, Admission) and second.session == "new"
    assert second.address == "tcp://ctrl-new:1" and second.server_key == SERVER.decode()
    assert new.admitted[1].public_key == ALICE.decode()


def test_refusals(store: TCPStore) -> None:
    refused = ask(store, key=MALLORY)(desk(store, "s"))
    assert isinstance(refused, WorkerError) and "allow-list" in str(refused)
    impostor = desk(store, "s", server_key=MALLORY)
    untrusted = ask(store)(impostor)
    assert isinstance(untrusted, WorkerError)
    assert "controller's public key is not on the allow-list" in str(untrusted)
    plain = AdmissionDesk(store, prefix=PREFIX, address="tcp://x:1", server_key=None,
                          allowed=None)  # fmt: skip
    admitted = ask(store, key=None, trusted=None)(plain)
    assert isinstance(admitted, Admission) and admitted.server_key == ""
    with pytest.raises(ValueError, match="go together"):
        AdmissionDesk(store, prefix=PREFIX, address="a", server_key=SERVER, allowed=None)


def test_no_controller_means_a_deadline_and_stop_ends_the_wait(store: TCPStore) -> None:
    timed_out = ask(store, timeout_s=0.2)()
    assert isinstance(timed_out, DeadlineExceeded)
    stopped = ask(store, stop=lambda: True)()
    assert isinstance(stopped, WorkerError) and "stopped" in str(stopped)


def test_a_ticket_whose_request_never_came_is_given_up(store: TCPStore) -> None:
    now = [0.0]
    serving = desk(store, "s", grace_s=5.0, clock=lambda: now[0])
    store.add(f"{PREFIX}/requests", 1)  # a worker took a ticket and died
    assert serving.poll() == []
    now[0] = 10.0
    assert serving.poll() == []
    answered = ask(store)(serving)
    assert isinstance(answered, Admission) and answered.accepted
