"""Installing the built dynarl wheel keeps the torch a user already has, if it is 2.13 or
newer, and brings a newer one only when the installed torch is older.

The test builds the wheel from a copy of the project, writes stub wheels (a package with an
empty ``__init__``) for every dependency the wheel requires, and asks pip, offline and with
no configuration, what it would install into a fresh venv holding a stub ``torch``. The
find-links folder also offers a stub ``torch`` 2.13.0, the build the development machines
carry: a pin on it would make pip replace a GPU user's torch with it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

# The version that find-links offers: the CPU build that constraints.txt pins.
OFFERED_TORCH = "2.13.0"


def _pip_env() -> dict[str, str]:
    """The environment without pip settings: this machine's pip configuration caps torch
    and points find-links at a folder of real wheels."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_CONSTRAINT": "", "PIP_NO_INPUT": "1"}
    return env


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    """Run this interpreter's pip; ``--python`` points it at another environment."""
    command = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    return subprocess.run(command, env=_pip_env(), capture_output=True, text=True, check=False)


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def write_stub_wheel(folder: Path, name: str, version: str) -> Path:
    """Write a pure-python wheel of ``name`` at ``version`` whose package is empty."""
    dist = canonicalize_name(name).replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": b"",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: dynarl-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = [_record_line(arcname, data) for arcname, data in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,", ""]).encode()
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for arcname, data in files.items():
            wheel.writestr(arcname, data)
    return path


def required_dependencies(wheel: Path) -> list[Requirement]:
    """The ``Requires-Dist`` entries of ``wheel`` that apply here without any extra."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(archive.read(metadata).decode())
    requirements = [Requirement(line) for line in headers.get_all("Requires-Dist", [])]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def satisfying_version(requirement: Requirement) -> str:
    """A version that ``requirement``'s specifier accepts: its pinned or lower bound."""
    bounds = [s.version for s in requirement.specifier if s.operator in ("==", ">=", "~=")]
    version = bounds[0] if bounds else "1.0"
    assert requirement.specifier.contains(version), f"no stub version for {requirement}"
    return version


@pytest.fixture(scope="module")
def find_links(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the built dynarl wheel and a stub wheel for each of its dependencies
    (torch at ``OFFERED_TORCH``)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "dynarl", source / "dynarl", ignore=ignore)
    folder = tmp_path_factory.mktemp("find-links")
    built = _pip(
        "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "-w", str(folder), str(source),
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = folder.glob("dynarl-*.whl")
    for requirement in required_dependencies(wheel):
        is_torch = canonicalize_name(requirement.name) == "torch"
        version = OFFERED_TORCH if is_torch else satisfying_version(requirement)
        write_stub_wheel(folder, requirement.name, version)
    return folder


def planned_installs(find_links: Path, tmp_path: Path, installed_torch: str) -> dict[str, str]:
    """What pip plans to install, name to version, when dynarl's wheel goes into a fresh venv
    that holds a stub torch at ``installed_torch``."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    torch = write_stub_wheel(tmp_path, "torch", installed_torch)
    installed = _pip("--python", python, "install", "--no-index", "--no-deps", str(torch))
    assert installed.returncode == 0, installed.stderr
    report = tmp_path / "report.json"
    (wheel,) = find_links.glob("dynarl-*.whl")
    planned = _pip(
        "--python", python, "install", "--dry-run", "--report", str(report),
        "--no-index", "--find-links", str(find_links), str(wheel),
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    return {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }


def test_a_newer_torch_is_kept(find_links: Path, tmp_path: Path) -> None:
    planned = planned_installs(find_links, tmp_path, installed_torch="2.99.0")
    assert "dynarl" in planned
    assert "torch" not in planned, f"pip would replace torch 2.99.0 with {planned['torch']}"


def test_an_older_torch_is_replaced(find_links: Path, tmp_path: Path) -> None:
    planned = planned_installs(find_links, tmp_path, installed_torch="2.12.0")
    assert planned.get("torch") == OFFERED_TORCH
