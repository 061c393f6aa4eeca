"""Metrics sinks. Only rank 0 of each cluster logs; the other ranks get :class:`DummyMetrics`.

The record keys (``step``, ``loss``, ``lr``, ``tokens_per_second``, ``outer_step``, ``param_hash``, …) are a
public contract read by dashboards and external checks: add keys, never rename them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol


class Metrics(Protocol):
    """Where one JSON-able record per step goes."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class DummyMetrics:
    """Drops every record (metrics off, or a rank other than 0)."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlMetrics:
    """Appends one JSON object per record and flushes it, so a crash loses at most the record in flight.
    Every record gets ``time`` (Unix seconds, when it was written) unless it has one: it lines up the records
    of clusters on different hosts, and says how long a round or a heal took in seconds."""

    def __init__(self, path: Path, run_info: dict[str, Any]):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.log({"event": "start", **run_info})

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbMetrics:
    """Logs to Weights & Biases. Never prompts for a login: without credentials it runs offline."""

    def __init__(self, project: str, run_name: str, config: dict[str, Any], wandb_mode: str | None):
        import wandb  # imported here: wandb is heavy and most runs do not use it

        from open_diloco.world import env_flag

        mode = wandb_mode or ("online" if env_flag("WANDB_API_KEY") else "offline")
        self._wandb = wandb
        self._run = wandb.init(
            project=project, name=run_name, config=config, mode=mode, settings=wandb.Settings(silent=True)
        )

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        self._run.log(
            {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}, step=step
        )

    def close(self) -> None:
        self._run.finish()


def build_metrics(
    kind: str, is_main: bool, path: Path, project: str, run_name: str, config: dict[str, Any]
) -> Metrics:
    """The sink for this rank."""
    if not is_main or kind == "dummy":
        return DummyMetrics()
    if kind == "jsonl":
        return JsonlMetrics(path, {"run_name": run_name, "config": config})
    from open_diloco.world import env_flag

    return WandbMetrics(project, run_name, config, env_flag("WANDB_MODE"))
