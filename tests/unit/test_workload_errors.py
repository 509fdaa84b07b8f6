"""A bad workload file is refused with a message that names the table and key as the file
spells them and the values involved; an impossible workload is refused with its reason."""

from __future__ import annotations

import copy
import math
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sim_support import WORKLOADS, shipped

from dynarl.sim import load_workload, with_overrides, workload_from_dict

Data = dict[str, Any]


def _data() -> Data:
    return tomllib.loads((WORKLOADS / "agentic-7b-64gpu.toml").read_text(encoding="utf-8"))


def _set(**changes: Any) -> Callable[[Data], None]:
    """Set ``table__key=value`` (or a top-level ``key=value``)."""

    def apply(data: Data) -> None:
        for name, value in changes.items():
            table, _, key = name.rpartition("__")
            (data[table] if table else data)[key] = value

    return apply


def _rename(old: str, new: str) -> Callable[[Data], None]:
    return lambda data: data.update({new: data.pop(old)})


def _delete(table: str, key: str) -> Callable[[Data], None]:
    return lambda data: data[table].pop(key)


CASES = {
    "a stage's min_gpus names its table and both values": (
        _set(trainer__min_gpus=6),
        "[trainer] min_gpus = 6 must be a multiple of [trainer] tp = 4",
    ),
    "a stage's range error names its table": (
        _set(inference__scaling_exponent=-1.0),
        "[inference] scaling_exponent = -1.0 must be a positive number",
    ),
    "a negative seed": (_set(seed=-1), "seed = -1 must be >= 0"),
    "the warm-up count shows both values": (
        _set(num_warmup_iterations=3),
        "num_warmup_iterations = 3 must be below num_iterations = 3",
    ),
    "an unknown table gets the closest one": (
        _rename("migration", "migrations"),
        "unknown top-level key 'migrations' (did you mean [migration]?)",
    ),
    "an unknown key gets the closest one": (
        _set(rollout__kv_capacity=1),
        "[rollout] has unknown key 'kv_capacity' (did you mean kv_capacity_tokens?)",
    ),
    "a key in the wrong table says where it belongs": (
        _set(cluster__tp=2),
        "[cluster] has unknown key 'tp' (a key of [rollout], [inference], [trainer])",
    ),
    "a missing key is named": (_delete("rollout", "tp"), "[rollout] is missing tp"),
    "scheduler keys are named as in the file": (
        _set(scheduler__util_low=2.0),
        "[scheduler] util_low = 2.0 must be in [0.0, 1.0]",
    ),
    "a scheduler relation is named as in the file": (
        _set(scheduler__stats_window_s=2.0),
        "[scheduler] stats_window_s = 2.0 must cover [scheduler] donor_window_s = 4.0",
    ),
    "an integer key refuses a fraction": (
        _set(cluster__num_gpus=64.5),
        "[cluster] num_gpus = 64.5 must be an integer",
    ),
    "a boolean key refuses a string": (
        _set(trainer__parkable="yes"),
        "[trainer] parkable = 'yes' must be true or false",
    ),
    "max_seq_len below the prompt clip": (
        _set(batch__max_seq_len=10),
        "[batch] max_seq_len = 10 is too short for [lengths] prompt_median = 150.0",
    ),
    "a TP size above a node": (
        _set(trainer__tp=16, trainer__min_gpus=16),
        "[trainer] tp = 16 exceeds [cluster] num_gpus_per_node = 8",
    ),
    "a TP size above the cluster": (
        _set(cluster__num_gpus=8, trainer__tp=16, trainer__min_gpus=16),
        "[trainer] tp = 16 exceeds the cluster's [cluster] num_gpus = 8",
    ),
    "a TP size that does not tile a node": (
        _set(rollout__tp=3),
        "[rollout] tp = 3 must divide [cluster] num_gpus_per_node = 8",
    ),
    "minimums past the cluster": (
        _set(trainer__min_gpus=64),
        "the components' minimums need 70 GPUs side by side, more than [cluster] num_gpus = 64",
    ),
    "a KV cache smaller than one sequence": (
        _set(rollout__kv_capacity_tokens=20_000),
        "[rollout] kv_capacity_tokens = 20000 cannot hold one sequence of "
        "[batch] max_seq_len = 28672",
    ),
    "a rollout engine past the GPU's memory": (
        _set(rollout__kv_capacity_tokens=10_000_000),
        "a rollout engine needs 274.1 GiB a GPU",
    ),
    "the trainer's state past the GPU's memory": (
        _set(model__state_bytes_per_param=64.0),
        "the trainer's state needs 113.5 GiB a GPU on its smallest size, 4 GPUs",
    ),
    "mini-batches of whole groups": (
        _set(batch__num_minibatches=3),
        "[batch] num_prompts = 512 must be a multiple of [batch] num_minibatches = 3",
    ),
    "only inference is fused": (
        _set(trainer__tokens_per_s_per_gpu=math.inf, trainer__min_gpus=0),
        "[trainer] tokens_per_s_per_gpu = inf: only [inference] may be fused",
    ),
    "only the trainer parks": (
        _set(inference__parkable=True),
        "[inference] parkable = true: only the trainer parks",
    ),
    "the scheduler plans on the cluster's nodes": (
        _set(scheduler__num_devices_per_node=4),
        "[scheduler] num_devices_per_node = 4 must equal [cluster] num_gpus_per_node = 8",
    ),
    "a math workload has no [agentic] table": (
        _set(kind="math"),
        "kind = 'math' takes no [agentic] table",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_workload_is_refused_naming_its_keys_and_values(case: str) -> None:
    change, message = CASES[case]
    data = copy.deepcopy(_data())
    change(data)
    with pytest.raises(ValueError, match=re.escape(message)):
        workload_from_dict(data)


def test_the_file_path_leads_the_message(tmp_path: Path) -> None:
    text = (WORKLOADS / "agentic-7b-64gpu.toml").read_text(encoding="utf-8")
    path = tmp_path / "bad.toml"
    path.write_text(text.replace("max_seq_len = 28672", "max_seq_len = 10"), encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}: [batch] max_seq_len = 10 ")):
        load_workload(path)


def test_the_scheduler_takes_the_clusters_nodes_and_memory_by_default() -> None:
    data = _data()
    data["cluster"].update(num_gpus=32, num_gpus_per_node=4, gpu_memory_gib=141.0)
    for key in ("num_devices_per_node", "device_memory_bytes"):
        del data["scheduler"][key]
    workload = workload_from_dict(data)
    assert workload.scheduler.num_devices_per_node == 4
    assert workload.scheduler.device_memory_bytes == 141 << 30


def test_overrides_name_keys_as_the_file_and_check_the_rules_once() -> None:
    workload = shipped("agentic-7b-64gpu")
    with pytest.raises(ValueError, match=re.escape("[scheduler] util_low = 2.0 must be in")):
        with_overrides(workload, {"u_low": 2.0})
    with pytest.raises(ValueError, match=re.escape("[cluster] num_gpus = 64.5 must be an")):
        with_overrides(workload, {"cluster.num_gpus": 64.5})
    # The KV change alone breaks a rule; with the shorter sequences it is a valid workload.
    both = {"rollout.kv_capacity_tokens": 25_000, "batch.max_seq_len": 20_000}
    with pytest.raises(ValueError, match="kv_capacity_tokens = 1743861"):
        with_overrides(workload, {"batch.max_seq_len": 2_000_000})
    assert with_overrides(workload, both).rollout.kv_capacity_tokens == 25_000
    # The scheduler follows the cluster's node size.
    smaller = with_overrides(workload, {"cluster.num_gpus_per_node": 4})
    assert smaller.scheduler.num_devices_per_node == 4
