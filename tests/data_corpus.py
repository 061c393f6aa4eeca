"""Corpora and tokenizers the data tests build from files present on every machine (the Python standard
library's own sources), so no test downloads anything."""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

# Never reach for a hub, whatever the machine has configured (set before `datasets` is imported).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "tests" / "models" / "llama-2m-fresh"
TRAIN_SCRIPT = REPO / "open_diloco" / "train_fsdp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def stdlib_sources(count: int) -> list[Path]:
    """The first ``count`` top-level ``.py`` files of the standard library, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"))[:count]


def text_dir(tmp: Path, count: int = 40) -> Path:
    """A directory of ``count`` Python sources (one document each)."""
    out = tmp / "text"
    out.mkdir(parents=True, exist_ok=True)
    for source in stdlib_sources(count):
        shutil.copyfile(source, out / source.name)
    return out


def documents(count: int) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_sources(count)]


def jsonl_file(tmp: Path, count: int = 40, field: str = "text") -> Path:
    path = tmp / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for index, text in enumerate(documents(count)):
            out.write(json.dumps({field: text, "id": index}) + "\n")
    return path


def parquet_file(tmp: Path, count: int = 40, field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp / "docs.parquet"
    pq.write_table(pa.table({field: documents(count), "id": list(range(count))}), path)
    return path


def saved_dataset(tmp: Path, count: int = 40) -> Path:
    import datasets

    path = tmp / "saved"
    datasets.Dataset.from_dict({"text": documents(count)}).save_to_disk(str(path))
    return path


def tokenizer_dir(tmp: Path, vocab_size: int) -> Path:
    """A local transformers tokenizer (word-level over characters, padded to ``vocab_size`` ids, with EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<extra{len(vocab)}>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")
    path = tmp / f"tokenizer{vocab_size}"
    tokenizer.save_pretrained(path)
    return path


def offline_env() -> dict[str, str]:
    """The trainers' environment (offline, quiet, one thread per rank) with the repository on PYTHONPATH."""
    from tests.conftest import trainer_env

    return {**trainer_env(), "PYTHONPATH": str(REPO)}
