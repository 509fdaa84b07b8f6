"""The decision plane: pipeline hypergraph, donor detection, candidate evaluation, policies."""

from __future__ import annotations

from dynarl.sched.config import SchedulerConfig
from dynarl.sched.extract import (
    ChannelUse,
    ExtractedComponent,
    ExtractedEdge,
    ExtractedGraph,
    UnresolvedSite,
    extract_graph,
)
from dynarl.sched.graph import Affinity, HyperEdge, Hypergraph, HyperNode, Node

__all__ = [
    "Affinity",
    "ChannelUse",
    "ExtractedComponent",
    "ExtractedEdge",
    "ExtractedGraph",
    "HyperEdge",
    "HyperNode",
    "Hypergraph",
    "Node",
    "SchedulerConfig",
    "UnresolvedSite",
    "extract_graph",
]
