"""Where a run writes, checked before it starts: a checkpoint, metrics, cache or export path that cannot be
written is one line at start-up (exit 2), not a traceback after hours of training.

The checks write for real (a probe file, removed at once) rather than asking ``os.access``: root passes
``os.access`` on a read-only mount, and network filesystems answer it loosely.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from open_diloco.errors import ConfigError

if TYPE_CHECKING:
    from open_diloco.config import Config


def ensure_writable_dir(path: Path, flag: str) -> Path:
    """Create directory ``path`` (and its parents) if needed and prove a file can be written in it. Safe to
    call from many ranks at once (each probe has its own name)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a directory: choose a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".open-diloco-probe-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"{flag} {path} cannot be written ({_reason(err)}): choose a writable directory"
        ) from None
    return path


def ensure_appendable_file(path: Path, flag: str) -> Path:
    """Prove ``path`` can be appended to: not a directory, in a directory that can be written (created if
    needed). An existing file is opened for append, never truncated."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory: give a file path")
    ensure_writable_dir(path.parent, f"{flag} {path}: its directory")
    if path.exists():
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as err:
            raise ConfigError(
                f"{flag} {path} cannot be appended to ({_reason(err)}): choose another file"
            ) from None
    return path


def ensure_empty_output_dir(path: Path, flag: str, force: bool) -> Path:
    """A directory to write a result into: absent or empty, or (``force``) anything but a file. Writing into
    a non-empty directory would mix the result with what was there."""
    path = Path(path)
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ConfigError(
            f"{flag} {path} is not empty: choose a new directory, or pass --force to write into it"
        )
    return ensure_writable_dir(path, flag)


def _reason(err: OSError) -> str:
    """``Not a directory``, ``No space left on device``: the part of an OSError a person needs."""
    return err.strerror or str(err)


def ensure_run_outputs_writable(config: Config, is_main: bool) -> None:
    """Every path training will write, checked on the ranks that write it: the checkpoint directory on every
    rank (each writes its own shard there), the jsonl metrics file on rank 0 (its only writer)."""
    if config.ckpt.interval is not None:
        ensure_writable_dir(config.ckpt.path, "--ckpt.path")
    if is_main and config.metric_logger_type == "jsonl":
        ensure_appendable_file(config.metrics_path, "--metrics-path")
