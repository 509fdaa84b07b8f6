"""A character-level tokenizer for the reference backend's toy tasks.

Every character of the task alphabet is one token; three special tokens (padding,
beginning and end of sequence) come first, and unused tokens pad the vocabulary to a
multiple of ``pad_to`` so that it splits evenly across tensor-parallel ranks. Pure
Python, no I/O; runs anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["DEFAULT_ALPHABET", "CharTokenizer"]

DEFAULT_ALPHABET = "0123456789+-*/%()=,.#:;[]{}?ACEQRST "
"""Digits, arithmetic, the tool-call span ``[...]``, the tool-result span ``{...}``, the
answer mark ``#`` and a few letters used as task tags."""

_SPECIALS = ("<pad>", "<bos>", "<eos>")


@dataclass(frozen=True, kw_only=True, slots=True)
class CharTokenizer:
    """Maps characters to token ids and back.

    Raises ValueError at construction if the alphabet repeats a character, and on
    :meth:`encode` of a character outside the alphabet.
    """

    alphabet: str = DEFAULT_ALPHABET
    """Characters that become tokens, in id order after the three special tokens."""
    pad_to: int = 64
    """The vocabulary is padded with unused tokens to a multiple of this."""
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError("CharTokenizer.alphabet must not repeat a character")
        if not self.alphabet:
            raise ValueError("CharTokenizer.alphabet must not be empty")
        if self.pad_to < 1:
            raise ValueError(f"CharTokenizer.pad_to must be >= 1, got {self.pad_to}")
        ids = {ch: i + len(_SPECIALS) for i, ch in enumerate(self.alphabet)}
        object.__setattr__(self, "_ids", ids)

    @property
    def pad_id(self) -> int:
        """Id of the padding token (never generated, never trained on)."""
        return 0

    @property
    def bos_id(self) -> int:
        """Id of the beginning-of-sequence token that starts every prompt."""
        return 1

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence token that ends every response."""
        return 2

    @property
    def vocab_size(self) -> int:
        """Number of token ids, a multiple of ``pad_to``."""
        used = len(_SPECIALS) + len(self.alphabet)
        return -(-used // self.pad_to) * self.pad_to

    def token_id(self, char: str) -> int:
        """The id of one character; raises ValueError if it is not in the alphabet."""
        try:
            return self._ids[char]
        except KeyError:
            raise ValueError(f"character {char!r} is not in the tokenizer alphabet") from None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by BOS/EOS.

        Raises ValueError naming the first character outside the alphabet.
        """
        ids = [self.token_id(ch) for ch in text]
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special and unused tokens are dropped."""
        base = len(_SPECIALS)
        chars = []
        for token in ids:
            index = int(token) - base
            if 0 <= index < len(self.alphabet):
                chars.append(self.alphabet[index])
        return "".join(chars)

    def ids_of(self, chars: Sequence[str]) -> tuple[int, ...]:
        """Ids of several single characters (for stop-token sets)."""
        return tuple(self.token_id(ch) for ch in chars)
