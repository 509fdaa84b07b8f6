"""``bench/priority.py``'s second run set: the policies with the scheduler on (issue 20).

The first set holds the allocation fixed (one engine, the scheduler observing only), so
that device moves do not confound request order. Here the scheduler acts. The job has two
devices, each with a pressure server pinned to its own core, and two components that
attach to both servers:

- ``rollout`` (:class:`EngineRollout`, device 0) replays the trace, its queue ordered by
  the policy under test;
- ``inference`` (:class:`EngineInference`, device 1) scores each episode's whole context
  as the episode ends (a reference model's log-probs), and the iteration ends with the
  last score.

The scorer idles until episodes end. The policy runs leave the dataflow undeclared (the
scheduler does not know the scorer is fed by the rollout), so that devices move: after
the donor window the scheduler lends the scorer's device to the rollout, which then
drains two engines. Once scores queue up and the scorer has no device, the scheduler
takes a device back, draining a rollout engine: its requests are aborted and continued
on the other engine. The replay tells the scheduler what is left
(``Job.set_remaining``): the rollout's turns, those still to come included, and the
scores handed to the scorer and not yet back.

``declared`` is the FIFO run with the dataflow declared (the scorer's
``ComponentSpec.inputs`` names the rollout): the scheduler then keeps the scorer's one
device while the rollout has turns left, what a job that states its pipeline gets.

The predictor's offline profiles come from a **fixed** run of the same job before the
rounds, with the scheduler observing only: the rollout's turns per second on its one
device (``items_per_device``: the engine's ``max_num_seqs``) and the scorer's episodes
per second of busy time. ``fixed`` and ``declared`` are runs of every round too, so the
set reports what reallocation itself gave (``reallocation_gain``: fixed over FIFO with the
scheduler on; ``declared_gain``: declared over FIFO) next to what each policy gives over
FIFO, all paired by round (``paired_gain``) and against this set's own A/A noise.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _priority_engines import Engine

from dynarl.backends.serving import EngineInference, EngineRollout, EngineSetup
from dynarl.bus import DecisionRecord, MigrationRecord
from dynarl.demo._agent_replay import ReplayReport, replay_trace
from dynarl.runtime import ComponentSpec, Job, JobConfig, RuntimeConfig
from dynarl.sched import (
    ComponentProfile,
    FifoPolicy,
    ProfilePoint,
    RequestPolicy,
    SchedulerConfig,
)
from dynarl.sim import IterationTrace

__all__ = ["MovingRun", "Profiles", "moving_runs", "moving_summary", "wait_figures"]

FIXED = "fixed"
"""The run that keeps the allocation: rollout on device 0, the scorer on device 1."""
DECLARED = "declared"
"""The FIFO run with the scheduler on and the scorer's input declared."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Profiles:
    """The predictor's offline profiles, measured on the fixed run."""

    rollout_turns_per_s: float
    """Turns per second of the rollout on its one device."""
    scores_per_s: float
    """Episodes scored per second of the scorer's busy time."""
    items_per_device: int
    """Requests one rollout engine runs at once."""

    def components(self) -> dict[str, ComponentProfile]:
        return {
            "rollout": ComponentProfile(
                points=(ProfilePoint(num_devices=1, throughput=self.rollout_turns_per_s),),
                items_per_device=float(self.items_per_device),
            ),
            "inference": ComponentProfile(
                points=(ProfilePoint(num_devices=1, throughput=self.scores_per_s),),
            ),
        }

    @staticmethod
    def measured(report: ReplayReport, items_per_device: int) -> Profiles:
        """From a fixed run's replay; ValueError if it served or scored nothing."""
        if not report.turns or report.rollout_s <= 0 or report.score_busy_s <= 0:
            raise ValueError("the fixed run served or scored nothing: no profile to fit")
        return Profiles(
            rollout_turns_per_s=len(report.turns) / report.rollout_s,
            scores_per_s=len(report.score_spans) / report.score_busy_s,
            items_per_device=items_per_device,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MovingRun:
    """One replay with the scheduler on (or, for ``fixed``, observing)."""

    report: ReplayReport
    moves: int
    """Committed decisions."""
    migrations: int
    """Committed migrations (a move is one per component it changes)."""
    rolled_back: int
    """Migrations undone."""
    turns_on_lent_device: int
    """Turns the rollout served on device 1 (the scorer's, lent to it)."""
    max_overtakes: int

    def figures(self) -> dict[str, Any]:
        return {
            "iteration_s": round(self.report.wall_s, 3),
            "rollout_s": round(self.report.rollout_s, 3),
            "hit_rate": round(self.report.hit_rate, 4),
            "reprefill_tokens": self.report.reprefill_tokens,
            "moves": self.moves,
            "migrations": self.migrations,
            "rolled_back": self.rolled_back,
            "turns_on_lent_device": self.turns_on_lent_device,
            "max_overtakes": self.max_overtakes,
            **wait_figures(self.report),
        }


def wait_figures(report: ReplayReport) -> dict[str, float]:
    """Median, 99th percentile and largest wait (submission to output) of a replay's turns."""
    waits = sorted(report.waits_s)
    return {
        "wait_p50_s": round(statistics.median(waits), 3),
        "wait_p99_s": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 3),
        "wait_max_s": round(waits[-1], 3),
    }


