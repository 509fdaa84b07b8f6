"""The README and docs/ say what works: every python and bash block runs, every link and
every path they name resolves.

Each fenced block carries a language. A document's blocks run in order, like a reader
following it, in one scratch directory that links the repository's top-level entries (so
relative paths work and whatever a block writes stays out of the checkout), with the
venv's ``bin`` first on ``PATH`` and a live dynarl bus server at ``$DYNARL_BUS`` (the
wire format's example talks to it): ``python`` blocks run as scripts, ``bash``/``sh``
blocks as ``bash -euo pipefail`` scripts, and a python block right after a
``<!-- file: NAME -->`` line is the file a later block uses: it is written to NAME. ``toml``
and ``json`` blocks must parse; ``text`` blocks are output or layouts. Commands covered
elsewhere, or that cannot run here, are in :data:`SKIPPED`, each with its reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from dynarl.bus import BusConfig, BusServer

ROOT = Path(__file__).resolve().parent.parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 120
EXECUTED = {"python", "bash", "sh"}
LANGUAGES = EXECUTED | {"toml", "json", "text"}

SKIPPED: dict[str, str] = {
    r"make demo": "runs the whole demo; tests/unit/test_demo.py runs it",
    r"make test": "this very suite",
    r"\.venv/bin/dynarl demo --mode hybrid": "tests/unit/test_demo_hybrid.py runs it (slow)",
    r"bash examples/torchrun_two_node\.sh": "tests/dist/test_examples_launch.py runs it",
    r"\.venv/bin/python examples/custom_loop\.py.*": "tests/dist/test_runtime_launch.py runs it",
    r"\.venv/bin/python examples/workloads/calibrate\.py": "rewrites the shipped workload files",
    r"\.venv/bin/python examples/workloads/calibrate\.py --fit": "refits for about a minute",
    r"torchrun .*": "needs two machines; examples/torchrun_two_node.sh is the same on loopback",
    r"dynarl keys .*": "run on each node; examples/torchrun_two_node.sh runs it on loopback",
    r"DYNARL_SOAK_S=\d+ \.venv/bin/python -m pytest -m slow tests/soak/.*": "a 10-minute soak",
}
"""Commands not run by this test (patterns matching a whole command, its comment cut off),
and why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    file: str = ""
    shown: str = ""
    """The ``text`` block right after this one: its output, as the document shows it."""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^[ \t]*```([^\n`]*)\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)
_FILE = re.compile(r"<!-- file: ([\w./-]+) -->\n$")


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text()
    blocks: list[Block] = []
    end = -1
    for match in _FENCE.finditer(text):
        named = _FILE.search(text, max(0, match.start() - 200), match.start())
        block = Block(
            path=path,
            line=text.count("\n", 0, match.start()) + 1,
            language=match.group(1).strip(),
            code=textwrap.dedent(match.group(2)),
            file=named.group(1) if named else "",
        )
        adjacent = blocks and not text[end : match.start()].strip()
        if adjacent and block.language == "text" and blocks[-1].language in EXECUTED:
            blocks[-1] = dataclasses.replace(blocks[-1], shown=block.code)
        blocks.append(block)
        end = match.end()
    return blocks


def missing_output(shown: str, out: str) -> list[str]:
    """Lines of ``shown`` (but those with an ellipsis) not found in ``out``, in order."""
    actual = iter(line.rstrip() for line in out.splitlines())
    return [
        line.rstrip()
        for line in shown.splitlines()
        if line.strip() and "..." not in line and line.rstrip() not in actual
    ]


BLOCKS = [block for path in DOCUMENTS for block in blocks_of(path)]
RUN = [b for b in BLOCKS if b.language in EXECUTED]


def test_every_block_names_a_known_language() -> None:
    untagged = [f"{b.name} ({b.language or 'none'})" for b in BLOCKS if b.language not in LANGUAGES]
    assert not untagged, f"blocks without a language of {sorted(LANGUAGES)}: {untagged}"
    assert len(RUN) >= 10  # the collection itself works


def test_toml_and_json_blocks_parse() -> None:
    for block in BLOCKS:
        if block.language == "toml":
            tomllib.loads(block.code)
        elif block.language == "json":
            json.loads(block.code)


def _commands(code: str) -> list[str]:
    """The block's commands, continuation lines joined."""
    return [line.strip() for line in code.replace("\\\n", " ").splitlines() if line.strip()]


def _matches(command: str, pattern: str) -> bool:
    return re.fullmatch(pattern, command.partition(" #")[0].strip()) is not None


