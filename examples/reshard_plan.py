"""What does moving a trainer from one layout to another cost? Plan it, without any GPU.

Describes a 7B-shaped GPT (32 layers), lays it out at (tp=4, pp=2, dp=4) with the
distributed optimizer on 32 ranks, and plans the move to (tp=8, pp=2, dp=2) on 32 ranks,
then the weight sync of the same trainer to four full-copy rollout engines. Prints the
bytes that cross ranks, the busiest sender and the number of copies.

Run: ``.venv/bin/python examples/reshard_plan.py``.
"""

from __future__ import annotations

from dynarl.migrate import (
    LayoutSpec,
    ParamSpec,
    Stage,
    plan_reshard,
    replicated_layout,
    trainer_layout,
)


def gpt(
    layers: int = 32, hidden: int = 4096, ffn: int = 11008, vocab: int = 32000
) -> list[ParamSpec]:
    params = [ParamSpec(name="embedding", shape=(vocab, hidden), tp_dim=0, stage=Stage.FIRST)]
    for n in range(layers):
        params += [
            ParamSpec(name=f"layers.{n}.norm1", shape=(hidden,), layer=n),
            ParamSpec(name=f"layers.{n}.qkv", shape=(3 * hidden, hidden), tp_dim=0, layer=n),
            ParamSpec(name=f"layers.{n}.proj", shape=(hidden, hidden), tp_dim=1, layer=n),
            ParamSpec(name=f"layers.{n}.norm2", shape=(hidden,), layer=n),
            ParamSpec(
                name=f"layers.{n}.fc1", shape=(2 * ffn, hidden), tp_dim=0, tp_stride=2, layer=n
            ),
            ParamSpec(name=f"layers.{n}.fc2", shape=(hidden, ffn), tp_dim=1, layer=n),
        ]
    params += [
        ParamSpec(name="final_norm", shape=(hidden,), stage=Stage.LAST),
        ParamSpec(name="output", shape=(vocab, hidden), tp_dim=0, stage=Stage.LAST),
    ]
    return params


def main() -> None:
    params = gpt()
    ranks = tuple(range(32))
    before = LayoutSpec(
        ranks=ranks,
        tp=4,
        pp=2,
        dp=4,
        distributed_optimizer=True,
        param_dtype="bfloat16",
        master_dtype="float32",
    )
    after = LayoutSpec(
        ranks=ranks,
        tp=8,
        pp=2,
        dp=2,
        distributed_optimizer=True,
        param_dtype="bfloat16",
        master_dtype="float32",
    )
    src, dst = trainer_layout(params, before), trainer_layout(params, after)
    plan = plan_reshard(dst.tensor_map(), src.shards, dst.shards)
    print(
        f"{src.name} -> {dst.name}: {plan.bytes_moved / 1e9:.1f} GB cross ranks, "
        f"{plan.local_bytes / 1e9:.1f} GB stay local, "
        f"busiest sender {plan.max_rank_send_bytes / 1e9:.2f} GB, "
        f"{len(plan.items)} copies"
    )
    engines = replicated_layout(params, ranks=range(32, 36), dtype="bfloat16")
    weights = [s for s in src.shards if "/" not in s.tensor]
    sync = plan_reshard(engines.tensor_map(), weights, engines.shards)
    print(
        f"weight sync to 4 engines: {sync.bytes_moved / 1e9:.1f} GB, "
        f"busiest sender {sync.max_rank_send_bytes / 1e9:.2f} GB "
        f"over {len(sync.send_bytes_by_rank())} senders"
    )


if __name__ == "__main__":
    main()
