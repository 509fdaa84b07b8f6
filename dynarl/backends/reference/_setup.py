"""What every role of a reference job needs to know: :class:`ReferenceSetup`.

One frozen description of the job — model, trainer, engine, task, seed, where the
initial weights are — that travels to the worker processes as a single component option
(JSON text; options are scalars) and is decoded there by each role. The initial weights
(a supervised warm start, written once by the driver) are a ``torch.save`` file every
role loads the same way, so every run and every rank starts from the same bits. Pure
data and small helpers; run anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynarl.backends._grpo import GRPOConfig
from dynarl.backends._json_option import json_option, read_json_option
from dynarl.backends.megatron import MegatronSetup, MegatronTrainConfig
from dynarl.backends.reference._gpt import GPTConfig, check_full_state
from dynarl.backends.reference._rollout_engine import EngineConfig
from dynarl.backends.reference._tasks import ChainSumTask, Task, ToolCalcTask
from dynarl.backends.reference._tokenizer import CharTokenizer
from dynarl.backends.reference._tools import ToolLatency
from dynarl.bus import MetaValue

__all__ = [
    "SETUP_OPTION",
    "ReferenceSetup",
    "default_train",
    "load_weights_file",
    "save_weights_file",
    "warm_start",
]

SETUP_OPTION = "setup"
"""The component option that carries a :class:`ReferenceSetup` as JSON."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReferenceSetup:
    """A reference RL job, as its roles see it."""

    model: GPTConfig = field(default_factory=GPTConfig)
    """Architecture (every role builds the same one)."""
    train: MegatronTrainConfig = field(default_factory=lambda: default_train())
    """Trainer settings (learning rate, loss; the trainer is Megatron's, on the CPU)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Rollout engine capacity and mode."""
    task: str = "chain_sum"
    """``chain_sum`` (single turn, heavy-tailed lengths) or ``tool_calc`` (multi-turn)."""
    median_terms: float = 3.0
    """chain_sum: median number of digits of a prompt."""
    sigma: float = 0.8
    """chain_sum: log-space spread of the number of digits (the tail)."""
    max_terms: int = 24
    """chain_sum: most digits of a prompt."""
    dataset_size: int = 0
    """0: fresh problems every step; n: a fixed set of n problems, cycled."""
    max_products: int = 4
    """tool_calc: most products in a prompt (an episode makes 2k - 1 calls for k)."""
    max_operand: int = 20
    """tool_calc: operands are drawn from [2, max_operand]."""
    group_size: int = 8
    """Samples per prompt (GRPO's group; one micro-batch per group)."""
    max_response_tokens: int = 96
    """Token budget of one response (tool results included)."""
    max_tool_calls_per_episode: int = 8
    """tool_calc: an episode ends unfinished after this many calls."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (and of the trainer's log-probs)."""
    seed: int = 0
    """Seeds problems and sampling."""
    init_path: str = ""
    """The initial weights (a :func:`save_weights_file` file), required by the roles."""
    tool_latency: ToolLatency = field(default_factory=lambda: ToolLatency(median_s=0.0))
    """Calculator latency (tool_calc)."""

    def __post_init__(self) -> None:
        if self.task not in ("chain_sum", "tool_calc"):
            raise ValueError(f"ReferenceSetup.task must be chain_sum or tool_calc: {self.task!r}")
        if self.group_size < 1 or self.max_response_tokens < 1:
            raise ValueError("ReferenceSetup.group_size and max_response_tokens must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"ReferenceSetup.temperature must be > 0, got {self.temperature}")
        if self.engine.max_seq_len > self.model.max_seq_len:
            raise ValueError("ReferenceSetup: engine.max_seq_len exceeds model.max_seq_len")
        if self.train.device != "cpu":
            raise ValueError(
                f"ReferenceSetup.train.device must be 'cpu' (the reference job's engines and "
                f"weight sync are CPU code), got {self.train.device!r}"
            )

    def megatron(self) -> MegatronSetup:
        """The trainer component's setup: the reference architecture as a Megatron GPTModel
        (:func:`~._megatron_model.megatron_model`), data parallel over its devices."""
        from dynarl.backends.reference._megatron_model import megatron_model

        return MegatronSetup(model=megatron_model(self.model), train=self.train)

    def to_options(self) -> dict[str, MetaValue]:
        """The component options that carry this setup."""
        return json_option(SETUP_OPTION, self)

    @classmethod
    def from_options(cls, options: Mapping[str, MetaValue]) -> ReferenceSetup:
        """The setup in a component's options; ValueError if it is missing or malformed."""
        return read_json_option(options, SETUP_OPTION, cls, "reference setup")

    def make_task(self, *, seed_offset: int = 0) -> Task:
        """The task (``seed_offset`` draws another problem set, e.g. for the warm start)."""
        seed = self.seed + seed_offset
        if self.task == "tool_calc":
            return ToolCalcTask(
                seed=seed,
                dataset_size=self.dataset_size,
                min_products=min(2, self.max_products),
                max_products=self.max_products,
                max_operand=self.max_operand,
            )
        return ChainSumTask(
            seed=seed,
            median_terms=self.median_terms,
            sigma=self.sigma,
            max_terms=self.max_terms,
            dataset_size=self.dataset_size,
        )

    def stop_tokens(self, tokenizer: CharTokenizer) -> tuple[int, ...]:
        """EOS and the task's turn-ending characters."""
        return (tokenizer.eos_id, *tokenizer.ids_of(self.make_task().stop_chars))

    def initial_weights(self) -> dict[str, torch.Tensor]:
        """The initial full state dict; ValueError when ``init_path`` is not set."""
        if not self.init_path:
            raise ValueError("ReferenceSetup.init_path names no initial weights")
        return load_weights_file(self.init_path, self.model)


def save_weights_file(path: str | Path, state: Mapping[str, torch.Tensor]) -> Path:
    """Write a full state dict (the initial weights of a job); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({name: tensor.detach().clone() for name, tensor in state.items()}, path)
    return path


def load_weights_file(path: str | Path, model: GPTConfig) -> dict[str, torch.Tensor]:
    """Read a full state dict written by :func:`save_weights_file`; ValueError if it does
    not fit ``model``."""
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict")
    check_full_state(model, state)
    return dict(state)


def default_train(**fields: object) -> MegatronTrainConfig:
    """The reference job's trainer settings: Adam at lr 1e-3, micro-batches of 8, GRPO
    without a KL term, on the CPU; ``fields`` override them."""
    base: dict[str, object] = {"lr": 1e-3, "micro_batch_size": 8, "device": "cpu"}
    base.setdefault("grpo", GRPOConfig())
    base.update(fields)
    return MegatronTrainConfig(**base)  # type: ignore[arg-type]


def warm_start(
    setup: ReferenceSetup, *, num_steps: int, batch_size: int = 32, lr: float = 2e-3
) -> dict[str, torch.Tensor]:
    """Supervised warm-up on the task's reference responses (RL post-training starts from
    an SFT model: from random weights no response earns a reward); the full state dict
    under the reference names.

    Trains the job's own trainer (Megatron's GPTModel, :meth:`ReferenceSetup.megatron`) in
    this process on one rank (a one-rank gloo group for its duration), from Megatron's
    draw of the initial weights; problems come from another seed than the RL ones. Raises
    ValueError if torch.distributed is already initialized here.
    """
    from dataclasses import replace

    import torch.distributed as dist

    from dynarl.backends.megatron import MegatronTrainer
    from dynarl.backends.reference._gpt import solo_process_group
    from dynarl.backends.reference._megatron_model import from_megatron
    from dynarl.backends.reference._tasks import sft_samples

    tokenizer = CharTokenizer()
    task = setup.make_task(seed_offset=1)
    megatron = setup.megatron()
    with solo_process_group():
        trainer = MegatronTrainer(
            megatron.model,
            replace(setup.train, lr=lr, micro_batch_size=batch_size),
            rank=0,
            store=dist.HashStore(),  # type: ignore[attr-defined]
        )
        trainer.start(trainer.layout_spec((0,)), epoch=0)
        try:
            for step in range(num_steps):
                trainer.sft_step(
                    sft_samples(task, tokenizer, step=10_000 + step, batch_size=batch_size)
                )
            return from_megatron(trainer.gather(0), setup.model)
        finally:
            trainer.close()