def round_walls(runs: Mapping[str, Sequence[Any]]) -> dict[str, list[float]]:
    """Run name → its iteration times in round order (``runs``' items have ``.report``)."""
    return {name: [r.report.wall_s for r in values] for name, values in runs.items()}


def aa_differences(walls: Mapping[str, Sequence[float]]) -> list[float]:
    """The two FIFO runs' relative difference in each round."""
    return [
        abs(a - b) / ((a + b) / 2) for a, b in zip(walls["fifo"], walls["fifo-aa"], strict=True)
    ]


def aa_noise(walls: Mapping[str, Sequence[float]]) -> float:
    """The noise floor a gain must clear: the A/A spread, the largest relative difference of
    the two FIFO runs over the rounds.

    Not their median: on two SGLang runs of the same code the median was 4.3% and 1.3%, and
    DynaRL's key's paired gain, +6.0% and −4.8%, cleared it both times with opposite signs;
    the second run's pairs differed by 0.0–23.3% round to round.
    """
    return max(aa_differences(walls))


def paired_gain(walls: Mapping[str, Sequence[float]], slower: str, faster: str) -> float:
    """How much faster ``faster`` ran than ``slower``, paired by round: the median over
    rounds of ``slower``'s time over ``faster``'s, less one.

    A round runs every name back to back, so a host that slows down between rounds slows
    both sides of each ratio. The ratio of the medians would not cancel it: on one SGLang
    run FIFO took 12.9 s in round 1 and 19.2 s in round 5, and DynaRL's key, which ran
    first in round 3 before that round slowed, showed +23.5% that way against +6.0% paired.
    """
    return statistics.median(s / f - 1.0 for s, f in zip(walls[slower], walls[faster], strict=True))


@contextlib.asynccontextmanager
async def two_servers(
    engine: Callable[[int], Engine], model: Path, work: Path, kv: int, seqs: int, max_len: int
) -> AsyncIterator[dict[str, str]]:
    """Two pressure servers, device ``d``'s pinned to core ``d``: device → URL."""
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for device in (0, 1):
            serve = engine(device).serve(model, work / f"server{device}", kv, seqs, max_len)
            urls[str(device)] = await stack.enter_async_context(serve)
        yield urls


def moving_job(
    urls: Mapping[str, str],
    work: Path,
    policy: RequestPolicy,
    *,
    engine: Engine,
    kv: int,
    seqs: int,
    max_overtakes: int,
    profiles: Profiles | None,
    declared: bool = False,
) -> Job:
    """The two-device job on ``urls``; the scheduler acts when ``profiles`` are given, and
    knows the scorer is fed by the rollout when ``declared``."""
    shared = EngineSetup(
        kind=engine.kind, urls=dict(urls), max_num_seqs=seqs, ignore_eos=True
    ).to_options()
    known = profiles.components() if profiles is not None else {}
    specs = [
        ComponentSpec(
            role=EngineRollout, devices=(0,), options=shared, max_inflight=seqs,
            request_policy=policy, max_overtakes=max_overtakes,
            prefix_cache=engine.prefix_cache(kv), profile=known.get("rollout"), min_devices=1,
        ),
        ComponentSpec(
            role=EngineInference, devices=(1,), options=shared, max_inflight=seqs,
            profile=known.get("inference"), min_devices=0,
            inputs=("rollout",) if declared else (),
        ),
    ]  # fmt: skip
    scheduler = SchedulerConfig(observe_only=profiles is None)
    runtime = RuntimeConfig(scheduler=scheduler)
    return Job(specs, JobConfig(num_devices=2, run_dir=str(work), runtime=runtime))


