"""What importing each layer loads: heavy third-party packages stay out of the layers that
do not need them, and the optional ones (the ``plots`` extra) fail with an error that names
the extra.

Each import fact is checked in a fresh interpreter (this one has already imported
everything); no timings here, they are measured by ``bench/imports.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynarl import plots

_LOADED = "import json, sys; print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))"


def loaded_by(package: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after ``import package``."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {package}; {_LOADED}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("package", ["dynarl", "dynarl.bus", "dynarl.sched", "dynarl.sim"])
def test_the_scheduler_layers_load_no_torch(package: str) -> None:
    assert "torch" not in loaded_by(package)


def test_the_megatron_backend_loads_megatron_only_to_build_a_trainer() -> None:
    assert "megatron" not in loaded_by("dynarl.backends.megatron")


@pytest.mark.parametrize("package", ["dynarl.sched", "dynarl.sim"])
def test_the_scheduler_and_simulator_load_no_matplotlib(package: str) -> None:
    assert "matplotlib" not in loaded_by(package)


def test_a_chart_without_matplotlib_names_the_plots_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ModuleNotFoundError, match=r"matplotlib.*dynarl\[plots\]") as caught:
        plots.line_chart(tmp_path / "chart.png", {"rollout": ([0.0, 1.0], [1.0, 2.0])})
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)
    assert not (tmp_path / "chart.png").exists()


def test_the_demo_live_view_without_rich_names_the_plots_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dynarl.demo._demo import LiveView

    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    with pytest.raises(ModuleNotFoundError, match=r"live view needs rich.*dynarl\[plots\]"):
        LiveView(config=None, enabled=False)


def test_plots_extra_leaves_other_errors_alone() -> None:
    with pytest.raises(KeyError), plots.plots_extra("drawing charts"):
        raise KeyError("not an import")
