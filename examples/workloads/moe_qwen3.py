"""Derive the mixture-of-experts workload (Qwen3-30B-A3B, math GRPO, 64 GPUs) from facts.

Every number of ``examples/workloads/moe/math-qwen3-30b-a3b-64gpu.toml`` comes from
:func:`derive`, which uses only the MOE_FACTS below (the model's published config and card,
a published training layout and throughput), the ASSUMPTIONS B1–B10 (stated with why), and
the shipped workloads' FACTS, ASSUMPTIONS and FITTED values in ``calibrate.py`` (the DynaRL
paper's batch, lengths, testbed and migration figures). The file carries, above each key,
the fact or assumption it comes from (:func:`sources`).

The trainer's P2P reshard is an expert-parallel one: :func:`busiest_receive_bytes` asks
``dynarl.migrate``'s planner (``plan_reshard`` over ``trainer_layout``) how many bytes the
busiest receiving GPU takes in when the trainer grows by one replica from its minimum, for
this model under its EP layout and for the paper's dense 32B model; B7 scales the paper's
32B trainer migration time (F6) by their ratio.

Run ``.venv/bin/python examples/workloads/moe_qwen3.py`` to rewrite the file, ``--check``
to fail if the file on disk differs from what :func:`derive` gives, ``--full-plan`` to
also plan the 48-layer reshard (tens of seconds) and compare it with the extrapolation.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import calibrate

from dynarl.migrate import LayoutSpec, ParamSpec, Stage, plan_reshard, trainer_layout
from dynarl.sched import SchedulerConfig
from dynarl.sim import (
    BatchSpec,
    ClusterSpec,
    LengthSpec,
    ModelSpec,
    RolloutSpec,
    StageSpec,
    VerlSpec,
    Workload,
    dump_workload,
)

HERE = Path(__file__).resolve().parent
PATH = HERE / "moe" / "math-qwen3-30b-a3b-64gpu.toml"

MOE_FACTS = {
    "Q1": (
        {
            "layers": 48,
            "hidden": 2048,
            "heads": 32,
            "kv_heads": 4,
            "head_dim": 128,
            "experts": 128,
            "top_k": 8,
            "expert_ffn": 768,
            "vocab": 151936,
        },
        "Qwen/Qwen3-30B-A3B config.json: num_hidden_layers, hidden_size, num_attention_heads, "
        "num_key_value_heads, head_dim, num_experts, num_experts_per_tok, "
        "moe_intermediate_size, vocab_size; every layer MoE (decoder_sparse_step 1, no "
        "mlp_only_layers), no shared expert, untied embeddings, qk-norm, no biases",
    ),
    "Q2": ((30.5e9, 3.3e9), "model card: 30.5B parameters in total, 3.3B activated"),
    "Q3": (
        {"tp": 4, "pp": 1, "ep": 8, "etp": 1},
        "slime's Megatron layout for Qwen3-30B-A3B (docs/en/models/qwen3-30B-A3B.md): "
        "TP 4 with sequence parallel, PP 1, CP 1, EP 8, expert TP 1",
    ),
    "Q4": (
        12_040.0,
        "NeMo AutoModel performance summary, DGX-H100 BF16 pre-training, Qwen3 MoE 30B on "
        "8 GPUs, EP 8, 4,096-token sequences: 12,040 tokens/s per GPU (277 model TFLOP/s)",
    ),
    "Q5": (
        {"layers": 64, "hidden": 5120, "heads": 40, "kv_heads": 8, "ffn": 27648, "vocab": 152064},
        "DeepSeek-R1-Distill-Qwen-32B config.json (the paper's 32B, M1): layers, hidden, "
        "heads, KV heads, intermediate_size, vocab_size; qkv biases, untied embeddings",
    ),
}

ASSUMPTIONS = {
    "B1": "Whatever is not about the model is the shipped math workloads': batch F4, the "
    "fitted lengths (FITTED; A11 extended: Qwen3-30B-A3B reasons on the same math data), "
    "H100 figures A2, decode/prefill efficiencies A3-A5, KV rule A6, running requests A7, "
    "4 mini-batches A15, verl A17, scheduler A18, iterations A19, parkable trainer A22, "
    "64 GPUs in 8-GPU nodes F9.",
    "B2": "Decode reads every expert each step: with top-8 of 128 and balanced routing, an "
    "expert is skipped by B running requests with probability (120/128)^B, 1.6% at B = 64, "
    "so the per-step weight read is all 61 GB of bf16 weights (overestimated in the tail, "
    "with few requests); per-request compute and prefill use the activated parameters.",
    "B3": "Attention FLOPs use the attention width, heads × head_dim = 4,096 (twice the "
    "hidden size; the dense models' widths equal their hidden sizes).",
    "B4": "Rollout engines use the fewest GPUs (a power of two) whose memory after A6 holds "
    "the weights and F8's 100 GB of KV: TP 4 (TP 2 leaves 85 GB); the paper's 32B, of about "
    "the same weight bytes, also uses 4 (F5).",
    "B5": "The trainer's layout is Q3. Its resize unit (the file's [trainer] tp) is the "
    "least common multiple of TP × PP = 4 and ETP × EP × PP = 8: Megatron needs the world "
    "size divisible by both. The file's state per GPU, state / 8 × share, splits the dense "
    "5% of the parameters 8 ways where TP splits them 4 ways (0.8 GB a GPU under at 16 GPUs). "
    "min_gpus by A9's rule.",
    "B6": "Q4's pre-training throughput, under A8's FLOP count (6 × activated + 12 × "
    "attention at 4,096 tokens, B3), is an MFU; RL updates run at A8's ratio of RL to "
    "pre-training MFU (25% / 40%), log-prob inference at A8's ratio of forward to update "
    "MFU (35% / 25%), on replicas of the trainer's unit. Linear in GPUs (paper §5.1).",
    "B7": "A P2P reshard's pause is proportional to the bytes its busiest receiving GPU "
    "takes in, and F6's 32B figure (2.8 s) is for the same move: one replica added at the "
    "trainer's minimum (32B: TP 8, DP 2 -> 3; this model: B5, EDP 2 -> 3; both 16 -> 24 "
    "GPUs). Bytes from dynarl.migrate's planner: bf16 parameters, fp32 master weights and "
    "Adam moments, distributed optimizer (one bucket; gradients do not move at a step "
    "boundary); planned on 1 and 2 layers and extrapolated, the layers being identical.",
    "B8": "Rollout workload migration (A12), reboot and weight sync (A13) and the stage "
    "switch (A14) follow the total parameters: what an engine loads, a reboot reads and "
    "the sync sends are all the weights.",
    "B9": "Seed 20260 + 64 + 30 (A21).",
    "B10": "dynarl limited to reboots is the same file with [migration] trainer_kind = "
    "'reboot' (examples/workloads/moe_table.py): every resize of the trainer to a non-zero "
    "size restarts it (reboot_s), unparking included; parking saves over the host links.",
}

MODEL = MOE_FACTS["Q1"][0]
LAYOUT = MOE_FACTS["Q3"][0]
GIB = calibrate.GIB


def _attention(
    prefix: str, n: int, hidden: int, heads: int, kv: int, bias: bool
) -> list[ParamSpec]:
    """Layer ``n``'s norms and attention, as Megatron registers them (Q1, Q5)."""
    d = MODEL["head_dim"]  # 128 in both models (Q5: 5,120 / 40 heads)
    qkv = (heads + 2 * kv) * d
    out = [
        ParamSpec(name=f"{prefix}{n}.input_norm", shape=(hidden,), layer=n),
        ParamSpec(name=f"{prefix}{n}.qkv.weight", shape=(qkv, hidden), tp_dim=0, layer=n),
        ParamSpec(name=f"{prefix}{n}.proj.weight", shape=(hidden, heads * d), tp_dim=1, layer=n),
        ParamSpec(name=f"{prefix}{n}.mlp_norm", shape=(hidden,), layer=n),
    ]
    if bias:
        out.append(ParamSpec(name=f"{prefix}{n}.qkv.bias", shape=(qkv,), tp_dim=0, layer=n))
    else:  # Qwen3's qk-norm
        out += [
            ParamSpec(name=f"{prefix}{n}.q_norm", shape=(d,), layer=n),
            ParamSpec(name=f"{prefix}{n}.k_norm", shape=(d,), layer=n),
        ]
    return out


