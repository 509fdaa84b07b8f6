"""Drive MegatronTrainer's GPU-only optimizer code on a CPU: run as a script, prints JSON.

Megatron's optimizers refuse CPU tensors only through type strings
(``param.type() == 'torch.cuda.FloatTensor'``) and a few ``device='cuda'`` literals. This
script (for a subprocess: it patches torch process-wide) makes ``Tensor.type()`` answer
with the CUDA names and sends those literals to the CPU, then runs the trainer with
Megatron's own optimizer — FP32, bf16 with fp32 master weights, the distributed optimizer —
in place of the CPU AdamW: three steps, then single-rank P2P reshards between the
distributed and the plain optimizer layouts, each checked against a trainer restarted from
the gathered state. It exercises the state mapping, the range cross-check, the step-counter
mirrors and Megatron's step; it does not exercise CUDA itself (tests/gpu does).

Usage: ``python megatron_fake_cuda.py DTYPE`` (float32 or bfloat16).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from dynarl.backends._cpu_compat import apply_cpu_shim

apply_cpu_shim()


def _fake_cuda() -> None:
    tensor, zeros, type_of = torch.tensor, torch.zeros, torch.Tensor.type

    def on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return type_of(self, *args, **kwargs)
        name = type_of(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.")

    torch.tensor = lambda *a, **k: tensor(*a, **on_cpu(k))  # type: ignore[assignment]
    torch.zeros = lambda *a, **k: zeros(*a, **on_cpu(k))  # type: ignore[assignment]
    torch.Tensor.type = cuda_type  # type: ignore[method-assign,assignment]


MEGATRON_OPTIMIZER = [True]
"""Whether trainers built from now on get Megatron's optimizer (else the CPU AdamW)."""


def _megatron_optimizer_on_cpu() -> None:
    """Make the trainer build Megatron's optimizer where it would build its CPU AdamW."""
    import dynarl.backends.megatron._megatron_trainer as trainer
    from dynarl.migrate import trainer_layout

    build = trainer.build_instance

    def with_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        return build(*args, **(kwargs | {"megatron_optimizer": MEGATRON_OPTIMIZER[0]}))

    trainer.build_instance = with_megatron_optimizer  # type: ignore[assignment]
    # Allow the distributed optimizer's layouts on CPU.
    trainer.MegatronTrainer.layout_for = lambda self, spec: trainer_layout(self.specs, spec)  # type: ignore[method-assign]


def main(dtype: str) -> dict[str, Any]:
    _fake_cuda()
    _megatron_optimizer_on_cpu()
    from dynarl.backends._grpo import TrainSample
    from dynarl.backends.megatron import GPTModelConfig, MegatronTrainConfig, MegatronTrainer
    from dynarl.backends.reference import solo_process_group
    from dynarl.migrate import P2PMigration

    def batch(seed: int) -> list[TrainSample]:
        gen = torch.Generator().manual_seed(seed)
        return [
            TrainSample(
                tokens=tuple(torch.randint(0, 96, (10 + i,), generator=gen).tolist()),
                loss_mask=tuple([False] * 3 + [True] * (6 + i)),
            )
            for i in range(4)
        ]

    out: dict[str, Any] = {"moves": []}
    model = GPTModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, vocab_size=96, params_dtype=dtype,
    )  # fmt: skip
    config = MegatronTrainConfig(device="cpu", lr=1e-2, micro_batch_size=2)
    with solo_process_group():
        store = dist.HashStore()  # type: ignore[attr-defined]
        trainer = MegatronTrainer(model, config, rank=0, store=store)
        trainer.start(trainer.layout_spec((0,), distributed_optimizer=True), epoch=0)
        out["optimizer"] = type(trainer._current.optimizer.optimizer).__name__  # type: ignore[union-attr]
        out["losses"] = [trainer.sft_step(batch(0)).loss for _ in range(3)]
        restarted = None
        for epoch, distributed in ((1, False), (3, True)):
            assert trainer.layout is not None
            before = trainer.gather(0, names=list(trainer.layout.tensor_map()))
            digest = trainer.state_checksum()
            dst = trainer.layout_for(trainer.layout_spec((0,), distributed_optimizer=distributed))
            move = P2PMigration(
                migration_id=f"move-{epoch}", src=trainer.layout, dst=dst, rank=0, store=store,
                epoch=epoch, trainer=trainer,
            )  # fmt: skip
            ok = all(o.ok for o in (move.prepare(), move.transfer(), move.verify(), move.commit()))
            move.close()
            if restarted is not None:
                restarted.close()
            restarted = MegatronTrainer(model, config, rank=0, store=store, specs=trainer.specs)
            assert dst.spec is not None
            restarted.start(dst.spec, epoch=epoch + 1)
            restarted.load_full(before)
            record = {
                "layout": dst.name,
                "optimizer": type(trainer._current.optimizer.optimizer).__name__,  # type: ignore[union-attr]
                "ok": ok,
                "checksum_kept": trainer.state_checksum() == digest,
                "restart_equal": restarted.state_checksum() == digest,
            }
            mine, theirs = trainer.sft_step(batch(epoch)), restarted.sft_step(batch(epoch))
            record["step_equal"] = mine == theirs
            record["state_equal"] = trainer.state_checksum() == restarted.state_checksum()
            out["moves"].append(record)
        assert restarted is not None
        restarted.close()
        trainer.close()
    return out


def tp2_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """One rank of a TP=2 job: the same clipped step with Megatron's distributed optimizer
    and with the CPU AdamW, from the same weights. Returns what rank 0 compared."""
    from datetime import timedelta

    _fake_cuda()
    _megatron_optimizer_on_cpu()
    from dynarl.backends._grpo import TrainSample
    from dynarl.backends.megatron import GPTModelConfig, MegatronTrainConfig, MegatronTrainer

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("w", store), rank=rank, world_size=world)
    model = GPTModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, vocab_size=96,
    )  # fmt: skip
    config = MegatronTrainConfig(device="cpu", lr=1e-2, micro_batch_size=2, clip_grad=0.05)
    gen = torch.Generator().manual_seed(3)
    samples = [
        TrainSample(
            tokens=tuple(torch.randint(0, 96, (9 + i,), generator=gen).tolist()),
            loss_mask=tuple([False] * 2 + [True] * (6 + i)),
        )
        for i in range(4)
    ]
    out: dict[str, Any] = {}
    for epoch, megatron in ((0, True), (1, False)):
        MEGATRON_OPTIMIZER[0] = megatron
        trainer = MegatronTrainer(model, config, rank=rank, store=store)
        distributed = {"distributed_optimizer": True} if megatron else {}
        trainer.start(trainer.layout_spec((0, 1), tp=2, **distributed), epoch=epoch)
        stats = trainer.sft_step(samples)
        out[str(megatron)] = (stats.loss, stats.grad_norm, trainer.gather(0))
        trainer.close()
    dist.destroy_process_group()
    if rank != 0:
        return {}
    (loss_m, norm_m, params_m), (loss_c, norm_c, params_c) = out["True"], out["False"]
    worst = max(float((params_m[n] - params_c[n]).abs().max()) for n in params_c)
    return {"losses": [loss_m, loss_c], "norms": [norm_m, norm_c], "max_param_diff": worst}


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1])) + "\n")
