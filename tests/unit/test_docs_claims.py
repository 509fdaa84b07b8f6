"""What the pages say about the code holds: where a setting goes, what differs per node,
how long a script takes (each a claim a reader acts on and a link checker cannot see)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = ROOT / "docs"


def test_every_runtime_config_in_the_docs_is_shown_where_it_goes() -> None:
    # A RuntimeConfig is not an argument of dynarl.Job: it is JobConfig's `runtime`.
    loose = [
        f"{page.name}:{text[: m.start()].count(chr(10)) + 1}"
        for page in sorted(DOCS.glob("*.md"))
        for text in [page.read_text()]
        for m in re.finditer(r"RuntimeConfig\(", text)
        if not re.search(r"runtime=(dynarl\.)?$", text[: m.start()])
    ]
    assert loose == [], f"RuntimeConfig(...) not shown as JobConfig(runtime=...): {loose}"


def _torchrun_commands(text: str) -> list[str]:
    """The torchrun commands of a page's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.lstrip().startswith("torchrun ")]


def test_the_launch_page_shows_each_node_its_own_secret_key() -> None:
    text = (DOCS / "torchrun.md").read_text()
    nodes = re.findall(r"^dynarl keys (\S+) --dir (\S+)", text, flags=re.MULTILINE)
    assert len(nodes) >= 2
    commands = _torchrun_commands(text)
    key_files = [re.search(r"--key-file (\S+)", c) for c in commands]
    assert all(key_files), "a torchrun command without --key-file"
    assert sorted(m.group(1) for m in key_files if m) == sorted(
        f"{directory}/{node}.key_secret" for node, directory in nodes
    )
    assert "same command on every node" not in text.lower()


def _seconds(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, pattern
    return int(match.group(1))


def test_the_two_node_script_and_its_page_give_the_same_duration() -> None:
    script = (ROOT / "examples" / "torchrun_two_node.sh").read_text()
    page = (DOCS / "torchrun.md").read_text()
    in_script = _seconds(r"# Usage: .*\(.*(?:about|~) ?(\d+) s\)", script)
    section = page[page.index("## Trying it on one machine") :]
    assert in_script == _seconds(r"\(about (\d+) s\)", section)
