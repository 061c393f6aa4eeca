"""Which samples each rank actually read, step by step (``--sample-log DIR``, a debug flag).

The data plan says which samples a cluster should train; this log says which ones its loader handed to the
model, so a check of the galaxy's data (no sample in two clusters, none lost or read twice across a resume,
a take or a hold) can be made from what happened rather than from the plan. Each rank appends one line per
inner step it trains to ``DIR/<run name>.rank<rank>.jsonl``:
``{"time": 1796141925.8, "step": 7, "inner_steps": 7, "galaxy_rank": 0, "rank": 1, "sample_ids": [...]}``,
the ids of every micro-batch of the step in the order read (``time``: when the step ended, on the clock of the
metrics records, so the two read in one order: ``open_diloco/data_audit.py``). A line is flushed as it is
written: a killed rank's log ends at its last step. Off (the default), nothing is wrapped or written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from open_diloco.output_paths import ensure_writable_dir


class NullSampleLog:
    """The log when ``--sample-log`` is unset: the loader is used as it is."""

    def watch(self, loader: Any) -> Any:
        return loader

    def record(self, step: int, inner_steps: int, page: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class SampleLog(NullSampleLog):
    """Notes the ``sample_id`` of every batch this rank's model takes and writes them per inner step."""

    def __init__(self, directory: Path, run_name: str, galaxy_rank: int, rank: int) -> None:
        self.path = ensure_writable_dir(directory, "--sample-log") / f"{run_name}.rank{rank}.jsonl"
        self._file: TextIO = open(self.path, "a", encoding="utf-8")
        self._ids: list[int] = []
        self._where = {"galaxy_rank": galaxy_rank, "rank": rank}

    def watch(self, loader: Any) -> WatchedLoader:
        """``loader``, each batch's ids noted as the model takes it (not as the loader prefetches it)."""
        return WatchedLoader(loader, self._ids)

    def record(self, step: int, inner_steps: int, page: int | None = None) -> None:
        """The ids read since the last record, as inner step ``step`` (the loader at ``inner_steps``; in an
        elastic galaxy, the ``page`` the ledger dealt it)."""
        line = {"time": time.time(), "step": step, "inner_steps": inner_steps, **self._where}
        if page is not None:
            line["page"] = page
        line["sample_ids"] = list(self._ids)
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self._ids.clear()

    def close(self) -> None:
        self._file.close()


class WatchedLoader:
    """A train loader whose batches' ``sample_id`` go to ``ids`` as they are taken; its sampler is the
    loader's (the trainer positions it)."""

    def __init__(self, loader: Any, ids: list[int]) -> None:
        self.loader, self.ids = loader, ids

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            self.ids.extend(int(i) for i in batch["sample_id"])
            yield batch


def open_sample_log(
    directory: Path | None, run_name: str, galaxy_rank: int, rank: int
) -> NullSampleLog | SampleLog:
    """The sample log of ``--sample-log`` (:class:`NullSampleLog` when it is unset)."""
    return NullSampleLog() if directory is None else SampleLog(directory, run_name, galaxy_rank, rank)


def read_sample_logs(directory: Path) -> list[dict[str, Any]]:
    """Every line of every rank's log in ``directory``, for checks and tests."""
    return [
        json.loads(line)
        for path in sorted(Path(directory).glob("*.rank*.jsonl"))
        for line in path.read_text().splitlines()
    ]
