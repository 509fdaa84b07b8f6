"""Settings of a worker process, from its command line or environment.

The local launcher writes them as command-line flags; under torchrun the device comes from
``RANK`` (read once through :class:`~dynarl._distenv.DistEnv`) and the rest from flags or
``DYNARL_*`` variables. Pure; runs in the worker before it imports anything heavy.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynarl._distenv import DistEnv
from dynarl.runtime._cores import pinned_cores

__all__ = ["WorkerOptions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOptions:
    """How one worker process joins its job."""

    controller: str
    """Address of the controller's bus server (``tcp://host:port``)."""
    device: int
    """This worker's device id (its torch.distributed rank)."""
    store_host: str = "127.0.0.1"
    """Host of the job's TCPStore."""
    store_port: int = 0
    """Port of the job's TCPStore (0: none; roles then cannot build process groups)."""
    store_timeout_s: float = 30.0
    """Deadline of every TCPStore operation, seconds."""
    register_timeout_s: float = 60.0
    """Deadline of registration with the controller and managers, seconds."""
    metrics_interval_s: float = 0.5
    """Seconds between two WorkerMetrics sent to the component's manager."""
    collective_timeout_s: float = 20.0
    """Deadline of group construction and of every wait on the network in a reshard."""
    num_threads: int = 1
    """torch intra-op threads (one device per process: one thread)."""
    preload: tuple[str, ...] = ()
    """Modules imported before registering (role modules: heavy imports come first)."""
    cpus: tuple[int, ...] = ()
    """Cores this worker and every process it starts run on (empty: not pinned)."""
    key_file: str = ""
    """This worker's CURVE secret key file, for a controller that binds a routable address
    (empty: plain TCP, which only a loopback controller accepts)."""
    server_key_file: str = ""
    """A file holding the controller's CURVE public key (with ``key_file``)."""

    def __post_init__(self) -> None:
        if not self.controller:
            raise ValueError("WorkerOptions.controller must be a bus address")
        if self.device < 0:
            raise ValueError(f"WorkerOptions.device must be >= 0, got {self.device}")
        if not 0 <= self.store_port < 65536:
            raise ValueError(f"WorkerOptions.store_port must be a TCP port, got {self.store_port}")
        for name in (
            "store_timeout_s",
            "register_timeout_s",
            "metrics_interval_s",
            "collective_timeout_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"WorkerOptions.{name} must be positive, got {value!r}")
        if self.num_threads < 1:
            raise ValueError(f"WorkerOptions.num_threads must be >= 1, got {self.num_threads}")
        if bool(self.key_file) != bool(self.server_key_file):
            raise ValueError(
                "WorkerOptions.key_file and server_key_file go together (CURVE needs this "
                f"worker's secret key and the controller's public key), got {self.key_file!r} "
                f"and {self.server_key_file!r}"
            )
        if any(core < 0 for core in self.cpus) or len(set(self.cpus)) != len(self.cpus):
            raise ValueError(f"WorkerOptions.cpus must be distinct core ids >= 0, got {self.cpus}")

    def to_args(self) -> list[str]:
        """These options as command-line flags (what :meth:`from_args` reads)."""
        args = [
            f"--controller={self.controller}",
            f"--device={self.device}",
            f"--store={self.store_host}:{self.store_port}",
            f"--store-timeout={self.store_timeout_s}",
            f"--register-timeout={self.register_timeout_s}",
            f"--metrics-interval={self.metrics_interval_s}",
            f"--collective-timeout={self.collective_timeout_s}",
            f"--threads={self.num_threads}",
        ]
        if self.cpus:
            args.append(f"--cpus={','.join(map(str, self.cpus))}")
        if self.key_file:
            args += [f"--key-file={self.key_file}", f"--server-key={self.server_key_file}"]
        return args + [f"--preload={module}" for module in self.preload]

    @classmethod
    def from_args(
        cls, argv: Sequence[str], environ: Mapping[str, str] | None = None
    ) -> WorkerOptions:
        """Parse flags; a missing ``--device`` is torchrun's ``RANK``, a missing
        ``--controller`` / ``--store`` is ``DYNARL_CONTROLLER`` / ``DYNARL_STORE``.
        ``--pin-cores`` (or ``DYNARL_PIN_CORES=1``) without ``--cpus`` pins the worker to
        the ``LOCAL_RANK``-th core this process may use (a device is one core, per node).

        Raises ValueError naming what is missing or malformed.
        """
        env = os.environ if environ is None else environ
        parser = argparse.ArgumentParser(prog="python -m dynarl.runtime.worker")
        parser.add_argument("--controller", default=env.get("DYNARL_CONTROLLER", ""))
        parser.add_argument("--device", type=int, default=None)
        parser.add_argument("--store", default=env.get("DYNARL_STORE", ""))
        parser.add_argument("--store-timeout", type=float, default=30.0)
        parser.add_argument("--register-timeout", type=float, default=60.0)
        parser.add_argument("--metrics-interval", type=float, default=0.5)
        parser.add_argument("--collective-timeout", type=float, default=20.0)
        parser.add_argument("--threads", type=int, default=1)
        parser.add_argument("--preload", action="append", default=[])
        parser.add_argument("--cpus", default="")
        parser.add_argument("--key-file", default="")
        parser.add_argument("--server-key", default="")
        parser.add_argument(
            "--pin-cores", action="store_true", default=env.get("DYNARL_PIN_CORES") == "1"
        )
        args = parser.parse_args(list(argv))
        device = args.device if args.device is not None else DistEnv.from_env(env).rank
        cpus = _cpus(args.cpus)
        if args.pin_cores and not cpus:
            local = DistEnv.from_env(env)
            cores = pinned_cores(
                local.local_world_size, os.sched_getaffinity(0), setting="--pin-cores"
            )
            cpus = (cores[local.local_rank],)
        host, port = _store_address(args.store)
        return cls(
            controller=args.controller,
            device=device,
            store_host=host,
            store_port=port,
            store_timeout_s=args.store_timeout,
            register_timeout_s=args.register_timeout,
            metrics_interval_s=args.metrics_interval,
            collective_timeout_s=args.collective_timeout,
            num_threads=args.threads,
            preload=tuple(args.preload),
            cpus=cpus,
            key_file=args.key_file,
            server_key_file=args.server_key,
        )


def _cpus(text: str) -> tuple[int, ...]:
    """``--cpus=0,2``: core ids (ValueError naming the flag when they are not)."""
    try:
        return tuple(int(part) for part in text.split(",")) if text else ()
    except ValueError:
        raise ValueError(f"--cpus must be core ids separated by commas, got {text!r}") from None


def _store_address(text: str) -> tuple[str, int]:
    if not text:
        return "127.0.0.1", 0
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"store address must be host:port, got {text!r}")
    return host or "127.0.0.1", int(port)
