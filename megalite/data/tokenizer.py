"""Byte-level BPE trained locally with Hugging Face `tokenizers`, or a user's tokenizer.json.

Special tokens come first, eos = 0, bos = 1, pad = 2: the pad id is deliberately not 0, and 0 is
a real token, so a collate that pads with 0 instead of the pad id is caught by the tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megalite.typed_config import ConfigError

SPECIAL = ("<|eos|>", "<|bos|>", "<|pad|>")


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    eos_id: int
    bos_id: int
    pad_id: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """The text's tokens only: no template tokens (a Llama tokenizer would prepend bos)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def train_bpe(documents: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def load_tokenizer(path: Path) -> TokenizerInfo:
    if not path.is_file():
        raise ConfigError(f"data.tokenizer '{path}' not found: give a tokenizer.json or "
                          f"data.tokenizer=bpe to train one")
    tokenizer = Tokenizer.from_file(str(path))
    ids = {name: tokenizer.token_to_id(name) for name in SPECIAL}
    eos = ids["<|eos|>"] if ids["<|eos|>"] is not None else _first_of(tokenizer, ("</s>", "<|endoftext|>", "<eos>"))
    if eos is None:
        raise ConfigError(f"tokenizer '{path}' has no end-of-document token: add '<|eos|>' "
                          f"(or '</s>' / '<|endoftext|>') to its special tokens")
    bos = ids["<|bos|>"] if ids["<|bos|>"] is not None else _first_of(tokenizer, ("<s>", "<bos>"))
    pad = ids["<|pad|>"] if ids["<|pad|>"] is not None else _first_of(tokenizer, ("<pad>", "[PAD]"))
    if pad is None:
        raise ConfigError(f"tokenizer '{path}' has no padding token: add '<|pad|>' (or '<pad>') "
                          f"to its special tokens; padding with a real token id is a classic bug")
    return TokenizerInfo(tokenizer, eos, eos if bos is None else bos, pad)


def _first_of(tokenizer: Tokenizer, names) -> int | None:
    return next((tokenizer.token_to_id(n) for n in names if tokenizer.token_to_id(n) is not None), None)
