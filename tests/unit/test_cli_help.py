"""The ``dynarl`` command's help and usage errors, as a newcomer meets them.

Help: a one-line summary per command in ``dynarl --help``; options in groups with their
defaults and choices; an example per command; no reStructuredText markup; the demo says
how long it takes. Usage errors (exit status 2): an unknown ``--policy`` or ``--sweep``
key names the valid choices and suggests the closest one.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from sim_support import small

import dynarl.cli as cli
import dynarl.cli._simulate as simulate_cli
from dynarl.sim import dump_workload, with_overrides
from dynarl.sim.policies import POLICY_NAMES

MARKUP = ("``", ":class:", ":func:", ":meth:", ":mod:", ":data:", "build_parser")


@pytest.fixture(autouse=True)
def _terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps help to the terminal


@pytest.fixture
def workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(dump_workload(small()), encoding="utf-8")
    return path


def run(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``dynarl ARGV`` in this process: the exit status, stdout, stderr."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own exit, if main lets it through
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_top_level_help_lists_every_command_with_a_one_line_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for markup in MARKUP:
        assert markup not in out, markup
    names = commands()
    assert set(names) == {"demo", "simulate", "events", "keys"}
    for name in names:
        assert re.search(rf"^    {re.escape(name)}\s+\w", out, re.MULTILINE), name
    assert "examples:" in out and "dynarl COMMAND --help" in out


@pytest.mark.parametrize("command", ["demo", "simulate", "events", "keys"])
def test_every_command_has_plain_help_with_defaults_and_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    for markup in MARKUP:
        assert markup not in out, markup
    assert re.search(r"^examples?:\n  dynarl " + command, out, re.MULTILINE)
    for action in commands()[command]._actions:
        if action.option_strings and action.help != argparse.SUPPRESS and action.dest != "help":
            if action.default not in (None, False):
                assert f"default: {action.default}" in out, action.dest


def test_demo_help_shows_groups_defaults_choices_and_how_long_it_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(["demo", "--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "How long: a few minutes. On a 2-core machine" in text
    assert "in about 4 minutes" in text
    for group in ("the job:", "what runs:", "output:"):
        assert f"\n{group}\n" in out
    for option in ("--task", "--steps", "--prompts", "--devices", "--seed", "--mode", "--out"):
        action = next(a for a in commands()["demo"]._actions if option in a.option_strings)
        assert action.help is not None and "(default: " in action.help, option
    assert "{tool_calc,chain_sum}" in out and "{sync,hybrid}" in out
    # the one-liner in `dynarl --help` says it too
    _, top, _ = run(["--help"], capsys)
    assert "a few minutes" in top


def test_the_demo_help_states_the_defaults_the_demo_uses() -> None:
    from dynarl.demo._demo import config_from_args
    from dynarl.demo._engine_cli import config_from
    from dynarl.demo._hybrid_demo import job_configs

    parser = commands()["demo"]
    helps = {a.dest: a.help or "" for a in parser._actions}
    sync = config_from_args(parser.parse_args([]))
    job, _, hybrid = job_configs(parser.parse_args(["--mode", "hybrid"]))
    assert f"(default: {sync.num_steps}; hybrid mode: {hybrid.num_steps})" in helps["steps"]
    vllm = config_from(parser.parse_args(["--engine", "vllm"])).experiment
    assert (
        f"(default: {sync.num_prompts}; hybrid mode: {hybrid.num_groups}; "
        f"--engine vllm: {vllm.num_prompts})" in helps["prompts"]
    )
    assert f"hybrid mode: {job.num_devices}; --engine vllm: {vllm.num_devices})" in helps["devices"]
    assert f"(default: {config_from(parser.parse_args([])).repetitions})" in helps["repetitions"]
    assert sync.num_devices == max(2, os.cpu_count() or 2)
    assert "the number of cores, at least 2" in helps["devices"]
    assert sync.task == job.task and f"(default: {sync.task})" in helps["task"]


def test_simulate_help_lists_the_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_cli._POLICIES == POLICY_NAMES  # what the help lists is what the simulator has
    _, out, _ = run(["simulate", "--help"], capsys)
    for name in POLICY_NAMES:
        assert re.search(rf"[ ,]{re.escape(name)}[,) ]", out), name


def test_an_unknown_policy_lists_the_valid_ones(
    workload_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["simulate", str(workload_file), "--policy", "foo"], capsys)
    assert code == 2
    assert "'foo'" in err and "did you mean" not in err
    assert "valid policies: " + ", ".join(POLICY_NAMES) in err
    assert err.startswith("usage: dynarl simulate")

    code, _, err = run(["simulate", str(workload_file), "--policy", "dynarl,dynrl"], capsys)
    assert code == 2 and "'dynrl' (did you mean dynarl?)" in err
    assert "valid policies: " + ", ".join(POLICY_NAMES) in err


def test_an_unknown_sweep_key_lists_the_valid_ones_and_the_closest(
    workload_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["simulate", str(workload_file), "--sweep", "u_lo=0.1"], capsys)
    assert code == 2
    assert "'u_lo' (did you mean u_low?)" in err
    assert "valid keys: u_low, t_window, " in err and "SECTION.FIELD" in err
    assert "scheduler" in err and "seed" in err

    code, _, err = run(["simulate", str(workload_file), "--sweep", "scheduler.util_lo=1"], capsys)
    assert code == 2 and "(did you mean scheduler.util_low?)" in err
    assert "valid fields of [scheduler]: " in err and "donor_window_s" in err

    code, _, err = run(["simulate", str(workload_file), "--sweep", "tp=1,2"], capsys)
    assert code == 2 and "rollout.tp or inference.tp or trainer.tp" in err

    code, _, err = run(["simulate", str(workload_file), "--sweep", "u_low"], capsys)
    assert code == 2 and "KEY=V1,V2,..." in err


def test_the_sweep_keys_the_cli_accepts_are_the_simulators() -> None:
    from dynarl.sim._workload_file import SWEEP_ALIASES

    assert simulate_cli._SWEEP_ALIASES == SWEEP_ALIASES
    workload = small()
    top, sections = simulate_cli._workload_keys()
    for key in top:
        with_overrides(workload, {key: getattr(workload, key)})
    for section, names in sections.items():
        current = getattr(workload, section)
        if current is None:  # agentic, in a math workload
            continue
        for name in names:
            with_overrides(workload, {f"{section}.{name}": getattr(current, name)})
    assert (
        simulate_cli._sweep_key_problem("u_low")
        == simulate_cli._sweep_key_problem("t_window")
        == ""
    )
    assert simulate_cli._sweep_key_problem("scheduler.min_move_interval_s") == ""
    assert simulate_cli._sweep_key_problem("notes")  # free text, not a setting


def test_a_mistyped_command_or_choice_gets_the_closest_valid_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(["simulat", "w.toml"], capsys)
    assert code == 2 and "(did you mean simulate?)" in err and "'keys'" in err
    code, _, err = run(["demo", "--task", "tool_cal"], capsys)
    assert code == 2 and "(did you mean tool_calc?)" in err and "'chain_sum'" in err
