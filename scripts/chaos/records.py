"""The clusters' jsonl metrics as the soak reads them: while it runs (progress, to place faults) and at the
end.

A sync is a record with ``outer_step``; a launch (first start or restart, appending to the same file) begins
with a ``{"event": "start"}`` record. Only keys the round protocol promises to keep are read: ``outer_step``,
``in_sync``, ``resynced``, ``param_hash``, ``galaxy_peers``, ``galaxy_alive``, ``retries``,
``pseudo_grad_finite``, ``pseudo_grad_in_bound``, ``time``, ``step`` (and ``committed``/``attempt`` where
present).
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsTail:
    """Reads a metrics file incrementally (a line still being written waits for the next read)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""
        self.syncs: list[dict] = []  # every sync so far, each with "launch" (1-based)
        self.launches = 0

    def read(self) -> list[dict]:
        """Records appended since the last read; syncs are also kept in ``self.syncs``."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by kill -9: the trainer never finished writing it
            if record.get("event") == "start":
                self.launches += 1
            elif "outer_step" in record:
                record["launch"] = max(1, self.launches)
                self.syncs.append(record)
            new.append(record)
        return new

    @property
    def outer_step(self) -> int:
        """The last outer step this cluster recorded (0 before its first sync)."""
        return self.syncs[-1]["outer_step"] if self.syncs else 0

    def syncs_in_launch(self, launch: int) -> int:
        return sum(1 for s in self.syncs if s["launch"] == launch)


def read_all(path: Path) -> MetricsTail:
    """Every record of a finished run."""
    tail = MetricsTail(path)
    tail.read()
    return tail
