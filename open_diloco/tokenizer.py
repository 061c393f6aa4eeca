"""Turning documents into token ids, offline.

Two tokenizers share one small interface (:class:`TextTokenizer`): a local transformers tokenizer
(``--path-tokenizer``, loaded with ``local_files_only`` so nothing is ever downloaded) and a built-in
byte-level tokenizer, so a run needs no tokenizer files at all. The byte-level ids match the test model
(``tests/models/llama-2m-fresh``): bytes are 0–255, then BOS=256, EOS=257, PAD=258.

Each tokenizer has a ``fingerprint`` that names exactly how it maps text to ids; a prepared corpus records it,
so a cache is never reused with a different tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from open_diloco.errors import ConfigError


class TextTokenizer(Protocol):
    """What corpus preparation needs from a tokenizer."""

    name: str
    """Human-readable origin (``byte`` or the tokenizer directory)."""
    vocab_size: int
    """Number of ids it can produce (the model's embedding must be at least this large)."""
    eos_id: int
    """Id appended after every document when packing."""
    fingerprint: str
    """Stable hash of the text → ids mapping."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0–255, plus BOS/EOS/PAD at 256/257/258. Needs no files and never fails on text."""

    BOS, EOS, PAD = 256, 257, 258
    name = "byte"
    vocab_size = 259
    eos_id = EOS
    fingerprint = "byte-utf8-v1"

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8) for text in texts]


class LocalTokenizer:
    """A transformers tokenizer from a local directory. Documents are encoded without BOS/EOS; packing adds
    the EOS separator itself."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer  # heavy; only when a tokenizer directory is given

        self.name = str(path)
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as err:
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ConfigError(
                f"--path-tokenizer {path} does not load as a tokenizer ({first_line}): point it at a "
                "directory saved with tokenizer.save_pretrained"
            ) from None
        if self._tokenizer.eos_token_id is None:
            raise ConfigError(
                f"--path-tokenizer {path} has no EOS token: packing separates documents with EOS; set "
                "eos_token in its tokenizer_config.json"
            )
        self.eos_id = int(self._tokenizer.eos_token_id)
        self.vocab_size = len(self._tokenizer)
        self.fingerprint = _fingerprint_of(self._tokenizer)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        ids = self._tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(row, dtype=np.int64) for row in ids]


def _fingerprint_of(tokenizer: object) -> str:
    """Hash of the full tokenization pipeline (fast tokenizers serialise it exactly), else of the vocab."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))  # type: ignore[attr-defined]
    text += f"|eos={tokenizer.eos_token_id}"  # type: ignore[attr-defined]
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_tokenizer(path_tokenizer: Path | None) -> TextTokenizer:
    """The tokenizer at ``path_tokenizer``, or the byte-level one when unset. A missing path is a
    ConfigError."""
    if path_tokenizer is None:
        return ByteTokenizer()
    path = Path(path_tokenizer)
    if not path.is_dir():
        raise ConfigError(
            f"--path-tokenizer {path} is not a directory: point it at a local tokenizer dir, or leave it "
            "unset for the built-in byte-level tokenizer"
        )
    return LocalTokenizer(path)


def check_fits_model(vocab_size: int, tokenizer_name: str, model_vocab_size: int) -> None:
    """A token id the embedding has no row for would crash deep in the forward pass; say so up front."""
    if vocab_size > model_vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_name} has {vocab_size} ids but the model's vocab_size is "
            f"{model_vocab_size}: use a model config with vocab_size >= the tokenizer's, or a smaller "
            "tokenizer"
        )
