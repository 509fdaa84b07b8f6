"""Speed of the reference CPU backend: decode throughput and trainer step time.

Run: ``.venv/bin/python bench/reference.py``. One intra-op thread (the runtime's device
model: one compute thread per worker). Decode: ``batch`` requests of a 16-token prompt
generate exactly 64 tokens each (no stop token), timed from submit to the last token,
prefill included. Train: one GRPO step of the reference job's trainer (Megatron's, the
reference architecture) on 64 sequences of 32–64 tokens, micro-batches of 8, median of 5:
``whole`` through Megatron DDP in one call, ``streamed`` as the reference job takes it (one
gradient row per micro-batch, summed in order: the DP-invariant way). Figures are noisy on
a shared machine; the ratios (batching gain, deterministic decoding's and streamed steps'
costs) are measured in the same run. The last line is one JSON object.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import torch
import torch.distributed as dist

from dynarl.backends._grpo import TrainSample
from dynarl.backends.megatron import MegatronTrainer
from dynarl.backends.reference import (
    EngineConfig,
    GPTConfig,
    RolloutEngine,
    default_train,
    megatron_model,
    solo_process_group,
)
from dynarl.backends.reference._gpt import ParallelGPT
from dynarl.backends.reference._request import GenerationRequest

MODEL = GPTConfig()  # vocab 64, hidden 64, 2 layers, 4 heads, MLP 256
BATCHES = (1, 8, 32)
NEW_TOKENS = 64
REPEATS = 3


def decode_tokens_per_s(weights: dict[str, torch.Tensor], batch: int, deterministic: bool) -> float:
    best = 0.0
    for repeat in range(REPEATS):
        engine = RolloutEngine(
            MODEL,
            EngineConfig(num_slots=batch, deterministic=deterministic, prefix_cache_tokens=0),
        )
        engine.load_weights(weights, version=0)
        start = time.perf_counter()
        for i in range(batch):
            prompt = (1, *[(3 + 7 * i + j) % 60 + 3 for j in range(15)])
            engine.submit(
                GenerationRequest(
                    sample_id=repeat * 1000 + i, prompt=prompt, max_new_tokens=NEW_TOKENS
                )
            )
        engine.run_until_idle()
        elapsed = time.perf_counter() - start
        best = max(best, engine.stats().generated_tokens / elapsed)
    return best


def train_step_s(streamed: bool) -> float:
    trainer = MegatronTrainer(
        megatron_model(MODEL),
        default_train(micro_batch_size=8),
        rank=0,
        store=dist.HashStore(),  # type: ignore[attr-defined]
    )
    trainer.start(trainer.layout_spec((0,)), epoch=0)
    rng = random.Random(0)
    batch = []
    for i in range(64):
        n = rng.randint(32, 64)
        tokens = tuple(rng.randrange(3, 64) for _ in range(n))
        mask = tuple(t >= 16 for t in range(n - 1))
        batch.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=(-1.0) ** i))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        if streamed:
            rows = [trainer.micro_gradient(batch[i : i + 8]) for i in range(0, len(batch), 8)]
            total = torch.zeros_like(rows[0])
            for row in rows:
                total += row
            trainer.apply_gradient(total, num_samples=len(batch))
        else:
            trainer.train_step(batch)
        times.append(time.perf_counter() - start)
    trainer.close()
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    with solo_process_group() as group:
        weights = ParallelGPT(MODEL, tp_group=group).full_state_dict()
        train = {"streamed": train_step_s(True), "whole": train_step_s(False)}
    decode: dict[str, dict[str, float]] = {}
    for mode, deterministic in (("deterministic", True), ("fast", False)):
        decode[mode] = {str(b): decode_tokens_per_s(weights, b, deterministic) for b in BATCHES}
        for b in BATCHES:
            print(f"decode {mode:13s} batch {b:2d}: {decode[mode][str(b)]:9.0f} tokens/s")
    for mode, seconds in train.items():
        print(f"train step {mode:13s} (64 seqs, micro 8): {seconds * 1e3:7.1f} ms")
    result = {
        "decode_tokens_per_s": decode,
        "train_step_s": train,
        "batching_gain_32_vs_1": {mode: decode[mode]["32"] / decode[mode]["1"] for mode in decode},
        "deterministic_decode_cost_at_32": decode["fast"]["32"] / decode["deterministic"]["32"],
        "streamed_train_cost": train["streamed"] / train["whole"],
        "num_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
