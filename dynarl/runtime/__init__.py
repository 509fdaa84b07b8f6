"""The running system: what a user starts, and the processes it is made of.

- :class:`Job`: dynarl embedded in the user's own loop (``async with dynarl.Job(...)``),
  made of :class:`ComponentSpec` s, a :class:`JobConfig` and a :class:`RuntimeConfig`;
  :class:`JobSpec`: a whole job in one module (components, configuration, the driving
  loop), run here (``JobSpec.run``) or across nodes by torchrun
  (``python -m dynarl.runtime.launch --job module:JOB``);
  :class:`DurableRun` (:class:`DurableConfig`) around a durable job's loop (checkpoint,
  resume, recover from a dead worker: :class:`Recovery`);
- roles see a :class:`RoleContext` and report :class:`RoleMetrics`; a call's reply is a
  :class:`CallResult`; serving outputs carry the metadata keys :data:`FINISH`,
  :data:`PROMPT_LEN`, :data:`RESUMED` and :data:`VERSIONS`
  (:func:`encode_versions` / :func:`decode_versions`; :func:`stale_tokens` counts a
  sample's tokens from another weight version);
- :class:`MetricsExporter`: the controller's Prometheus endpoint;
- :class:`LoadMeter` → :class:`ForeignLoad`: how much CPU other processes took while this
  process and everything it started ran (to flag a timing comparison made under load);
- :class:`Journal` and :class:`CheckpointStore`: the durable records a job keeps.

By concern, below it: :mod:`.controller` (bus, scheduler, coordinator, group managers,
one driver per migration kind), :mod:`.worker` (one process per device,
``python -m dynarl.runtime.worker``), :mod:`.launch` (local launcher, rendezvous, the
torchrun entry point ``python -m dynarl.runtime.launch``) and :mod:`.durable` (journal,
checkpoints, shard files, the sample source and manifest).
"""

from __future__ import annotations

from dynarl.runtime._cores import FOREIGN_LOAD_LIMIT, ForeignLoad, LoadMeter
from dynarl.runtime._durable_run import DurableConfig, DurableRun, Recovery
from dynarl.runtime._job import Job, JobConfig
from dynarl.runtime._job_spec import JobSpec
from dynarl.runtime._spec import ComponentSpec, RuntimeConfig, pipeline_graph
from dynarl.runtime._worker_protocol import (
    FINISH,
    PROMPT_LEN,
    RESUMED,
    VERSIONS,
    CallResult,
    decode_versions,
    encode_versions,
    stale_tokens,
)
from dynarl.runtime.controller import MetricsExporter
from dynarl.runtime.durable import CheckpointStore, Journal
from dynarl.runtime.worker import RoleContext, RoleMetrics

__all__ = [
    "FINISH",
    "FOREIGN_LOAD_LIMIT",
    "PROMPT_LEN",
    "RESUMED",
    "VERSIONS",
    "CallResult",
    "CheckpointStore",
    "ComponentSpec",
    "DurableConfig",
    "DurableRun",
    "ForeignLoad",
    "Job",
    "JobConfig",
    "JobSpec",
    "Journal",
    "LoadMeter",
    "MetricsExporter",
    "Recovery",
    "RoleContext",
    "RoleMetrics",
    "RuntimeConfig",
    "decode_versions",
    "encode_versions",
    "pipeline_graph",
    "stale_tokens",
]