def _ends(params: list[ParamSpec], vocab: int, hidden: int) -> list[ParamSpec]:
    head = [ParamSpec(name="embedding", shape=(vocab, hidden), tp_dim=0, stage=Stage.FIRST)]
    tail = [
        ParamSpec(name="final_norm", shape=(hidden,), stage=Stage.LAST),
        ParamSpec(name="output", shape=(vocab, hidden), tp_dim=0, stage=Stage.LAST),
    ]
    return head + params + tail


def moe_params(layers: int = MODEL["layers"]) -> list[ParamSpec]:
    """Qwen3-30B-A3B's parameters (Q1) with ``layers`` layers, experts fc1 = gate and up."""
    h, e, f = MODEL["hidden"], MODEL["experts"], MODEL["expert_ffn"]
    params: list[ParamSpec] = []
    for n in range(layers):
        params += _attention("layers.", n, h, MODEL["heads"], MODEL["kv_heads"], bias=False)
        params.append(ParamSpec(name=f"layers.{n}.router", shape=(e, h), layer=n))
        for x in range(e):
            head = f"layers.{n}.experts.{x}"
            params += [
                ParamSpec(name=f"{head}.fc1", shape=(2 * f, h), tp_dim=0, layer=n, expert=x),
                ParamSpec(name=f"{head}.fc2", shape=(h, f), tp_dim=1, layer=n, expert=x),
            ]
    return _ends(params, MODEL["vocab"], h)


