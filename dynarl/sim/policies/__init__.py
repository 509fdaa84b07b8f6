"""The allocation policies the simulator compares (``docs/workloads.md``, "Policies")."""

from __future__ import annotations

from dynarl.sim.policies._dynarl import DynarlPolicy
from dynarl.sim.policies._registry import POLICY_NAMES, make_policy
from dynarl.sim.policies._rlinf import RlinfRule
from dynarl.sim.policies._static import StaticSequential, StaticSplit
from dynarl.sim.policies._verl import VerlHybrid

__all__ = [
    "POLICY_NAMES",
    "DynarlPolicy",
    "RlinfRule",
    "StaticSequential",
    "StaticSplit",
    "VerlHybrid",
    "make_policy",
]
