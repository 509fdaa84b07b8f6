"""Workload files: what a simulated RL job is (cluster, model, batch, lengths, curves, costs).

A workload is a TOML file (format in ``docs/workloads.md``) read into a frozen
:class:`Workload`. Every table maps to one frozen dataclass, and the keys a file may hold
are those dataclasses' fields (:func:`file_keys`). Reading raises ``ValueError`` naming
the table and key as the file spells them (``[trainer] min_gpus = 6``) and the values
involved: for an unknown key or table (with the closest known one), a missing key, a
value of the wrong type or out of range, and a workload that breaks a rule across tables
(``_workload_rules.py``). The ``[scheduler]`` table holds
:class:`~dynarl.sched.SchedulerConfig` fields; its node size and GPU memory default to the
``[cluster]``'s. :func:`with_overrides` applies ``section.key=value`` changes (the CLI's
``--sweep``); :func:`dump_workload` writes the TOML back (the calibration script uses
it). Pure data; no simulation happens here.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, cast

from dynarl.errors import ConfigValueError
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
from dynarl.sim._workload_rules import GIB, check_workload

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
    """A simulated RL job (see the module docstring).

    Raises ValueError, naming the keys as a file spells them, when it breaks a rule across
    its tables (``docs/workloads.md``, "Rules").
    """

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
        check_workload(self)


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
_TOP = tuple(f.name for f in fields(Workload) if f.name not in _SECTIONS)
"""Top-level keys: ``name``, ``kind``, ``seed``, the iteration counts, ``notes``."""
_WRITTEN_WHEN_SET = {
    ("scheduler", "num_loss_iterations"),
    ("scheduler", "release_error_fraction"),
    ("rollout", "cache_block_tokens"),
    ("rollout", "shared_prefix"),
    ("rollout", "prefix_cached_after_prefill"),
    ("rollout", "request_overhead_s"),
    ("migration", "trainer_kind"),
}
"""Keys added after the shipped files were written: :func:`dump_workload` writes them only
when they differ from their default, so those files still round-trip byte for byte."""


def _required(cls: type[Any]) -> list[str]:
    return [
        f.name
        for f in fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def _closest(word: str, choices: list[str]) -> list[str]:
    return difflib.get_close_matches(word, choices, n=1, cutoff=0.6)


def _owners(key: str) -> list[str]:
    return [f"[{s}]" for s, cls in _SECTIONS.items() if key in {f.name for f in fields(cls)}]


def _unknown_top(key: str) -> str:
    tables, top = list(_SECTIONS), list(_TOP)
    hint = [f"[{c}]" for c in _closest(key, tables)] or _closest(key, top)
    hint = hint or [f"{key} in {owner}" for owner in _owners(key)]
    suggestion = f" (did you mean {hint[0]}?)" if hint else ""
    listed = ", ".join(top) + "; tables: " + ", ".join(f"[{t}]" for t in tables)
    return f"unknown top-level key {key!r}{suggestion}; top-level keys: {listed}"


def _unknown_key(section: str, key: str, names: list[str]) -> str:
    hint = _closest(key, names)
    owners = _owners(key)
    suggestion = f" (did you mean {hint[0]}?)" if hint else ""
    if not hint and owners:
        suggestion = f" (a key of {', '.join(owners)})"
    return f"[{section}] has unknown key {key!r}{suggestion}; keys of [{section}]: " + ", ".join(
        names
    )


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _type_problem(hint: Any, value: object) -> str:
    """What ``value`` should be when it is not of type ``hint`` (TOML values), else ""."""
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return "" if value in choices else "one of " + ", ".join(map(repr, choices))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return ""
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint not in _KINDS:
        return ""
    if hint in (int, float):  # TOML's true is not a number; an integer is a float here
        ok = isinstance(value, int if hint is int else int | float)
        ok = ok and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    return "" if ok else _KINDS[hint]


def _check_types(label: str, cls: type[Any], table: Mapping[str, object]) -> None:
    hints = typing.get_type_hints(cls)
    for key, value in table.items():
        problem = _type_problem(hints[key], value)
        if problem:
            raise ValueError(f"{label}{key} = {value!r} must be {problem}")


def _build(section: str, cls: type[Any], table: object) -> Any:
    if not isinstance(table, Mapping):
        raise ValueError(f"[{section}] must be a table, got {section} = {table!r}")
    names = [f.name for f in fields(cls)]
    unknown = [key for key in table if key not in names]
    if unknown:
        raise ValueError("; ".join(_unknown_key(section, key, names) for key in unknown))
    missing = [key for key in _required(cls) if key not in table]
    if missing:
        raise ValueError(f"[{section}] is missing {', '.join(missing)}")
    _check_types(f"[{section}] ", cls, table)
    try:
        return cls(**table)
    except ConfigValueError as err:
        raise ValueError(err.naming(f"[{section}] ")) from err


def _scheduler_table(data: Mapping[str, Any], cluster: ClusterSpec) -> object:
    """The ``[scheduler]`` table with the cluster's node size and memory as defaults."""
    table: object = data.get("scheduler", {})
    if not isinstance(table, Mapping):
        return table  # _build names the error
    return {
        "num_devices_per_node": cluster.num_gpus_per_node,
        "device_memory_bytes": round(cluster.gpu_memory_gib * GIB),
        **table,
    }