def dense32b_params(layers: int) -> list[ParamSpec]:
    """The paper's 32B (Q5) with ``layers`` layers."""
    m = MOE_FACTS["Q5"][0]
    h, f = m["hidden"], m["ffn"]
    params: list[ParamSpec] = []
    for n in range(layers):
        params += _attention("layers.", n, h, m["heads"], m["kv_heads"], bias=True)
        params += [
            ParamSpec(name=f"layers.{n}.fc1", shape=(2 * f, h), tp_dim=0, layer=n),
            ParamSpec(name=f"layers.{n}.fc2", shape=(h, f), tp_dim=1, layer=n),
        ]
    return _ends(params, m["vocab"], h)


def count(params: list[ParamSpec]) -> int:
    """Elements of ``params``."""
    return sum(math.prod(p.shape) for p in params)


def activated_params() -> int:
    """Parameters a token uses (Q1): everything but the experts it is not routed to."""
    experts = [p for p in moe_params(1) if p.expert is not None]
    per_expert = count(experts) // MODEL["experts"]
    skipped = (MODEL["experts"] - MODEL["top_k"]) * per_expert * MODEL["layers"]
    return count(moe_params()) - skipped


def _spec(n: int, *, tp: int, ep: int = 1, etp: int | None = None) -> LayoutSpec:
    return LayoutSpec(
        ranks=tuple(range(n)),
        tp=tp,
        dp=n // tp,
        expert_parallel=ep,
        expert_tensor_parallel=etp,
        distributed_optimizer=True,
        param_dtype="bfloat16",
        master_dtype="float32",
    )


def busiest_receive_bytes(params: list[ParamSpec], src: LayoutSpec, dst: LayoutSpec) -> int:
    """Bytes the busiest rank receives from other ranks when ``src`` becomes ``dst`` (B7)."""
    a, b = trainer_layout(params, src), trainer_layout(params, dst)
    plan = plan_reshard(a.tensor_map() | b.tensor_map(), a.shards, b.shards)
    got: dict[int, int] = {}
    for item in plan.items:
        if not item.is_local:
            got[item.dst_rank] = got.get(item.dst_rank, 0) + plan.item_bytes(item)
    return max(got.values())


