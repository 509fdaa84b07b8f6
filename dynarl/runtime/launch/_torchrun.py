"""The torchrun entry point: ``torchrun ... -m dynarl.runtime.launch --job module:attr ...``.

Every rank reads the torchrun environment once (:meth:`DistEnv.from_env`), connects to the
job's TCPStore and rendezvouses over it (:mod:`._rendezvous`). Rank 0 runs the job's
controller and, beside it in the same process and loop, a worker; every other rank runs a
worker. ``--job`` names a :class:`~dynarl.runtime.JobSpec`, or a function of the job's
arguments returning one (called on rank 0 only, so that preparing the job — a warm start, a
dataset — happens once)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m dynarl.runtime.launch --job my_pkg.jobs:JOB --job-dir /shared/run1 \\
        --bind-host 0.0.0.0 --key-file /etc/dynarl/node.key_secret \\
        --allowed-keys /etc/dynarl/authorized -- --my-job-flag 1

Underneath, the launcher runs any object with two coroutines (:class:`LaunchedJob`:
``controller`` on rank 0, ``worker`` on every rank), so it does not depend on what they do;
a JobSpec runs through one (:mod:`._job_ranks`: the spec's :class:`~dynarl.runtime.Job` on
rank 0, its workers on the ranks), and the launcher's own tests name one directly. When the
job ends every rank exits 0; when it fails, non-zero with the error named in its log.

A bus bound to a routable address (or ``--curve``) uses CURVE: each node's secret key
comes from ``--key-file`` (provisioned outside the job, ``dynarl keys``), the controller
accepts exactly the public keys found in ``--allowed-keys`` (files or directories of
``*.key``), and workers connect only to a controller whose key is listed there too.
Arguments after ``--`` are the job's own (``config.args``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import secrets
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from dynarl._distenv import DistEnv
from dynarl.bus import CurveClient, CurveServer, load_public_key, load_secret_key, run
from dynarl.errors import WorkerError
from dynarl.runtime._cores import pinned_cores
from dynarl.runtime._job_spec import JobSpec
from dynarl.runtime._store import host_store
from dynarl.runtime.launch._job_ranks import SpecJob, describe
from dynarl.runtime.launch._rendezvous import AdmissionDesk, request_admission

__all__ = [
    "ControllerContext",
    "LaunchConfig",
    "LaunchedJob",
    "WorkerContext",
    "load_job",
    "main",
    "open_store",
    "parse_args",
    "run_node",
]

logger = logging.getLogger(__name__)

_WILDCARDS = ("0.0.0.0", "*", "::")
_LOOPBACK = ("localhost", "::1")


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """The launcher's command line."""

    job: str
    """``module:attribute`` of the :class:`~dynarl.runtime.JobSpec` (or of a function of
    ``args`` returning one)."""
    job_dir: Path
    """Directory shared by every node: the job's run directory (ledger, journal,
    checkpoints)."""
    job_name: str = "dynarl"
    """Namespace of the job's keys in the store."""
    bind_host: str = "127.0.0.1"
    """Interface the controller's bus binds (``0.0.0.0`` for every interface)."""
    advertise_host: str | None = None
    """Host workers connect to; default: ``bind_host``, or MASTER_ADDR for a wildcard."""
    curve: bool = False
    """Use CURVE even on loopback (always on for a routable bind)."""
    key_file: Path | None = None
    """This node's CURVE secret key file (mode 0600)."""
    allowed_keys: tuple[Path, ...] = ()
    """Public key files, or directories of ``*.key`` files: the allow-list."""
    rendezvous_timeout_s: float = 120.0
    """How long a worker waits for the controller's answer, seconds."""
    store_timeout_s: float = 60.0
    """Timeout of store connections and reads, seconds."""
    poll_s: float = 0.1
    """How often the controller looks for join requests, seconds."""
    pin_cores: bool = False
    """Run each rank on one core: the ``LOCAL_RANK``-th this process may use (the
    processes it starts inherit it)."""
    args: tuple[str, ...] = ()
    """The job's own arguments (after ``--``)."""

    def __post_init__(self) -> None:
        if ":" not in self.job:
            raise ValueError(f"--job must be module:attribute, got {self.job!r}")
        for name in ("rendezvous_timeout_s", "store_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LaunchConfig.{name} must be > 0")
        if self.secured and (self.key_file is None or not self.allowed_keys):
            why = "CURVE (--curve or a routable --bind-host) needs --key-file and --allowed-keys"
            raise ValueError(why)

    @property
    def secured(self) -> bool:
        """Whether the bus uses CURVE."""
        host = self.bind_host
        return self.curve or not (host.startswith("127.") or host in _LOOPBACK)