def workload_from_dict(data: Mapping[str, Any]) -> Workload:
    """Build a :class:`Workload` from parsed TOML; raises ValueError naming a bad key.

    ``[scheduler] num_devices_per_node`` and ``device_memory_bytes`` default to the
    ``[cluster]``'s node size and GPU memory.
    """
    unknown = [key for key in data if key not in _SECTIONS and key not in _TOP]
    if unknown:
        raise ValueError("; ".join(_unknown_top(key) for key in unknown))
    missing = [key for key in _required(Workload) if key not in data]
    if missing:
        named = [key if key in _TOP else f"the [{key}] table" for key in missing]
        raise ValueError(f"workload is missing {', '.join(named)}")
    top = {k: data[k] for k in _TOP if k in data}
    _check_types("", Workload, top)
    kwargs: dict[str, Any] = dict(top)
    for section, cls in _SECTIONS.items():
        if section in data:
            kwargs[section] = _build(section, cls, data[section])
    scheduler = _scheduler_table(data, kwargs["cluster"])
    kwargs["scheduler"] = _build("scheduler", SchedulerConfig, scheduler)
    return Workload(**kwargs)


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
    scheduler's stats window raises the window with it (it must cover T); changing the
    cluster's node size or GPU memory changes the scheduler's with it. The rules across
    tables are checked once, on the result. Raises ValueError for an unknown key or a
    value of the wrong type or out of range, named as in a workload file.
    """
    top: dict[str, object] = {}
    tables: dict[str, dict[str, object]] = {}
    for raw_key, value in overrides.items():
        key = SWEEP_ALIASES.get(raw_key, raw_key)
        section, _, name = key.rpartition(".")
        if not section:
            if name not in _TOP:
                raise ValueError(f"unknown workload key {raw_key!r}")
            _check_types("", Workload, {name: value})
            top[name] = value
            continue
        cls = _SECTIONS.get(section)
        if cls is None or getattr(workload, section) is None:
            raise ValueError(f"unknown workload section in {raw_key!r}")
        names = [f.name for f in fields(cls)]
        if name not in names:
            raise ValueError(_unknown_key(section, name, names))
        _check_types(f"[{section}] ", cls, {name: value})
        tables.setdefault(section, {})[name] = value
    _follow(workload, tables)
    for section, changes in tables.items():
        try:
            top[section] = replace(getattr(workload, section), **changes)
        except ConfigValueError as err:
            raise ValueError(err.naming(f"[{section}] ")) from err
    return replace(workload, **cast(dict[str, Any], top))


def _follow(workload: Workload, tables: dict[str, dict[str, object]]) -> None:
    """Keys that move with an override: T's stats window, the cluster's scheduler view."""
    scheduler = tables.setdefault("scheduler", {})
    if "donor_window_s" in scheduler and "stats_window_s" not in scheduler:
        window = cast(float, scheduler["donor_window_s"])
        scheduler["stats_window_s"] = max(window, workload.scheduler.stats_window_s)
    cluster = tables.get("cluster", {})
    if "num_gpus_per_node" in cluster:
        scheduler.setdefault("num_devices_per_node", cluster["num_gpus_per_node"])
    if "gpu_memory_gib" in cluster:
        memory = cast(float, cluster["gpu_memory_gib"]) * GIB
        scheduler.setdefault("device_memory_bytes", round(memory))
    if not scheduler:
        del tables["scheduler"]


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
    """The TOML text of ``workload`` (fields left at None, and a few newer keys left at their
    default, are omitted).

    ``header`` lines are written first as comments.
    """
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for key in _TOP:
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
            if (section, f.name) in _WRITTEN_WHEN_SET and value == f.default:
                continue
            if value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
