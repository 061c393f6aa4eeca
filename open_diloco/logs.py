"""Warnings and errors from every rank of a cluster, in the cluster's log, each line saying when and where.

Rank 0 prints the per-step line and a few facts (resumed, saved) on stdout, as people and tests read them;
that stays. What used to get lost is everything else: a warning on local rank 3 (ours, a library's, Python's
``warnings.warn``) reached stderr, if at all, with no time and no rank, so nobody could tell which rank of
which cluster said it, or when. Every rank now logs through the standard library to stderr (torchrun and
``scripts/cluster_train.sh`` collect it), one line per record::

    2026-11-24 09:31:24,118 WARNING galaxy_rank=1 rank=3 local_rank=1 py.warnings: ...

Levels: our own loggers (``open_diloco.*``) from INFO (DEBUG with LOG_LEVEL=DEBUG), everyone else's from
WARNING. hivemind keeps its own handler and level (see ``open_diloco.galaxy``): its INFO chatter stays quiet
unless LOG_LEVEL=DEBUG.
"""

from __future__ import annotations

import logging
import sys

HANDLER_NAME = "open_diloco.rank"
LINE_FORMAT = (
    "%(asctime)s %(levelname)s galaxy_rank={galaxy_rank} "
    "rank={rank} local_rank={local_rank} %(name)s: %(message)s"
)


def log_from_every_rank(galaxy_rank: int, rank: int, local_rank: int, level_name: str | None = None) -> None:
    """Send this rank's log records and Python warnings to stderr with time, galaxy rank, rank and local rank.
    Idempotent: a second call (a second run in one process) replaces the handler instead of doubling lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(
        logging.Formatter(LINE_FORMAT.format(galaxy_rank=galaxy_rank, rank=rank, local_rank=local_rank))
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    debug = (level_name or "").upper() == "DEBUG"
    logging.getLogger("open_diloco").setLevel(logging.DEBUG if debug else logging.INFO)
    logging.captureWarnings(True)  # warnings.warn on any rank becomes a record of the "py.warnings" logger
    warnings_logger = logging.getLogger("py.warnings")
    if _first_line_only not in warnings_logger.filters:
        warnings_logger.addFilter(_first_line_only)


def _first_line_only(record: logging.LogRecord) -> bool:
    """A warning as one line (``file:line: Category: message``), without the source line Python appends, so
    every line of the log starts with its time and ranks."""
    record.msg, record.args = record.getMessage().strip().splitlines()[0], ()
    return True