@dataclass(frozen=True, kw_only=True, slots=True)
class ControllerContext:
    """What the controller gets on rank 0."""

    env: DistEnv
    """This rank's torchrun environment."""
    config: LaunchConfig
    """The launcher's configuration (``job_dir``, ``args``...)."""
    store: Store
    """The store space of this attempt (build groups over PrefixStores of it)."""
    bind_address: str
    """Address to bind the bus server to (port 0: any free)."""
    curve: CurveServer | None
    """CURVE settings of the bus server (None without CURVE)."""
    announce: Callable[[str], None]
    """Call once with the bound bus address: workers are admitted from then on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerContext:
    """What a worker gets on every rank."""

    env: DistEnv
    """This rank's torchrun environment."""
    config: LaunchConfig
    """The launcher's configuration."""
    store: Store
    """The store space of this attempt (the controller's, same keys)."""
    name: str
    """Bus client name of this worker (``rank-<rank>``)."""
    address: str
    """The controller's bus address."""
    curve: CurveClient | None
    """CURVE settings of the bus client (None without CURVE)."""


class LaunchedJob(Protocol):
    """The launcher's own interface: the controller and worker coroutines of a job (a
    :class:`~dynarl.runtime.JobSpec` runs through one; the launcher's tests name one)."""

    async def controller(self, context: ControllerContext) -> None:
        """Run the controller (rank 0); bind the bus and call ``context.announce``."""
        ...

    async def worker(self, context: WorkerContext) -> None:
        """Run one rank's worker until the controller ends it."""
        ...


@dataclass(frozen=True, slots=True)
class _Keys:
    public: bytes | None
    allowed: frozenset[bytes] | None


def _load_keys(config: LaunchConfig) -> _Keys:
    if not config.secured:
        return _Keys(None, None)
    assert config.key_file is not None
    public, _ = load_secret_key(config.key_file)
    files: list[Path] = []
    for path in config.allowed_keys:
        files += sorted(path.glob("*.key")) if path.is_dir() else [path]
    allowed = frozenset(load_public_key(file) for file in files)
    if not allowed:
        raise ValueError(f"no public keys in --allowed-keys {list(config.allowed_keys)}")
    return _Keys(public, allowed)


def _advertised(bound: str, config: LaunchConfig, env: DistEnv) -> str:
    host = config.advertise_host
    if host is None:
        host = env.master_addr if config.bind_host in _WILDCARDS else config.bind_host
    return f"tcp://{host}:{bound.rpartition(':')[2]}"


def _space(store: Store, config: LaunchConfig, session: str) -> Store:
    return PrefixStore(f"dynarl/{config.job_name}/session/{session}", store)


async def run_node(job: LaunchedJob, config: LaunchConfig, env: DistEnv, store: Store) -> None:
    """Run this rank's part of the job: controller and worker on rank 0, worker elsewhere.

    Raises what the job raises; WorkerError if the controller returns without announcing
    its address or refuses this rank; DeadlineExceeded if no controller answers.
    """
    keys = _load_keys(config)
    if env.rank != 0:
        await _run_worker(job, config, env, store, keys)
        return
    session = secrets.token_hex(8)
    announced: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def announce(address: str) -> None:
        if not announced.done():
            announced.set_result(_advertised(address, config, env))

    curve = None
    if keys.allowed is not None:
        assert config.key_file is not None
        curve = CurveServer(key_file=config.key_file, allowed_clients=keys.allowed)
    context = ControllerContext(
        env=env, config=config, store=_space(store, config, session),
        bind_address=f"tcp://{config.bind_host}:0", curve=curve, announce=announce,
    )  # fmt: skip
    async with asyncio.TaskGroup() as group:
        desk = group.create_task(_serve_admissions(announced, store, config, keys, session))
        group.create_task(_run_worker(job, config, env, store, keys))
        await job.controller(context)
        desk.cancel()
        if not announced.done():
            raise WorkerError("the controller returned without announcing its bus address")


async def _serve_admissions(
    announced: asyncio.Future[str],
    store: Store,
    config: LaunchConfig,
    keys: _Keys,
    session: str,
) -> None:
    address = await announced
    desk = AdmissionDesk(
        store, prefix=f"dynarl/{config.job_name}/rendezvous", address=address,
        server_key=keys.public, allowed=keys.allowed, session=session,
    )  # fmt: skip
    logger.info("controller at %s admits workers (session %s)", address, session)
    while True:
        await asyncio.to_thread(desk.poll)
        await asyncio.sleep(config.poll_s)


