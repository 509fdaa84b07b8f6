"""Tests against real inference servers (a package, so that its servers are package-scoped)."""