def _moe_move(layers: int) -> int:
    src = _spec(16, tp=LAYOUT["tp"], ep=LAYOUT["ep"], etp=LAYOUT["etp"])
    dst = _spec(24, tp=LAYOUT["tp"], ep=LAYOUT["ep"], etp=LAYOUT["etp"])
    return busiest_receive_bytes(moe_params(layers), src, dst)


def _dense_move(layers: int) -> int:
    return busiest_receive_bytes(dense32b_params(layers), _spec(16, tp=8), _spec(24, tp=8))


def reshard_bytes() -> tuple[int, int]:
    """(MoE, dense 32B) busiest-receiver bytes of B7's move, from 1- and 2-layer plans."""
    out = []
    for move, layers in ((_moe_move, MODEL["layers"]), (_dense_move, MOE_FACTS["Q5"][0]["layers"])):
        one, two = move(1), move(2)
        out.append(one + (layers - 1) * (two - one))
    return out[0], out[1]


def _flops_per_token(params: float, ctx: float, factor: int) -> float:
    """A8's count: ``factor`` × params plus attention (``2 × factor`` × layers × width × ctx)."""
    width = MODEL["heads"] * MODEL["head_dim"]  # B3
    return factor * params + 2 * factor * MODEL["layers"] * width * ctx


def _stages(active: float, ctx: float) -> tuple[StageSpec, StageSpec]:
    """Log-prob inference and the trainer (B5, B6)."""
    pretrain_mfu = MOE_FACTS["Q4"][0] * _flops_per_token(active, 4096 / 2, 6) / calibrate.PEAK_FLOPS
    train_mfu = pretrain_mfu * 0.25 / 0.40
    pp = LAYOUT["pp"]
    unit = math.lcm(LAYOUT["tp"] * pp, LAYOUT["etp"] * LAYOUT["ep"] * pp)
    trainer = StageSpec(
        tp=unit,
        tokens_per_s_per_gpu=calibrate.PEAK_FLOPS * train_mfu / _flops_per_token(active, ctx, 6),
        min_gpus=0,
        parkable=True,
    )
    infer_mfu = train_mfu * 0.35 / 0.25
    inference = StageSpec(
        tp=unit,
        tokens_per_s_per_gpu=calibrate.PEAK_FLOPS * infer_mfu / _flops_per_token(active, ctx, 2),
    )
    return inference, trainer


