"""Workload files: what a simulated RL job is (cluster, model, batch, lengths, curves, costs).

A workload is a TOML file (format in ``docs/workloads.md``) read into a frozen
:class:`Workload`. Every section maps to one frozen dataclass; unknown keys, missing
keys and out-of-range values raise ``ValueError`` naming the key. The ``[scheduler]``
table holds :class:`~dynarl.sched.SchedulerConfig` fields. :func:`with_overrides` applies
``section.key=value`` changes (the CLI's ``--sweep``); :func:`dump_workload` writes the
TOML back (the calibration script uses it). Pure data; no simulation happens here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, cast

from dynarl.sched import SchedulerConfig
from dynarl.sim._specs import (
    AgenticSpec,
    BatchSpec,
    ClusterSpec,
    LengthSpec,
    MigrationSpec,
    ModelSpec,
    RolloutSpec,
    StageSpec,
    VerlSpec,
)

__all__ = [
    "Workload",
    "dump_workload",
    "file_hash",
    "load_workload",
    "with_overrides",
    "workload_from_dict",
]

SWEEP_ALIASES = {"u_low": "scheduler.util_low", "t_window": "scheduler.donor_window_s"}
"""Short names of the scheduler parameters the DynaRL paper sweeps."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A simulated RL job (see the module docstring)."""

    name: str
    """Label."""
    kind: Literal["math", "agentic"]
    """Single-turn math reasoning (tokens/s) or multi-turn agentic (episodes/s)."""
    seed: int
    """Seed of the trace: every policy sees the same prompts, lengths and tool latencies."""
    cluster: ClusterSpec
    """The GPUs."""
    model: ModelSpec
    """The policy model."""
    batch: BatchSpec
    """The iteration's batch."""
    lengths: LengthSpec
    """Prompt and output lengths."""
    rollout: RolloutSpec
    """Rollout engines."""
    inference: StageSpec
    """Log-prob inference."""
    trainer: StageSpec
    """The trainer."""
    migration: MigrationSpec
    """Migration costs."""
    agentic: AgenticSpec | None = None
    """Multi-turn settings (agentic workloads only)."""
    verl: VerlSpec = field(default_factory=VerlSpec)
    """verl-hybrid settings."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """dynarl's scheduler settings."""
    num_iterations: int = 3
    """Iterations simulated."""
    num_warmup_iterations: int = 1
    """Leading iterations left out of the figures."""
    report_interval_s: float = 1.0
    """Seconds between component reports (virtual time)."""
    notes: str = ""
    """Free text (where the numbers come from)."""

    def __post_init__(self) -> None:
        if self.kind not in ("math", "agentic"):
            raise ValueError(f"kind must be 'math' or 'agentic', got {self.kind!r}")
        if (self.kind == "agentic") != (self.agentic is not None):
            raise ValueError("an agentic workload needs an [agentic] table, a math one none")
        if not 0 <= self.num_warmup_iterations < self.num_iterations:
            raise ValueError("need 0 <= num_warmup_iterations < num_iterations")
        if not self.report_interval_s > 0:
            raise ValueError(f"report_interval_s must be > 0, got {self.report_interval_s!r}")
        per_node = self.cluster.num_gpus_per_node
        for name, tp in (
            ("rollout", self.rollout.tp),
            ("inference", self.inference.tp),
            ("trainer", self.trainer.tp),
        ):
            if tp > per_node or per_node % tp:
                raise ValueError(f"{name}.tp {tp} must divide num_gpus_per_node {per_node}")
        if self.trainer.min_gpus > self.cluster.num_gpus:
            raise ValueError("trainer.min_gpus exceeds the cluster")


_SECTIONS: dict[str, type[Any]] = {
    "cluster": ClusterSpec,
    "model": ModelSpec,
    "batch": BatchSpec,
    "lengths": LengthSpec,
    "rollout": RolloutSpec,
    "inference": StageSpec,
    "trainer": StageSpec,
    "migration": MigrationSpec,
    "agentic": AgenticSpec,
    "verl": VerlSpec,
    "scheduler": SchedulerConfig,
}
_TOP = ("name", "kind", "seed", "num_iterations", "num_warmup_iterations", "report_interval_s")


def _build(section: str, cls: type[Any], table: object) -> Any:
    if not isinstance(table, Mapping):
        raise ValueError(f"[{section}] must be a table")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise ValueError(f"[{section}] has unknown keys {unknown}; known: {sorted(names)}")
    try:
        return cls(**table)
    except TypeError as err:
        raise ValueError(f"[{section}]: {err}") from err


def workload_from_dict(data: Mapping[str, Any]) -> Workload:
    """Build a :class:`Workload` from parsed TOML; raises ValueError naming a bad key."""
    unknown = sorted(set(data) - set(_SECTIONS) - set(_TOP) - {"notes"})
    if unknown:
        raise ValueError(f"unknown top-level keys {unknown}")
    for key in ("name", "kind", "seed", "cluster", "model", "batch", "lengths", "rollout"):
        if key not in data:
            raise ValueError(f"workload is missing {key!r}")
    kwargs: dict[str, Any] = {k: data[k] for k in (*_TOP, "notes") if k in data}
    for section, cls in _SECTIONS.items():
        if section in data:
            kwargs[section] = _build(section, cls, data[section])
    for needed in ("inference", "trainer", "migration"):
        if needed not in kwargs:
            raise ValueError(f"workload is missing the [{needed}] table")
    try:
        return Workload(**kwargs)
    except TypeError as err:
        raise ValueError(str(err)) from err


def load_workload(path: str | Path) -> Workload:
    """Read a workload TOML file; raises ValueError (with the path) for a bad file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from err
    try:
        return workload_from_dict(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def file_hash(path: str | Path) -> str:
    """SHA-256 of a file's bytes (the tests pin the shipped workloads by it)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def with_overrides(workload: Workload, overrides: Mapping[str, object]) -> Workload:
    """A copy with ``section.key`` (or top-level ``key``) values replaced.

    ``u_low`` and ``t_window`` name the scheduler's U_low and T. Raising T above the
    scheduler's stats window raises the window with it (it must cover T). Raises
    ValueError for an unknown key or a value out of range.
    """
    result = workload
    for raw_key, value in overrides.items():
        key = SWEEP_ALIASES.get(raw_key, raw_key)
        section, _, name = key.rpartition(".")
        if not section:
            if name not in _TOP:
                raise ValueError(f"unknown workload key {raw_key!r}")
            result = replace(result, **cast(dict[str, Any], {name: value}))
            continue
        current = getattr(result, section, None)
        if section not in _SECTIONS or current is None:
            raise ValueError(f"unknown workload section in {raw_key!r}")
        if name not in {f.name for f in fields(current)}:
            raise ValueError(f"unknown key {name!r} in [{section}]")
        changes: dict[str, object] = {name: value}
        if section == "scheduler" and name == "donor_window_s":
            window = max(float(value), current.stats_window_s)  # type: ignore[arg-type]
            changes["stats_window_s"] = window
        result = replace(result, **{section: replace(current, **changes)})
    return result


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if value is None:
        raise ValueError("TOML has no null")
    raise ValueError(f"cannot write {value!r} as TOML")


def dump_workload(workload: Workload, header: str = "") -> str:
    """The TOML text of ``workload`` (fields left at None are omitted).

    ``header`` lines are written first as comments.
    """
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for key in (*_TOP, "notes"):
        value = getattr(workload, key)
        if key == "notes" and not value:
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    for section in _SECTIONS:
        obj = getattr(workload, section)
        if obj is None:
            continue
        lines.append("")
        lines.append(f"[{section}]")
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
