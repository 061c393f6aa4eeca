"""Local corpora: find them, check them, and tokenize + pack them once into a flat token file.

Why a prepare step: training reads a *packed corpus* — ``tokens.bin`` (every document's ids followed by EOS,
back to back, uint16 or uint32) and ``index.json`` (counts, dtype, tokenizer fingerprint). Sample ``i`` of
length T is the window ``tokens[i*T:(i+1)*T]``: a memmap slice, so loading is random access, needs no RAM for
the corpus, is resumable by index, and costs the same as fake data. Tokenizing happens once, streaming
(``datasets`` in streaming mode, or ``load_from_disk``'s memory-mapped Arrow), never holding the corpus in
RAM.

``--dataset-path`` may point at a packed corpus (made by ``open-diloco prepare-data``) or at raw data:

* a directory or glob of text files — one document per file (a file is read whole; split huge files or use
  JSONL),
* ``.jsonl`` / ``.json`` files with a text field, ``.parquet`` files with a text column,
* a directory written by ``datasets.Dataset.save_to_disk`` (its ``train`` split if it is a ``DatasetDict``).

Raw data is packed once into ``--data-cache-dir`` and reused (``corpus_cache.py``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from open_diloco.errors import ConfigError
from open_diloco.tokenizer import TextTokenizer

FORMAT = "open_diloco.packed/1"
INDEX_FILE, TOKENS_FILE = "index.json", "tokens.bin"

Kind = Literal["packed", "text", "json", "parquet", "disk"]
_SUFFIX_KIND: dict[str, Kind] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Source:
    """Raw or packed data found at ``--dataset-path``."""

    path: str
    kind: Kind
    files: tuple[Path, ...] = ()
    """The data files in a stable order (empty for ``packed`` and ``disk``, which are directories)."""


@dataclass(frozen=True)
class PackedCorpus:
    """A packed corpus on disk (see the module doc)."""

    root: Path
    num_tokens: int
    dtype: str
    vocab_size: int
    tokenizer: str
    tokenizer_fingerprint: str

    @classmethod
    def open(cls, root: Path) -> PackedCorpus:
        index = json.loads((root / INDEX_FILE).read_text())
        return cls(
            root,
            index["num_tokens"],
            index["dtype"],
            index["vocab_size"],
            index["tokenizer"],
            index["tokenizer_fingerprint"],
        )

    def tokens(self) -> np.memmap:
        """The flat token array, memory-mapped read-only (cheap; call it in each process that reads)."""
        return np.memmap(self.root / TOKENS_FILE, dtype=self.dtype, mode="r", shape=(self.num_tokens,))


def find_source(dataset_path: str, text_field: str) -> Source:
    """Classify and check ``--dataset-path`` cheaply (no tokenizing): every problem a user can fix becomes a
    one-line ConfigError here, on every rank, before any rank waits on another."""
    path = Path(dataset_path)
    flag = f"--dataset-path {dataset_path}"
    if path.is_dir() and (path / INDEX_FILE).is_file() and (path / TOKENS_FILE).is_file():
        return Source(dataset_path, "packed")
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        _check_disk_columns(path, text_field, flag)
        return Source(dataset_path, "disk")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if not _hidden(p.relative_to(path)) and not p.is_dir())
    elif path.exists():
        files = [path]
    elif glob.has_magic(dataset_path):
        files = sorted(Path(p) for p in glob.glob(dataset_path, recursive=True) if not Path(p).is_dir())
    else:
        raise ConfigError(
            f"{flag} does not exist: give a directory, glob, .jsonl/.parquet file or save_to_disk dir"
        )
    if not files:
        raise ConfigError(f"{flag} holds no files: point it at a directory or glob with data files")
    kinds = {_SUFFIX_KIND.get(f.suffix.lower(), "text") for f in files}
    if len(kinds) > 1:
        raise ConfigError(f"{flag} mixes kinds of files ({', '.join(sorted(kinds))}): point it at one kind")
    kind = kinds.pop()
    for file in files:
        _check_readable(file, flag)
        if kind == "json":
            _check_json_field(file, text_field, flag)
        elif kind == "parquet":
            _check_parquet_field(file, text_field, flag)
    return Source(dataset_path, kind, tuple(files))


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _check_readable(file: Path, flag: str) -> None:
    try:
        with open(file, "rb") as handle:
            handle.read(1)
    except OSError as err:
        raise ConfigError(
            f"{flag}: cannot read {file} ({err.strerror or type(err).__name__}): fix or remove it"
        ) from None


def _check_json_field(file: Path, text_field: str, flag: str) -> None:
    with open(file, encoding="utf-8", errors="replace") as handle:
        first = next((line for line in handle if line.strip()), None)
    if first is None:
        return  # an empty file adds no documents
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        if first.lstrip().startswith("["):
            return  # a JSON array file; datasets parses it whole and checks the field while packing
        raise ConfigError(
            f"{flag}: {file} is not JSON lines (first line does not parse): fix or remove it"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f"{flag}: {file} has no text field {text_field!r} (found: {keys}): set --dataset-text-field"
        )


def _check_parquet_field(file: Path, text_field: str, flag: str) -> None:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(file).names
    except Exception as err:  # pyarrow raises several types for "not a parquet file"
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{flag}: cannot read {file} as parquet ({first_line}): fix or remove it") from None
    if text_field not in names:
        raise ConfigError(
            f"{flag}: {file} has no text column {text_field!r} (found: {', '.join(names)}): set "
            "--dataset-text-field"
        )


def _check_disk_columns(path: Path, text_field: str, flag: str) -> None:
    columns = _load_disk(path, flag).column_names
    if text_field not in columns:
        raise ConfigError(
            f"{flag} has no text column {text_field!r} (found: {', '.join(columns)}): set "
            "--dataset-text-field"
        )


def _load_disk(path: Path, flag: str):  # -> datasets.Dataset
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises several types for a damaged directory
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{flag}: cannot load the saved dataset ({first_line}): re-save it") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(f"{flag} is a DatasetDict without a 'train' split (has: {', '.join(loaded)})")
        loaded = loaded["train"]
    return loaded


def iter_text_batches(source: Source, text_field: str, batch_size: int = 256) -> Iterator[list[str]]:
    """Documents in a stable order, streamed in batches (``datasets`` reads; nothing is loaded whole)."""
    import datasets

    flag = f"--dataset-path {source.path}"
    if source.kind == "disk":
        dataset = _load_disk(Path(source.path), flag).select_columns([text_field])
    else:
        options = {
            "text": {"sample_by": "document", "encoding_errors": "replace"},
            "parquet": {"columns": [text_field]},
            "json": {},
        }[source.kind]
        dataset = datasets.load_dataset(
            source.kind, data_files=[str(f) for f in source.files], split="train", streaming=True, **options
        )
        if source.kind == "text":
            text_field = "text"
    try:
        for batch in dataset.iter(batch_size=batch_size):
            texts = batch.get(text_field)
            if texts is None or any(not isinstance(t, str) for t in texts):
                raise ConfigError(
                    f"{flag}: a record has no text field {text_field!r}: fix the data or set "
                    "--dataset-text-field"
                )
            yield texts
    except ConfigError:
        raise
    except Exception as err:  # a file that broke mid-read: pyarrow, json, OS errors all mean "fix the data"
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(
            f"{flag}: cannot read the data ({type(err).__name__}: {first_line}): fix or remove the file"
        ) from None


def pack_corpus(
    source: Source,
    text_field: str,
    tokenizer: TextTokenizer,
    out_dir: Path,
    heartbeat: Callable[[], None] = lambda: None,
    progress: bool = True,
) -> PackedCorpus:
    """Tokenize every document, append EOS after each, and write ``tokens.bin`` + ``index.json`` to
    ``out_dir``.

    Writes into a temporary sibling and renames it into place, so a reader never sees a half-written corpus.
    Returns the corpus (an existing one if another process published first). ``heartbeat`` is called after
    every batch of documents.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    num_tokens = num_documents = 0
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    console = Console(stderr=True)
    columns = (
        TextColumn("[bold]packing[/] {task.description}"),
        BarColumn(),
        TextColumn("{task.fields[docs]:,} docs"),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeElapsedColumn(),
    )
    started = time.monotonic()
    try:
        # A live bar on a terminal only (it vanishes when done, so an error stays one line); logs get a
        # summary.
        with (
            open(tmp / TOKENS_FILE, "wb") as out,
            Progress(
                *columns, console=console, disable=not (progress and console.is_terminal), transient=True
            ) as bar,
        ):
            task = bar.add_task(source.path, total=None, docs=0, tokens=0)
            for texts in iter_text_batches(source, text_field):
                for ids in tokenizer.encode_batch([t for t in texts if t]):
                    out.write(ids.astype(dtype, copy=False).tobytes())
                    out.write(eos.tobytes())
                    num_tokens += len(ids) + 1
                    num_documents += 1
                bar.update(task, docs=num_documents, tokens=num_tokens)
                heartbeat()
        index = {
            "format": FORMAT,
            "num_tokens": num_tokens,
            "num_documents": num_documents,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "tokenizer": tokenizer.name,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "source": source.path,
            "text_field": text_field,
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        if progress:
            console.print(
                f"packed {source.path}: {num_documents:,} documents, {num_tokens:,} tokens in "
                f"{time.monotonic() - started:.1f}s",
                highlight=False,
                soft_wrap=True,
            )
        if not out_dir.exists():
            with contextlib.suppress(OSError):  # another process published the same corpus first: keep theirs
                os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PackedCorpus.open(out_dir)
