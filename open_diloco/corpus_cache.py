"""The cache of packed corpora: raw ``--dataset-path`` data is packed (``corpus.py``) once for every rank and
run that reads it, not once each.

Raw data is packed into ``--data-cache-dir`` under a key of (files, sizes, mtimes, text field, tokenizer), so
a rerun, another rank or another cluster on the same filesystem reuses it. The first process to take the lock
prepares; the others wait while the lock's heartbeat is fresh. A failure is written next to the lock, so the
waiting ranks raise the same one-line error instead of hanging or repeating the work.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from open_diloco.corpus import FORMAT, INDEX_FILE, PackedCorpus, Source, pack_corpus
from open_diloco.errors import ConfigError
from open_diloco.output_paths import ensure_writable_dir
from open_diloco.tokenizer import TextTokenizer

STALE_LOCK_SECONDS = 120.0
"""A lock whose heartbeat is older than this belongs to a preparer that died; it is broken and retried."""
ERROR_GRACE_SECONDS = 10.0
"""The longest a process whose packing failed waits, after publishing its error, for the other ranks of its
node to say it too (torchrun stops them all as soon as one exits); a rank that failed another way never
answers."""
ERROR_FRESH_SECONDS = 60.0
"""A published error this recent is raised by a rank that arrives after the preparer gave up, without packing
again (the cache key names these very files, tokenizer and field)."""


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
    """The packed corpus of ``source``: from the cache, else packed by the first process to take the lock
    while the others wait (see the module doc). Raises the preparer's ConfigError in every waiting process."""
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
    """Raise the published error if it was written after ``since``, and say so (see
    :func:`_wait_until_said`)."""
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
