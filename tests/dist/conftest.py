"""Fixtures of the multi-process (gloo) tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from migrate_ranks import run_ranks


@pytest.fixture
def spawn_ranks() -> Callable[..., list[Any]]:
    """Run a function in N spawned ranks (see :func:`migrate_ranks.run_ranks`)."""
    return run_ranks