def _rollout(model: ModelSpec, active: float, mean_seq: float) -> RolloutSpec:
    """One engine (A3-A7, B2, B4)."""
    weights = 2.0 * model.num_params
    threshold = float(calibrate.FACTS["F8"][0])  # type: ignore[arg-type]
    tp = 1
    while tp * 80 * GIB * 0.85 - weights < threshold:
        tp *= 2
    bw = tp * calibrate.HBM_BPS * 0.7
    kv = int(min(threshold, tp * 80 * GIB * 0.85 - weights) // model.kv_bytes_per_token)
    compute = tp * calibrate.PEAK_FLOPS * 0.5
    return RolloutSpec(
        tp=tp,
        kv_capacity_tokens=kv,
        max_running_requests=int(kv // mean_seq),
        step_fixed_s=weights / bw
        + calibrate.FITTED["step_overhead_s"]
        + 2 * model.num_layers * 8e-6,
        step_per_seq_s=2.0 * active / compute,
        step_per_kv_token_s=model.kv_bytes_per_token / bw,
        prefill_tokens_per_s=compute / (2.0 * active),
    )


def derive(moved: tuple[int, int] | None = None) -> Workload:
    """The workload; ``moved`` is :func:`reshard_bytes` (computed when not given)."""
    moe, dense = moved or reshard_bytes()
    model = ModelSpec(
        name="qwen3-30b-a3b",
        num_params=float(count(moe_params())),
        num_layers=MODEL["layers"],
        hidden_size=MODEL["hidden"],
        kv_bytes_per_token=2 * MODEL["layers"] * MODEL["kv_heads"] * MODEL["head_dim"] * 2,
    )
    active = float(activated_params())
    prompts, group, max_seq = calibrate.FACTS["F4"][0]  # type: ignore[misc]
    lengths = LengthSpec(
        prompt_median=150.0,
        prompt_sigma=0.5,
        output_median=calibrate.FITTED["output_median"],
        output_sigma=calibrate.FITTED["output_sigma"],
    )
    mean_seq, ctx = calibrate._context(lengths)
    inference, trainer = _stages(active, ctx)
    trainer = replace(trainer, min_gpus=calibrate._trainer_min_gpus(model, trainer.tp))
    migration = calibrate._migration(model)
    p2p = calibrate.FACTS["F6"][0][1] * moe / dense  # type: ignore[index]
    return Workload(
        name=PATH.stem,
        kind="math",
        seed=20260 + 64 + 30,
        cluster=ClusterSpec(num_gpus=64, num_gpus_per_node=8, gpu_memory_gib=80.0),
        model=model,
        batch=BatchSpec(
            num_prompts=prompts, group_size=group, num_minibatches=4, max_seq_len=max_seq
        ),
        lengths=lengths,
        rollout=_rollout(model, active, mean_seq),
        inference=inference,
        trainer=trainer,
        migration=replace(migration, p2p_s=round(p2p, 3)),
        verl=VerlSpec(),
        scheduler=SchedulerConfig(num_devices_per_node=8, num_error_samples=32),
        num_iterations=3,
        num_warmup_iterations=1,
        report_interval_s=1.0,
    )


def sources(w: Workload, moved: tuple[int, int]) -> dict[tuple[str, str], str]:
    """Where each key's value comes from, by (table, key); "" is the top level."""
    ro = w.rollout
    active, weights = activated_params(), 2.0 * w.model.num_params
    out = {
        ("", "name"): "the file's name",
        ("", "kind"): "single-turn math GRPO, as the paper's math runs (B1)",
        ("", "seed"): "B9",
        ("", "num_iterations"): "A19",
        ("", "num_warmup_iterations"): "A19",
        ("", "report_interval_s"): "A18",
        ("cluster", "num_gpus"): "B1",
        ("cluster", "num_gpus_per_node"): "F9",
        ("cluster", "gpu_memory_gib"): "F9 (H100 80 GB)",
        ("model", "name"): "label",
        ("model", "num_params"): f"Q1, every parameter counted ({w.model.num_params / 1e9:.3f}B; "
        f"Q2: 30.5B); activated {active / 1e9:.3f}B (Q2: 3.3B)",
        ("model", "num_layers"): "Q1",
        ("model", "hidden_size"): "Q1",
        ("model", "kv_bytes_per_token"): "Q1: K and V × 48 layers × 4 KV heads × 128 × 2 bytes",
        ("model", "state_bytes_per_param"): "A9",
        ("model", "sharded_state_fraction"): "A9",
        ("batch", "num_prompts"): "F4",
        ("batch", "group_size"): "F4",
        ("batch", "num_minibatches"): "A15",
        ("batch", "max_seq_len"): "F4",
        ("lengths", "prompt_median"): "A10",
        ("lengths", "prompt_sigma"): "A10",
        ("lengths", "output_median"): "FITTED (B1)",
        ("lengths", "output_sigma"): "FITTED (B1)",
        ("rollout", "tp"): "B4",
        ("rollout", "kv_capacity_tokens"): "A6: F8's 100 GB over kv_bytes_per_token",
        ("rollout", "max_running_requests"): "A7",
        ("rollout", "step_fixed_s"): f"B2: all {weights / 1e9:.1f} GB of weights at A3's "
        f"70% of {ro.tp} GPUs' HBM (A2), FITTED step overhead, A5's allreduces",
        ("rollout", "step_per_seq_s"): f"B2: 2 × {active / 1e9:.3f}B activated FLOPs at "
        f"A3's 50% of {ro.tp} GPUs' peak (A2)",
        ("rollout", "step_per_kv_token_s"): "A3: kv_bytes_per_token at 70% of HBM (A2)",
        ("rollout", "prefill_tokens_per_s"): "A4 and B2: 50% of peak over 2 × activated",
    }
    for key in ("new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay_steps"):
        out["rollout", key] = "A20"
    out |= {("rollout", "clip_max_new_tokens"): "A20", ("rollout", "retract_decode_steps"): "A20"}
    for name in ("inference", "trainer"):
        out[name, "tp"] = "B5: the trainer's resize unit, lcm(TP × PP, ETP × EP × PP) of Q3"
        out[name, "scaling_exponent"] = "B6: linear"
    out |= {
        ("inference", "tokens_per_s_per_gpu"): "B6: A8's forward count at the log-prob MFU",
        ("inference", "min_gpus"): "as the shipped files: no replica while idle",
        ("inference", "parkable"): "only the trainer parks",
        ("trainer", "tokens_per_s_per_gpu"): "B6: A8's update count at the RL MFU from Q4",
        ("trainer", "min_gpus"): "A9's rule on B5's unit",
        ("trainer", "parkable"): "A22",
        ("migration", "workload_s"): "A12 on the total parameters (B8)",
        ("migration", "p2p_s"): f"B7: F6's 2.8 s × {moved[0] / 1e9:.2f} GB (EP reshard, "
        f"busiest receiver) / {moved[1] / 1e9:.2f} GB (dense 32B)",
        ("migration", "reboot_s"): "A13 on the total parameters (B8)",
        ("migration", "weight_sync_s"): "A13 on the total parameters (B8)",
        ("migration", "phase_switch_s"): "A14",
        ("migration", "host_gbps"): "A22",
    }
    for f in ("deactivate_ratio", "staleness_threshold", "trigger_parameter_sync_step"):
        out["verl", f] = "A17"
    for f in ("require_batches", "clamp_ratio", "enable_rebalance"):
        out["verl", f] = "A17"
    defaults = SchedulerConfig()
    for f in (f for f in type(defaults).__dataclass_fields__ if f != "num_error_samples"):
        out["scheduler", f] = "A18 (the scheduler's default)"
    out["scheduler", "num_error_samples"] = "A18"
    out["scheduler", "num_devices_per_node"] = "F9"
    out["scheduler", "device_memory_bytes"] = "F9"
    return out


HEADER = """\
math workload, Qwen3-30B-A3B (mixture of experts, EP 8) on 64 GPUs.
Generated by examples/workloads/moe_qwen3.py from its MOE_FACTS (Q), ASSUMPTIONS (B) and
calibrate.py's FACTS (F), ASSUMPTIONS (A) and FITTED; do not edit by hand. Above each key:
the fact or assumption its value comes from. B10: the reboot-only variant of this job is
this file with [migration] trainer_kind = "reboot"."""


def render(w: Workload, moved: tuple[int, int]) -> str:
    """The file's text: :func:`dump_workload` with each key's source above it."""
    where = sources(w, moved)
    out: list[str] = []
    section = ""
    for line in dump_workload(w, HEADER).splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif " = " in line and not line.startswith("#"):
            key = line.split(" = ", 1)[0]
            if (section, key) not in where:
                raise KeyError(f"no source for [{section}] {key}")
            note = where[section, key]
            out += textwrap.wrap(note, 96, initial_indent="# ", subsequent_indent="# ")
        out.append(line)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the file on disk")
    parser.add_argument(
        "--full-plan", action="store_true", help="also plan the 48-layer EP reshard (~1 min)"
    )
    args = parser.parse_args(argv)
    moved = reshard_bytes()
    print(
        f"EP reshard, busiest receiver: {moved[0] / 1e9:.3f} GB; dense 32B: {moved[1] / 1e9:.3f} GB"
    )
    if args.full_plan:
        full = _moe_move(MODEL["layers"])
        print(f"48-layer plan: {full / 1e9:.3f} GB ({full / moved[0] - 1:+.4%} vs extrapolated)")
    text = render(derive(moved), moved)
    if args.check:
        if not PATH.exists() or PATH.read_text(encoding="utf-8") != text:
            print(f"out of date: {PATH.name}", file=sys.stderr)
            return 1
        return 0
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(text, encoding="utf-8")
    print(f"wrote {PATH.relative_to(HERE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