def _skip_reason(command: str) -> str | None:
    reasons = [SKIPPED[pattern] for pattern in SKIPPED if _matches(command, pattern)]
    return reasons[0] if reasons else None


def _runnable(block: Block) -> str:
    if block.language == "python":
        return block.code
    kept = [c if _skip_reason(c) is None else ": skipped" for c in _commands(block.code)]
    return "\n".join(kept) + "\n"


def test_every_skip_is_used() -> None:
    commands = [c for b in RUN if b.language != "python" for c in _commands(b.code)]
    used = {p for c in commands for p in SKIPPED if _matches(c, p)}
    assert used == set(SKIPPED), f"stale skips: {sorted(set(SKIPPED) - used)}"


def _scratch(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git",):
            (work / entry.name).symlink_to(entry)
    return work


async def _run_with_bus(argv: list[str], cwd: Path) -> tuple[int, str]:
    config = BusConfig(heartbeat_interval_s=30.0)  # no heartbeat between a request and reply
    async with BusServer("tcp://127.0.0.1:0", config=config) as server:
        env = dict(os.environ, DYNARL_BUS=server.address, PYTHONUNBUFFERED="1")
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(BLOCK_TIMEOUT_S):
                out, _ = await process.communicate()
        finally:
            if process.returncode is None:
                os.killpg(process.pid, 9)
                await process.wait()
        assert process.returncode is not None
        return process.returncode, out.decode(errors="replace")


SLOW = {"docs/workloads.md": "simulates every policy on four 64-GPU workloads (~80 s)"}
"""Documents whose blocks run under ``make test-slow``, and why."""

WITH_CODE = [
    pytest.param(p, id=str(p.relative_to(ROOT)), marks=[pytest.mark.slow] * (name in SLOW))
    for p in DOCUMENTS
    if any(b.path == p for b in RUN)
    for name in [str(p.relative_to(ROOT))]
]


@pytest.mark.parametrize("path", WITH_CODE)
def test_the_blocks_run_in_order(path: Path, tmp_path: Path) -> None:
    work = _scratch(tmp_path)
    for index, block in enumerate(b for b in RUN if b.path == path):
        if block.file:
            compile(block.code, block.file, "exec")
            (work / block.file).write_text(block.code)
            continue
        script = tmp_path / f"block{index}.{'py' if block.language == 'python' else 'sh'}"
        script.write_text(_runnable(block))
        if block.language == "python":
            argv = [sys.executable, str(script)]
        else:
            argv = ["bash", "-euo", "pipefail", str(script)]
        code, out = asyncio.run(_run_with_bus(argv, work))
        assert code == 0, f"{block.name} failed ({code}):\n{out[-4000:]}"
        skipped = any(_skip_reason(c) for c in _commands(block.code)) and block.language != "python"
        if block.shown and not skipped:
            missing = missing_output(block.shown, out)
            assert not missing, f"{block.name} did not print {missing}:\n{out[-4000:]}"


# ---------------------------------------------------------------------------- links

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_PATH = re.compile(r"`((?:examples|docs|dynarl|tests|bench)/[\w./-]*[\w/])`")


def _prose(text: str) -> str:
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", _prose(path.read_text()), re.MULTILINE):
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(path: Path) -> list[str]:
    broken = []
    prose = _prose(path.read_text())
    for target in _LINK.findall(prose):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors_of(linked):
            broken.append(f"{target} (no heading #{anchor})")
    broken += [f"`{p}` (no such path)" for p in _PATH.findall(prose) if not (ROOT / p).exists()]
    return broken


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_links_and_named_paths_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_shown_output_is_compared_in_order_with_ellipses_skipped() -> None:
    out = "a\nb 1\nc\nd\n"
    assert missing_output("a\n...\nc\n", out) == []
    assert missing_output("c\na\n", out) == ["a"]
    assert missing_output("b 2 (...)\nd\n", out) == []
    assert missing_output("b 2\n", out) == ["b 2"]


def test_the_link_check_finds_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](other.md#a-code-heading) [self](#title) [web](https://example.com)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [bad self](#nope)\n"
        "```text\n[in a block](ignored.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md (no such file)",
        "other.md#nope (no heading #nope)",
        "#nope (no heading #nope)",
    ]


def test_every_doc_is_reachable_from_the_readme() -> None:
    readme = _prose((ROOT / "README.md").read_text())
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _LINK.findall(readme)}
    missing = [p.name for p in DOCUMENTS[1:] if p.resolve() not in linked]
    assert not missing, f"docs the README does not link: {missing}"
