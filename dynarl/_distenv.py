"""Configuration shared across layers, and the torchrun environment read once.

Package-specific settings live next to their package (``dynarl.bus.BusConfig``,
``dynarl.sched.SchedulerConfig``, ...); this module holds only what several layers read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DistEnv"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DistEnv:
    """Where this process sits in a torchrun (or local-launcher) job."""

    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    """Number of processes in the job."""
    local_rank: int = 0
    """Rank of this process on its node."""
    local_world_size: int = 1
    """Number of processes on this node."""
    node_rank: int = 0
    """Index of this node (torchrun's GROUP_RANK)."""
    master_addr: str = "127.0.0.1"
    """Host of the job's TCPStore (rank 0)."""
    master_port: int = 29500
    """Port of the job's TCPStore."""
    restart_count: int = 0
    """How many times torchrun has restarted this worker group."""
    use_agent_store: bool = False
    """Whether torchrun's agent hosts the TCPStore at master_addr:master_port (every rank
    connects as a client) rather than rank 0 (TORCHELASTIC_USE_AGENT_STORE)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"DistEnv.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"DistEnv.rank {self.rank} outside [0, {self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"DistEnv.local_rank {self.local_rank} outside [0, {self.local_world_size})"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"DistEnv.master_port must be a TCP port, got {self.master_port}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read the torchrun variables once; a missing variable takes the default.

        Raises ValueError naming the variable when one is set but not an integer.
        """
        env = os.environ if environ is None else environ

        def integer(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

        return cls(
            rank=integer("RANK", 0),
            world_size=integer("WORLD_SIZE", 1),
            local_rank=integer("LOCAL_RANK", 0),
            local_world_size=integer("LOCAL_WORLD_SIZE", 1),
            node_rank=integer("GROUP_RANK", 0),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=integer("MASTER_PORT", 29500),
            restart_count=integer("TORCHELASTIC_RESTART_COUNT", 0),
            use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
