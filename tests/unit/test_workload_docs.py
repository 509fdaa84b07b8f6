"""docs/workloads.md is the reference of the workload format: every key the reader accepts
is in its table's key table, with a meaning and a unit, and the tables list no other key.

The keys come from the reader's own declarations (its tables and their dataclasses), so a
new field that is not documented fails here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dynarl.sim import _workload_file

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "workloads.md"


def _accepted() -> dict[str, set[str]]:
    """The keys a file may hold, by table ("" is the top level), as the reader declares them."""
    top = set(_workload_file._TOP) | {"notes"}
    keys = {"": top}
    for name, cls in _workload_file._SECTIONS.items():
        keys[name] = {f.name for f in dataclasses.fields(cls)}
    return keys


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _key_table(text: str, table: str) -> dict[str, dict[str, str]]:
    """The rows, by key, of the first table after the heading that names ``table``."""
    title = "Top level" if not table else f"`[{table}]`"
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.startswith("#") and title in line), None
    )
    assert start is not None, f"no heading for {title}"
    block: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            block.append(line)
        elif block:
            break
    assert len(block) >= 3, f"no key table under {title}"
    header = [c.lower() for c in _cells(block[0])]
    out = {}
    for line in block[2:]:
        row = dict(zip(header, _cells(line), strict=False))
        out[row.get("key", "").strip("`")] = row
    return out


@pytest.mark.parametrize("table", list(_accepted()), ids=lambda t: t or "top level")
def test_every_accepted_key_has_a_meaning_and_a_unit_in_its_table(table: str) -> None:
    text = PAGE.read_text(encoding="utf-8")
    rows = _key_table(text, table)
    accepted = _accepted()[table]
    undocumented = sorted(accepted - set(rows))
    assert not undocumented, f"[{table}] keys missing from docs/workloads.md: {undocumented}"
    assert not sorted(set(rows) - accepted), f"[{table}] documents keys the reader refuses"
    for key in sorted(accepted):
        row = rows[key]
        for column in ("meaning", "unit", "default"):
            value = row.get(column, "")
            assert re.search(r"\w", value), f"[{table}] {key}: no {column}"
