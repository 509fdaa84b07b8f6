"""Hypothesis strategies for property-testing pipelines and policies built on dynarl.

Re-exported by :mod:`dynarl.testing`. Every strategy draws *valid* values — the kind a
running job produces — so a property fails on a bug in the code under test, not on
nonsense input:

- :func:`pipelines`: a rollout and a trainer, and optionally inference, reward and tool
  components, as the scheduler's :class:`~dynarl.sched.HyperNode` s;
- :func:`allocations`: an :class:`~dynarl.Allocation` of a job's devices that respects
  every component's bounds and unit;
- :func:`component_reports` and :func:`report_rounds`: reports of one component, and
  rounds of reports of every component with increasing times (what a scheduler reads);
- :func:`queued_requests`: requests waiting in an engine (for a request policy);
- :func:`schedule_contexts`: what a hybrid policy sees at a step;
- :func:`layouts`: trainer state layouts (TP, PP, DP, distributed optimizer) of a small
  GPT-shaped model;
- :func:`workloads`: small simulator workloads (math or agentic) that run in milliseconds.

Needs hypothesis (the ``dev`` extra), imported on first use. Runs anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dynarl.bus import ComponentReport
from dynarl.migrate import Layout, LayoutSpec, ParamSpec, Stage, trainer_layout
from dynarl.sched import DynamicScheduleContext, HyperNode, QueuedRequest
from dynarl.sim import Workload, workload_from_dict
from dynarl.types import Allocation, ComponentKind, MigrationKind

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = [
    "allocations",
    "component_reports",
    "layouts",
    "pipelines",
    "queued_requests",
    "report_rounds",
    "schedule_contexts",
    "workloads",
]


def pipelines(*, max_extra: int = 2) -> SearchStrategy[dict[str, HyperNode]]:
    """``{name: HyperNode}``: ``rollout`` and ``trainer`` (P2P, TP 1 or 2), plus up to
    ``max_extra`` of ``inference``, ``reward`` and ``tool``."""
    from hypothesis import strategies as st

    extras = st.lists(
        st.sampled_from(["inference", "reward", "tool"]), unique=True, max_size=max_extra
    )
    kinds = {
        "inference": ComponentKind.INFERENCE,
        "reward": ComponentKind.REWARD,
        "tool": ComponentKind.TOOL,
    }

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, HyperNode]:
        tp = draw(st.sampled_from([1, 2]))
        nodes = {
            "rollout": HyperNode(
                name="rollout", kind=ComponentKind.ROLLOUT, min_devices=draw(st.integers(0, 2))
            ),
            "trainer": HyperNode(
                name="trainer",
                kind=ComponentKind.TRAINER,
                migration=MigrationKind.P2P,
                tp=tp,
                min_devices=tp,
                state_bytes=draw(st.integers(0, 1 << 30)),
                sharded_state_fraction=draw(st.sampled_from([0.0, 0.75])),
            ),
        }
        for name in draw(extras):
            nodes[name] = HyperNode(
                name=name,
                kind=kinds[name],
                interruptible=draw(st.booleans()),
                max_devices=draw(st.none() | st.integers(1, 8)),
            )
        return nodes

    strategy: SearchStrategy[dict[str, HyperNode]] = build()
    return strategy


def allocations(nodes: dict[str, HyperNode], num_devices: int) -> SearchStrategy[Allocation]:
    """Allocations of devices ``0 .. num_devices - 1`` (some possibly free) in which every
    component holds a valid size; raises ValueError when ``num_devices`` cannot cover the
    components' minimums."""
    from hypothesis import strategies as st

    minimum = sum(n.min_devices for n in nodes.values())
    if minimum > num_devices:
        raise ValueError(f"{num_devices} devices cannot cover the minimums ({minimum})")

    @st.composite
    def build(draw: st.DrawFn) -> Allocation:
        order = draw(st.permutations(range(num_devices)))
        left = num_devices - minimum
        mapping: dict[str, list[int]] = {}
        taken = 0
        for name, node in sorted(nodes.items()):
            high = node.min_devices + left
            if node.max_devices is not None:
                high = min(high, node.max_devices)
            sizes = [s for s in range(node.min_devices, high + 1) if node.is_valid_size(s)]
            size = draw(st.sampled_from(sizes))
            left -= size - node.min_devices
            mapping[name] = sorted(order[taken : taken + size])
            taken += size
        return Allocation.of(mapping)

    strategy: SearchStrategy[Allocation] = build()
    return strategy


