"""The charts, read off their figures: what a reader needs to see is on them, and unhidden.

A legend sits outside every plotting area (the top band of an allocation chart holds the
transit marks); the dotted lines have a legend entry, and iteration (step) starts their
names above the plot; the warm-up is shaded and named; the policies of one comparison share
one time axis; device counts and steps get whole-number ticks only.

The figures are kept from being closed (``figures``) so the test can look at their axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from sim_support import small

from dynarl import plots
from dynarl.demo._demo import plot_runs
from dynarl.demo._device_schedules import RunPlan, Schedule, StepReport
from dynarl.demo._experiment import RunResult as DemoRun
from dynarl.sim import compare, plot_timelines
from dynarl.sim._results import RunResult

matplotlib = pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def runs() -> list[RunResult]:
    """A two-iteration workload (the first a warm-up) under two policies of unlike length."""
    return compare(small(), ("static-sequential", "dynarl"))


def panels(figure: Any) -> list[Any]:
    """The plotting areas of ``figure`` (not the axes that only name the marks)."""
    children = {id(child) for ax in figure.axes for child in ax.child_axes}
    return [ax for ax in figure.axes if id(ax) not in children]


def legend_entries(figure: Any) -> list[str]:
    legends = [ax.get_legend() for ax in figure.axes] + list(figure.legends)
    return [text.get_text() for legend in legends if legend for text in legend.get_texts()]


def assert_legends_clear(figure: Any) -> None:
    """Every legend of ``figure`` exists and covers no plotting area of it."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legends = [ax.get_legend() for ax in figure.axes if ax.get_legend()] + list(figure.legends)
    assert legends, "no legend"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in panels(figure):
            area = ax.get_window_extent(renderer)
            overlap = matplotlib.transforms.Bbox.intersection(box, area)
            assert overlap is None or overlap.width * overlap.height == 0, (
                f"legend {[t.get_text() for t in legend.get_texts()]} covers {ax.get_title()!r}"
            )


def mark_names(ax: Any) -> list[str]:
    """The names written above ``ax`` at its marks (on its top axis)."""
    ax.figure.canvas.draw()
    return [t.get_text() for child in ax.child_axes for t in child.get_xticklabels()]


def whole(ticks: Sequence[float]) -> bool:
    return all(float(t).is_integer() for t in ticks)


def test_the_policies_timelines_share_one_time_axis(
    figures: list[Any], runs: list[RunResult], tmp_path: Path
) -> None:
    ends = [r.timeline.end for r in runs]
    assert ends[0] != ends[1]
    paths = plot_timelines({r.policy: r.timeline for r in runs}, tmp_path, prefix="w-")
    limits = {ax.get_xlim() for figure in figures for ax in panels(figure)}
    assert len(limits) == 1, limits
    ((low, high),) = limits
    assert low == 0.0 and high >= max(e for e in ends if e is not None)
    assert [p.name for p in paths] == ["w-static-sequential.png", "w-dynarl.png", "w-policies.png"]
    side_by_side = panels(figures[-1])
    assert [ax.get_title() for ax in side_by_side] == ["static-sequential", "dynarl"]


def test_a_timeline_keeps_its_legend_off_the_bands(
    figures: list[Any], runs: list[RunResult], tmp_path: Path
) -> None:
    plot_timelines({r.policy: r.timeline for r in runs}, tmp_path)
    for figure in figures:
        assert_legends_clear(figure)
        for ax in panels(figure):
            assert whole(ax.get_yticks()), "GPUs are counted in whole numbers"


def test_a_timeline_names_its_iteration_lines_and_shades_the_warmup(
    figures: list[Any], runs: list[RunResult], tmp_path: Path
) -> None:
    dynarl = runs[1].timeline
    assert len(dynarl.iteration_starts) == 2 and dynarl.num_warmup_iterations == 1
    plot_timelines({"dynarl": dynarl}, tmp_path)
    ((ax,),) = [panels(f) for f in figures]
    entries = legend_entries(figures[0])
    assert "iteration start" in entries and "warm-up (not measured)" in entries
    assert mark_names(ax) == ["iteration 0", "iteration 1"]
    (span,) = [p for p in ax.patches if p.get_label() == "warm-up (not measured)"]
    start, next_start = dynarl.iteration_starts
    assert span.get_x() == pytest.approx(start)
    assert span.get_x() + span.get_width() == pytest.approx(next_start)


def test_a_chart_of_plain_numbers_keeps_its_legend_off_the_bands(
    figures: list[Any], tmp_path: Path
) -> None:
    times = [0.0, 10.0, 20.0, 30.0]
    plots.allocation_timeline(
        tmp_path / "a.png",
        times,
        {"rollout": [2, 2, 1, 1], "trainer": [0, 0, 1, 1], "transit": [0, 1, 0, 0]},
        marks=[0.0, 25.0],
    )
    plots.line_chart(
        tmp_path / "u.png", {"rollout": (times, [0.9, 0.4, 0.1, 0.1])}, marks=[25.0], step=True
    )
    for figure in figures:
        assert_legends_clear(figure)
        assert "iteration start" in legend_entries(figure)
    assert whole(panels(figures[0])[0].get_yticks())


def _step(index: int, wall: float) -> StepReport:
    return StepReport(
        step=index,
        mean_reward=0.2 * index,
        rewards=(0.0, 0.4 * index),
        loss=0.1 / (index + 1),
        kl=0.0,
        grad_norm=1.0,
        version=index + 1,
        checksum=f"c{index}",
        manifest=("1", "2"),
        micro_sizes=(2,),
        wall_s=wall,
        rollout_s=wall / 2,
        learned_early=0,
        resumed=0,
        turns=2,
        mean_response_tokens=10.0,
        max_response_tokens=20,
        phases={"rollout": wall / 2, "learn": wall / 4},
    )


def _demo_run(label: str, schedule: Schedule, step_s: float) -> DemoRun:
    num_steps = 5
    timeline = tuple(
        (i * step_s + part * step_s / 2, {"rollout": 2 - part, "trainer": part})
        for i in range(num_steps)
        for part in (0, 1)
    )
    return DemoRun(
        label=label,
        plan=RunPlan(schedule=schedule),
        steps=tuple(_step(i, step_s) for i in range(num_steps)),
        wall_s=num_steps * step_s,
        timeline=timeline,
        step_starts=tuple(i * step_s for i in range(num_steps)),
        scheduler_moves=0,
        migrations=0,
        pause_s=0.0,
        reshards_verified=0,
        run_dir="",
    )


def test_the_demo_charts_tick_whole_steps_and_devices_and_name_the_steps(
    figures: list[Any], tmp_path: Path
) -> None:
    runs = [
        _demo_run("dynarl", Schedule.DYNARL, 8.0),
        _demo_run("sequential", Schedule.SEQUENTIAL, 10.0),
    ]
    plot_runs(tmp_path, runs)
    timeline, curves = figures
    for ax in panels(curves):
        low, high = ax.get_xlim()
        assert whole([t for t in ax.get_xticks() if low <= t <= high]), ax.get_xticks()
    for ax in panels(timeline):
        assert whole(ax.get_yticks()), "devices are counted in whole numbers"
        assert mark_names(ax) == [f"step {i}" for i in range(5)]
    assert len({ax.get_xlim() for ax in panels(timeline)}) == 1
    assert "step start" in legend_entries(timeline)
    for figure in figures:
        assert_legends_clear(figure)
