"""Local corpora: find them, check them, and tokenize + pack them once into a flat token file.

Why a prepare step: training reads a *packed corpus* — ``tokens.bin`` (every document's ids followed by EOS,
back to back, uint16 or uint32) and ``index.json`` (counts, dtype, tokenizer fingerprint). Sample ``i`` of
length T is the window ``tokens[i*T:(i+1)*T]``: a memmap slice, so loading is random access, needs no RAM for
the corpus, is resumable by index, and costs the same as fake data. Tokenizing happens once, streaming
(``datasets`` in streaming mode, or ``load_from_disk``'s memory-mapped Arrow), never holding the corpus in RAM.

``--dataset-path`` may point at a packed corpus (made by ``open-diloco prepare-data``) or at raw data:

* a directory or glob of text files — one document per file (a file is read whole; split huge files or use JSONL),
* ``.jsonl`` / ``.json`` files with a text field, ``.parquet`` files with a text column,
* a directory written by ``datasets.Dataset.save_to_disk`` (its ``train`` split if it is a ``DatasetDict``).

Raw data is packed into ``--data-cache-dir`` under a key of (files, sizes, mtimes, text field, tokenizer), so a
rerun, another rank or another cluster on the same filesystem reuses it. The first process to take the lock
prepares; the others wait while the lock's heartbeat is fresh. A failure is written next to the lock, so the
waiting ranks raise the same one-line error instead of hanging or repeating the work.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from open_diloco.errors import ConfigError
from open_diloco.output_paths import ensure_writable_dir
from open_diloco.tokenizer import TextTokenizer

FORMAT = "open_diloco.packed/1"
INDEX_FILE, TOKENS_FILE = "index.json", "tokens.bin"
STALE_LOCK_SECONDS = 120.0
"""A lock whose heartbeat is older than this belongs to a preparer that died; it is broken and retried."""
ERROR_GRACE_SECONDS = 10.0
"""The longest a process whose packing failed waits, after publishing its error, for the other ranks of its node
to say it too (torchrun stops them all as soon as one exits); a rank that failed another way never answers."""
ERROR_FRESH_SECONDS = 60.0
"""A published error this recent is raised by a rank that arrives after the preparer gave up, without packing
again (the cache key names these very files, tokenizer and field)."""

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
            f"{flag}: {file} has no text column {text_field!r} (found: {', '.join(names)}): set --dataset-text-field"
        )


def _check_disk_columns(path: Path, text_field: str, flag: str) -> None:
    columns = _load_disk(path, flag).column_names
    if text_field not in columns:
        raise ConfigError(
            f"{flag} has no text column {text_field!r} (found: {', '.join(columns)}): set --dataset-text-field"
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
                    f"{flag}: a record has no text field {text_field!r}: fix the data or set --dataset-text-field"
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
    """Tokenize every document, append EOS after each, and write ``tokens.bin`` + ``index.json`` to ``out_dir``.

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
        # A live bar on a terminal only (it vanishes when done, so an error stays one line); logs get a summary.
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


def cache_key(source: Source, text_field: str, tokenizer: TextTokenizer) -> str:
    """Names the packed corpus of exactly these files (path, size, mtime), text field and tokenizer."""
    digest = hashlib.sha256(f"{FORMAT}|{source.kind}|{text_field}|{tokenizer.fingerprint}".encode())
    entries = list(source.files) or sorted(p for p in Path(source.path).rglob("*") if p.is_file())
    for file in entries:
        stat = file.stat()
        digest.update(f"|{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:20]


def prepare_cached(
    source: Source,
    text_field: str,
    tokenizer: TextTokenizer,
    cache_dir: Path,
    wait_timeout_s: float = STALE_LOCK_SECONDS,
) -> PackedCorpus:
    """The packed corpus of ``source``: from the cache, else packed by the first process to take the lock while
    the others wait (see the module doc). Raises the preparer's ConfigError in every waiting process."""
    if source.kind == "packed":
        return PackedCorpus.open(Path(source.path))
    ensure_writable_dir(cache_dir, "--data-cache-dir")
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(source.path).name).strip("._") or "corpus"
    name = f"{stem}-{cache_key(source, text_field, tokenizer)}"
    out_dir, lock, error = cache_dir / name, cache_dir / f"{name}.lock", cache_dir / f"{name}.error"
    while not (out_dir / INDEX_FILE).is_file():
        _raise_if_failed_lately(error, time.time() - ERROR_FRESH_SECONDS)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            _wait_for_lock(lock, error, wait_timeout_s)
            continue
        try:
            error.unlink(missing_ok=True)
            for said in glob.glob(f"{glob.escape(str(error))}.said-*"):
                Path(said).unlink(missing_ok=True)
            return pack_corpus(source, text_field, tokenizer, out_dir, heartbeat=_toucher(lock))
        except ConfigError as err:
            error.write_text(str(err))
            lock.unlink(missing_ok=True)
            _wait_until_said(error, others=int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1)
            raise
        finally:
            lock.unlink(missing_ok=True)
    return PackedCorpus.open(out_dir)


def _raise_if_failed_lately(error: Path, since: float) -> None:
    """Raise the published error if it was written after ``since``, and say so (see :func:`_wait_until_said`)."""
    with contextlib.suppress(FileNotFoundError):
        if error.stat().st_mtime >= since:
            message = error.read_text().strip()
            Path(f"{error}.said-{os.getpid()}").touch()
            raise ConfigError(message)


def _wait_until_said(error: Path, others: int, timeout_s: float = ERROR_GRACE_SECONDS) -> None:
    """Wait until ``others`` processes have raised the published error too (each leaves a ``.said-PID`` file),
    at most ``timeout_s``. Why: torchrun stops every rank as soon as one exits, so without this the ranks that
    wait on the preparer, or arrive late, could be stopped before they say the error: their logs would show a
    SIGTERM rather than the problem and its fix."""
    deadline = time.monotonic() + timeout_s
    while len(glob.glob(f"{glob.escape(str(error))}.said-*")) < others and time.monotonic() < deadline:
        time.sleep(0.05)
    if others > 0:
        time.sleep(0.5)  # from raising it to its line on stderr: milliseconds, unless the machine is loaded


def _toucher(lock: Path, every_s: float = 5.0) -> Callable[[], None]:
    """A heartbeat that refreshes the lock's mtime at most every ``every_s`` seconds."""
    last = time.monotonic()

    def touch() -> None:
        nonlocal last
        if time.monotonic() - last > every_s:
            with contextlib.suppress(OSError):
                os.utime(lock)
            last = time.monotonic()

    return touch


def _wait_for_lock(lock: Path, error: Path, stale_after_s: float) -> None:
    """Wait while another process prepares; raise its error if it failed; break its lock if it died."""
    started = time.time()
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            break
        if age > stale_after_s:
            lock.unlink(
                missing_ok=True
            )  # its holder died; a second preparer is harmless (publishing is atomic)
            return
        time.sleep(0.2)
    _raise_if_failed_lately(error, started - 1.0)
