"""The policies by name: what ``dynarl simulate --policy`` accepts."""

from __future__ import annotations

from dynarl.sim._components import SimPolicy
from dynarl.sim.policies._dynarl import DynarlPolicy
from dynarl.sim.policies._rlinf import RlinfRule
from dynarl.sim.policies._static import StaticSequential, StaticSplit
from dynarl.sim.policies._verl import VerlHybrid

__all__ = ["POLICY_NAMES", "make_policy"]


POLICY_NAMES = (
    "static-sequential",
    "static-split",
    "rlinf-rule",
    "verl-hybrid",
    "dynarl",
    "dynarl+priority",
)
"""Every policy, baselines first."""


def make_policy(name: str) -> SimPolicy:
    """A fresh policy object by name; raises ValueError for an unknown name."""
    if name == "static-sequential":
        return StaticSequential()
    if name == "static-split":
        return StaticSplit()
    if name == "rlinf-rule":
        return RlinfRule()
    if name == "verl-hybrid":
        return VerlHybrid()
    if name == "dynarl":
        return DynarlPolicy()
    if name == "dynarl+priority":
        return DynarlPolicy(priority=True)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