def component_reports(
    component: str = "rollout",
    *,
    kind: str | None = None,
    num_workers: int | None = None,
    time: float | None = None,
    iteration: int = 0,
) -> SearchStrategy[ComponentReport]:
    """Reports of ``component`` (kind: its name when that is a ComponentKind value);
    utilization in [0, 1] per worker, non-negative counts and throughput."""
    from hypothesis import strategies as st

    workers = st.just(num_workers) if num_workers is not None else st.integers(1, 8)
    return st.builds(
        _report,
        component=st.just(component),
        kind=st.just(kind or _kind_of(component)),
        utilization=workers.flatmap(
            lambda n: st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n).map(tuple)
        ),
        time=st.just(time) if time is not None else st.floats(0.0, 1e6),
        queue_depth=st.integers(0, 10_000),
        throughput=st.floats(0.0, 1e5),
        completed=st.integers(0, 10_000),
        remaining=st.integers(0, 10_000),
        interruptible=st.booleans(),
        iteration=st.just(iteration),
    )


def _kind_of(component: str) -> str:
    values = {k.value for k in ComponentKind}
    return component if component in values else ComponentKind.ROLLOUT.value


def _report(**fields: Any) -> ComponentReport:
    return ComponentReport(interval_s=1.0, **fields)


def report_rounds(
    allocation: Allocation,
    nodes: dict[str, HyperNode],
    *,
    num_rounds: int = 8,
    interval_s: float = 1.0,
) -> SearchStrategy[list[list[ComponentReport]]]:
    """``num_rounds`` rounds, each one report per component of ``nodes`` at times
    ``interval_s, 2·interval_s, …``, with one utilization per worker of ``allocation``
    (a worker is one TP group)."""
    from hypothesis import strategies as st

    rounds = [
        st.tuples(
            *[
                component_reports(
                    name,
                    kind=nodes[name].kind.value,
                    num_workers=allocation.count(name) // nodes[name].tp,
                    time=interval_s * (i + 1),
                )
                for name in sorted(nodes)
            ]
        ).map(list)
        for i in range(num_rounds)
    ]
    strategy: SearchStrategy[list[list[ComponentReport]]] = st.tuples(*rounds).map(list)
    return strategy


def queued_requests(*, max_size: int = 32) -> SearchStrategy[list[QueuedRequest]]:
    """Requests with unique ids (``r0``, ``r1``, …), tool calls, cached prefixes and
    attained service drawn independently."""
    from hypothesis import strategies as st

    one = st.tuples(st.integers(0, 8), st.integers(0, 4096), st.floats(0.0, 1e5))
    return st.lists(one, max_size=max_size).map(
        lambda rows: [
            QueuedRequest(request_id=f"r{i}", tool_calls=k, cached_prefix=m, attained_service=a)
            for i, (k, m, a) in enumerate(rows)
        ]
    )


def schedule_contexts() -> SearchStrategy[DynamicScheduleContext]:
    """What a hybrid policy sees at one step: sizes, generated samples, wait times."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: st.DrawFn) -> DynamicScheduleContext:
        steps = draw(st.integers(1, 4))
        waits = draw(st.lists(st.floats(0.0, 600.0), max_size=steps))
        return DynamicScheduleContext(
            required_samples=draw(st.integers(0, 512)),
            trigger_parameter_sync_step=steps,
            total_generated_samples=draw(st.integers(0, 1 << 20)),
            expected_samples=draw(st.integers(0, 1 << 20)),
            buffer_samples=draw(st.floats(0.0, 1e4)),
            step_wait_times=tuple(waits),
            step_wait_samples=tuple(draw(st.integers(0, 512)) for _ in waits),
            only_hybrid=draw(st.booleans()),
            last_activate_duration_s=draw(st.floats(0.0, 60.0)),
            last_deactivate_duration_s=draw(st.floats(0.0, 60.0)),
        )

    strategy: SearchStrategy[DynamicScheduleContext] = build()
    return strategy


def _gpt(hidden: int, layers: int, vocab: int) -> list[ParamSpec]:
    params = [ParamSpec(name="embedding", shape=(vocab, hidden), tp_dim=0, stage=Stage.FIRST)]
    for n in range(layers):
        params += [
            ParamSpec(name=f"layers.{n}.qkv", shape=(3 * hidden, hidden), tp_dim=0, layer=n),
            ParamSpec(name=f"layers.{n}.proj", shape=(hidden, hidden), tp_dim=1, layer=n),
            ParamSpec(name=f"layers.{n}.norm", shape=(hidden,), layer=n),
        ]
    params.append(ParamSpec(name="output", shape=(vocab, hidden), tp_dim=0, stage=Stage.LAST))
    return params


def layouts(*, num_ranks: int = 8) -> SearchStrategy[Layout]:
    """Layouts of a small GPT-shaped trainer on at most ``num_ranks`` of ranks
    ``0 .. num_ranks - 1``: TP, PP and DP in {1, 2, 4}, with or without the distributed
    optimizer, ranks in any order."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: st.DrawFn) -> Layout:
        layers = draw(st.sampled_from([1, 2, 4]))
        params = _gpt(draw(st.sampled_from([8, 16])), layers, draw(st.sampled_from([16, 32])))
        tp = draw(st.sampled_from([d for d in (1, 2, 4) if d <= num_ranks]))
        pp = draw(
            st.sampled_from([d for d in (1, 2, 4) if layers % d == 0 and tp * d <= num_ranks])
        )
        dp = draw(st.sampled_from([d for d in (1, 2, 4) if tp * pp * d <= num_ranks]))
        ranks = draw(st.permutations(range(num_ranks)))[: tp * pp * dp]
        spec = LayoutSpec(
            ranks=tuple(ranks), tp=tp, pp=pp, dp=dp, distributed_optimizer=draw(st.booleans())
        )
        return trainer_layout(params, spec)

    strategy: SearchStrategy[Layout] = build()
    return strategy


