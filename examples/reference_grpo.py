"""GRPO on the reference backend, in one process.

Run: ``.venv/bin/python examples/reference_grpo.py [chain_sum|tool_calc]``. A short
supervised warm-up, then GRPO steps; prints reward, loss and phase times per step.
"""

from __future__ import annotations

import sys

from dynarl.backends.reference import GRPOConfig, default_train
from dynarl.demo import SmokeConfig, run_grpo


def main() -> None:
    task = sys.argv[1] if len(sys.argv) > 1 else "chain_sum"
    if task == "tool_calc":
        # The multi-turn task needs a longer warm-up before any reward is earned, and the
        # near-converged policy it produces wants a gentler RL learning rate.
        config = SmokeConfig(
            task=task,
            sft_steps=100,
            train=default_train(lr=1e-4, grpo=GRPOConfig(kl_coef=0.01)),
        )
    else:
        config = SmokeConfig(task=task)
    result = run_grpo(config)
    print(f"warm-up loss {result.sft_losses[0]:.3f} -> {result.sft_losses[-1]:.3f}")
    for r in result.records:
        print(
            f"step {r.step:2d}  reward {r.mean_reward:.3f}  loss {r.loss:+.4f}  "
            f"len {r.mean_response_tokens:5.1f}/{r.max_response_tokens:3d}  "
            f"tools {r.tool_calls:4d}  rollout {r.rollout_s:.2f}s  train {r.train_s:.2f}s"
        )
    print(f"generated {result.generated_tokens} tokens, {result.prefix_hit_tokens} from cache")


if __name__ == "__main__":
    main()