async def replay_moving(
    urls: Mapping[str, str],
    work: Path,
    policy: RequestPolicy,
    it: IterationTrace,
    *,
    engine: Engine,
    kv: int,
    seqs: int,
    vocab: int,
    max_overtakes: int,
    profiles: Profiles | None,
    declared: bool = False,
) -> MovingRun:
    """One replay on a fresh two-device job, both prefix caches reset first."""
    for url in urls.values():
        await engine.reset_cache(url)
    job = moving_job(
        urls, work, policy, engine=engine, kv=kv, seqs=seqs, max_overtakes=max_overtakes,
        profiles=profiles, declared=declared,
    )  # fmt: skip
    async with job:
        report = await replay_trace(job, it, vocab=vocab, score="inference")
        dispatcher = job.controller.manager("rollout").dispatcher
        assert dispatcher is not None
        records = list(job.ledger)
    return MovingRun(
        report=report,
        moves=sum(isinstance(r, DecisionRecord) and r.committed for r in records),
        migrations=sum(
            isinstance(r, MigrationRecord) and r.outcome == "committed" for r in records
        ),
        rolled_back=sum(
            isinstance(r, MigrationRecord) and r.outcome == "rolled_back" for r in records
        ),
        turns_on_lent_device=sum(t.device == 1 for t in report.turns),
        max_overtakes=dispatcher.router.max_overtakes_seen,
    )


async def moving_runs(
    engine: Callable[[int], Engine],
    model: Path,
    work: Path,
    it: IterationTrace,
    *,
    policies: Mapping[str, RequestPolicy],
    reps: int,
    kv: int,
    seqs: int,
    max_len: int,
    vocab: int,
    max_overtakes: int,
) -> tuple[Profiles, dict[str, list[MovingRun]]]:
    """The fixed run that gives the profiles, then ``reps`` rounds of ``fixed``,
    ``declared`` and every policy with the scheduler on, the order rotated every round."""
    runs: dict[str, list[MovingRun]] = {FIXED: [], DECLARED: [], **{n: [] for n in policies}}
    names = list(runs)
    async with two_servers(engine, model, work, kv, seqs, max_len) as urls:
        kind = engine(0)
        common = dict(engine=kind, kv=kv, seqs=seqs, vocab=vocab, max_overtakes=max_overtakes)
        first = await replay_moving(
            urls, work / "profile", FifoPolicy(), it, profiles=None, **common
        )
        profiles = Profiles.measured(first.report, seqs)
        print(f"scheduler on: profiles {profiles}", flush=True)
        for rep in range(reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                policy = policies.get(name, FifoPolicy())
                run = await replay_moving(
                    urls, work / f"on-{name}-{rep}", policy, it,
                    profiles=None if name == FIXED else profiles, declared=name == DECLARED,
                    **common,
                )  # fmt: skip
                runs[name].append(run)
                print(
                    f"scheduler on, round {rep + 1} {name:>8}: {run.report.wall_s:.2f} s, "
                    f"{run.moves} moves",
                    flush=True,
                )
    return profiles, runs


def moving_summary(
    profiles: Profiles,
    runs: Mapping[str, Sequence[MovingRun]],
    summary: Callable[[list[dict[str, Any]]], dict[str, Any]],
    max_overtakes: int,
) -> dict[str, Any]:
    """The set's figures: per run name medians and spreads, the A/A noise, every policy's
    gain over FIFO and reallocation's (fixed over FIFO, both FIFO-ordered)."""
    policies = {name: summary([r.figures() for r in values]) for name, values in runs.items()}
    walls = round_walls(runs)
    noise = aa_noise(walls)
    gains = {
        name: paired_gain(walls, "fifo", name) for name in runs if name not in (FIXED, DECLARED)
    }
    for name, p in policies.items():
        print(
            f"on {name:>8}: iteration {p['iteration_s']:.2f} s {p['iteration_s_spread']}  "
            f"hit {p['hit_rate']:.3f}  moves {p['moves']:.0f}  "
            f"lent-device turns {p['turns_on_lent_device']:.0f}  wait p99 {p['wait_p99_s']:.2f} s"
        )
    return {
        "profiles": {
            "rollout_turns_per_s": round(profiles.rollout_turns_per_s, 3),
            "scores_per_s": round(profiles.scores_per_s, 3),
        },
        "policies": policies,
        "aa_noise": round(noise, 4),
        "aa_noise_median": round(statistics.median(aa_differences(walls)), 4),
        "gains_over_fifo": {k: round(v, 4) for k, v in gains.items()},
        "priority_gain_over_fifo": round(gains["dynarl"], 4),
        "priority_gain_above_noise": abs(gains["dynarl"]) > noise,
        "reallocation_gain": round(paired_gain(walls, FIXED, "fifo"), 4),
        "declared_gain": round(paired_gain(walls, "fifo", DECLARED), 4),
        "overtakes_within_bound": all(
            r.max_overtakes <= max_overtakes for v in runs.values() for r in v
        ),
    }
