"""The vLLM demo's policy: a small Llama in the Hugging Face layout, speaking the reference
task's character vocabulary, warmed up by supervised steps.

Real engines load a checkpoint directory (``config.json``, safetensors, a tokenizer), and the
Megatron trainer loads the same directory (``MegatronSetup.from_hf``), so the demo's model is
one: :func:`write_task_llama` builds a seeded ``LlamaForCausalLM`` whose token ids are
:class:`~dynarl.backends.reference.CharTokenizer`'s (the tokenizer saved beside it maps each
id to its character, so a server can detokenize; the job itself sends and reads ids), trains
it on the task's reference responses (tool results masked out, as the reference warm start
does) and writes it. The episodes, rewards and tool calls of the reference job are then
unchanged. Needs ``transformers`` and ``tokenizers`` (vLLM brings both), imported on call.
Runs in the caller's thread, on its CPU.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from dynarl.backends.reference import CharTokenizer, ReferenceSetup, sft_samples

__all__ = ["SFT_LR", "VOCAB_SIZE", "write_task_llama"]

logger = logging.getLogger(__name__)

VOCAB_SIZE = 128
"""The model's vocabulary: the character tokenizer's ids, padded with unused tokens to a
multiple of 128 (Megatron's padding unit: the trainer's and the engine's tables then have
the same rows)."""
SFT_LR = 1e-3
"""Adam's learning rate of the warm start (3e-3, the reference GPT's, leaves this Llama at
0.59 nats after 200 steps; 1e-3 reaches 0.02)."""
_SPECIALS = ("<pad>", "<bos>", "<eos>")


def write_task_llama(
    setup: ReferenceSetup,
    directory: str | Path,
    *,
    hidden_size: int,
    num_layers: int,
    sft_steps: int,
    lr: float = SFT_LR,
    batch_size: int = 32,
) -> Path:
    """Write the warmed-up policy for ``setup``'s task to ``directory`` (created) and return
    it. Seeded by ``setup.seed`` (weights; the supervised problems come from another seed
    than the RL ones, as in the reference warm start). Raises ValueError for a width that
    4 heads do not divide or a count below 0, ImportError without ``transformers``."""
    if hidden_size < 4 or hidden_size % 4 or num_layers < 1:
        raise ValueError(
            f"write_task_llama needs hidden_size a multiple of 4 and num_layers >= 1, got "
            f"{hidden_size} and {num_layers}"
        )
    if sft_steps < 0 or batch_size < 1:
        raise ValueError("write_task_llama needs sft_steps >= 0 and batch_size >= 1")
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    chars = CharTokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max(512, setup.engine.max_seq_len),
        bos_token_id=chars.bos_id,
        eos_token_id=chars.eos_id,
        pad_token_id=chars.pad_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(setup.seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    began = time.perf_counter()
    _supervise(model, setup, chars, steps=sft_steps, lr=lr, batch_size=batch_size)
    logger.info("policy warm start: %d steps in %.1f s", sft_steps, time.perf_counter() - began)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(chars).save_pretrained(out)
    return out


def _supervise(
    model: torch.nn.Module,
    setup: ReferenceSetup,
    chars: CharTokenizer,
    *,
    steps: int,
    lr: float,
    batch_size: int,
) -> None:
    """Cross entropy on the reference responses' own tokens (what the reference warm start
    trains on), Adam, one batch of fresh problems per step."""
    task = setup.make_task(seed_offset=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        batch = sft_samples(task, chars, step=10_000 + step, batch_size=batch_size)
        length = max(len(s.tokens) for s in batch)
        tokens = torch.full((len(batch), length), chars.pad_id, dtype=torch.long)
        mask = torch.zeros(len(batch), length - 1)
        for row, sample in enumerate(batch):
            tokens[row, : len(sample.tokens)] = torch.tensor(sample.tokens)
            mask[row, : len(sample.loss_mask)] = torch.tensor(sample.loss_mask, dtype=torch.float)
        logits = model(input_ids=tokens).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    model.eval()


def _tokenizer(chars: CharTokenizer) -> Any:
    """A word-level tokenizer over the character vocabulary (one token per id; ids past the
    alphabet are ``<unused-K>``), for the server's detokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(_SPECIALS)}
    for ch in chars.alphabet:
        (token_id,) = chars.encode(ch)
        vocab[ch] = token_id
    for token_id in range(len(vocab), VOCAB_SIZE):
        vocab[f"<unused-{token_id}>"] = token_id
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