def workloads(*, kinds: Sequence[str] = ("math", "agentic")) -> SearchStrategy[Workload]:
    """Small workloads (8–32 GPUs, a few dozen prompts, short outputs, two iterations)
    that the simulator runs in well under a second."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: st.DrawFn) -> Workload:
        kind = draw(st.sampled_from(list(kinds)))
        data = _small_workload(
            kind=kind,
            seed=draw(st.integers(0, 2**31 - 1)),
            num_gpus=draw(st.sampled_from([8, 16, 32])),
            num_prompts=draw(st.sampled_from([8, 16, 32])),
            output_median=draw(st.floats(100.0, 800.0)),
            trainer_tp=draw(st.sampled_from([1, 2])),
        )
        return workload_from_dict(data)

    strategy: SearchStrategy[Workload] = build()
    return strategy


def _small_workload(
    *, kind: str, seed: int, num_gpus: int, num_prompts: int, output_median: float, trainer_tp: int
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": f"small-{kind}",
        "kind": kind,
        "seed": seed,
        "num_iterations": 2,
        "num_warmup_iterations": 1,
        "cluster": {"num_gpus": num_gpus, "num_gpus_per_node": 8, "gpu_memory_gib": 80.0},
        "model": {
            "name": "small",
            "num_params": 1.5e9,
            "num_layers": 28,
            "hidden_size": 1536,
            "kv_bytes_per_token": 28672,
        },
        "batch": {
            "num_prompts": num_prompts,
            "group_size": 4,
            "num_minibatches": 2,
            "max_seq_len": 8192,
        },
        "lengths": {
            "prompt_median": 150.0,
            "prompt_sigma": 0.5,
            "output_median": output_median,
            "output_sigma": 0.5,
        },
        "rollout": {
            "tp": 1,
            "kv_capacity_tokens": 60_000,
            "max_running_requests": 64,
            "step_fixed_s": 0.007,
            "step_per_seq_s": 7e-6,
            "step_per_kv_token_s": 1.2e-8,
            "prefill_tokens_per_s": 140_000.0,
        },
        "inference": {"tp": 1, "tokens_per_s_per_gpu": 4000.0, "scaling_exponent": 1.0},
        "trainer": {
            "tp": trainer_tp,
            "tokens_per_s_per_gpu": 1000.0,
            "scaling_exponent": 1.0,
            "min_gpus": trainer_tp,
        },
        "migration": {
            "workload_s": 0.5,
            "p2p_s": 0.2,
            "reboot_s": 5.0,
            "phase_switch_s": 0.5,
            "weight_sync_s": 0.5,
        },
        "scheduler": {"min_move_interval_s": 2.0},
    }
    if kind == "agentic":
        data["agentic"] = {
            "mean_tool_calls": 2.0,
            "max_tool_calls": 4,
            "turn_decay": 0.7,
            "tool_latency_median_s": 1.0,
            "tool_latency_sigma": 0.5,
            "tool_timeout_s": 10.0,
            "observation_median": 100.0,
            "observation_sigma": 0.5,
        }
    return data