async def _run_worker(
    job: LaunchedJob, config: LaunchConfig, env: DistEnv, store: Store, keys: _Keys
) -> None:
    stop = threading.Event()
    try:
        admission = await asyncio.to_thread(
            request_admission, store, prefix=f"dynarl/{config.job_name}/rendezvous",
            rank=env.rank, node_rank=env.node_rank, public_key=keys.public,
            trusted=keys.allowed, timeout_s=config.rendezvous_timeout_s, stop=stop.is_set,
        )  # fmt: skip
    finally:
        stop.set()  # a cancelled wait must not keep its thread (and the process) alive
    curve = None
    if keys.allowed is not None:
        assert config.key_file is not None
        curve = CurveClient(key_file=config.key_file, server_key=admission.server_key.encode())
    context = WorkerContext(
        env=env, config=config, store=_space(store, config, admission.session),
        name=f"rank-{env.rank}", address=admission.address, curve=curve,
    )  # fmt: skip
    await job.worker(context)


def load_job(spec: str) -> LaunchedJob:
    """What ``module:attribute`` names, as a :class:`LaunchedJob`: a JobSpec, a function
    returning one (called on rank 0 with the job's arguments), or a LaunchedJob itself.
    Raises ValueError if it is none of these."""
    module_name, _, attribute = spec.partition(":")
    target: object = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if all(callable(getattr(target, name, None)) for name in ("controller", "worker")):
        return target  # type: ignore[return-value]
    if isinstance(target, JobSpec) or (callable(target) and not isinstance(target, type)):
        return SpecJob(target)
    raise ValueError(f"{spec} is not a JobSpec nor a function returning one")


def open_store(env: DistEnv, timeout_s: float) -> TCPStore:
    """This rank's client of the job's TCPStore. Rank 0 hosts it unless torchrun's agent
    does (its default; the agent's listens on every interface), listening on MASTER_ADDR
    only. Raises OSError when rank 0 cannot listen there, what TCPStore raises when a rank
    cannot connect within ``timeout_s``."""
    if env.rank == 0 and not env.use_agent_store:
        return host_store(env.master_addr, env.master_port, timeout_s=timeout_s, multi_tenant=True)
    return TCPStore(
        env.master_addr, env.master_port, is_master=False,
        timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True,
    )  # fmt: skip


def parse_args(argv: Sequence[str]) -> LaunchConfig:
    """The configuration from the command line (ValueError or SystemExit if invalid)."""
    argv = list(argv)
    job_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, job_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="python -m dynarl.runtime.launch")
    parser.add_argument(
        "--job",
        required=True,
        help="module:attribute of the JobSpec, or of a function of the job's arguments "
        "returning one",
    )
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--job-name", default="dynarl")
    parser.add_argument("--bind-host", default="127.0.0.1")
    parser.add_argument("--advertise-host")
    parser.add_argument("--curve", action="store_true", help="CURVE even on loopback")
    parser.add_argument("--key-file", type=Path)
    parser.add_argument("--allowed-keys", type=Path, nargs="+", default=[])
    parser.add_argument("--rendezvous-timeout", type=float, default=120.0)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="run this rank on the LOCAL_RANK-th core it may use (a device is one core)",
    )
    ns = parser.parse_args(argv)
    logging.getLogger().setLevel(ns.log_level)
    return LaunchConfig(
        job=ns.job, job_dir=ns.job_dir, job_name=ns.job_name, bind_host=ns.bind_host,
        advertise_host=ns.advertise_host, curve=ns.curve, key_file=ns.key_file,
        allowed_keys=tuple(ns.allowed_keys), rendezvous_timeout_s=ns.rendezvous_timeout,
        pin_cores=ns.pin_cores, args=tuple(job_args),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dynarl.runtime.launch`` (one per torchrun rank)."""
    env = DistEnv.from_env()
    logging.basicConfig(format=f"%(asctime)s rank{env.rank} %(name)s %(levelname)s %(message)s")
    config = parse_args(sys.argv[1:] if argv is None else argv)
    if config.pin_cores:
        cores = pinned_cores(env.local_world_size, os.sched_getaffinity(0), setting="--pin-cores")
        os.sched_setaffinity(0, {cores[env.local_rank]})
    job = load_job(config.job)
    store = open_store(env, config.store_timeout_s)
    logger.info(
        "rank %d of %d (node %d, restart %d) starting %s",
        env.rank, env.world_size, env.node_rank, env.restart_count, config.job,
    )  # fmt: skip
    try:
        run(run_node(job, config, env, store))
    except Exception as exc:
        logger.error("rank %d: the job failed: %s", env.rank, describe(exc))
        raise
    logger.info("rank %d: the job ended", env.rank)
    return 0
