"""A tiny random Llama checkpoint, built locally for tests against real engines (no hub).

:func:`write_tiny_llama` trains a byte-level BPE tokenizer on a generated corpus and saves a
seeded, randomly initialised ``LlamaForCausalLM`` as fp32 safetensors, in the Hugging Face
layout that vLLM and SGLang load with ``--model DIR``. The same arguments give the same
files, byte for byte. Needs ``transformers`` and ``tokenizers``, imported on call.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = (
    "the a an engine scheduler token request prefix cache weight version trainer rollout "
    "reward policy sample batch queue priority abort resume pause model layer head block "
    "device core server client reply stream step epoch loss value gradient update push "
    "and or not of to in on with from by for is are was be can will one two three four"
).split()
BOS, EOS = "<|bos|>", "<|eos|>"


def corpus(seed: int, *, num_lines: int = 2000) -> list[str]:
    """Lines of words drawn from :data:`WORDS`, with digits and punctuation, seeded."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = rng.choices(WORDS, k=rng.randint(4, 16))
        lines.append(" ".join(words).capitalize() + f" {rng.randint(0, 999)}" + rng.choice(".,;?!"))
    return lines


def write_tiny_llama(
    directory: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    vocab_size: int = 384,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a tiny random Llama (config, fp32 ``model.safetensors``, tokenizer) to
    ``directory`` and return it.

    The tokenizer is byte-level BPE (any text encodes) with ``<|bos|>`` and ``<|eos|>``
    as its last two ids. Global RNG state is left as it was.

    Raises ``ImportError`` without ``transformers`` and ``tokenizers``; ``ValueError`` for
    a ``vocab_size`` that cannot hold the 256 byte tokens and the two special ones, or a
    ``hidden_size`` that ``num_heads`` does not divide.
    """
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be at least 258, got {vocab_size}")
    if hidden_size % num_heads:
        raise ValueError(f"num_heads {num_heads} must divide hidden_size {hidden_size}")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(seed), trainer=trainer)
    bpe.add_special_tokens([BOS, EOS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS)
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out
