"""Metrics sinks. Only rank 0 of each cluster logs; the other ranks get :class:`DummyMetrics`.

The record keys (``step``, ``loss``, ``lr``, ``tokens_per_second``, ``outer_step``, ``param_hash``, …) are a
public contract read by dashboards and external checks: add keys, never rename them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from open_diloco.config import Config


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


WANDB_RUN_FILE = "wandb_run.json"
"""Kept in ``--ckpt.path`` beside the checkpoints: the id of the wandb run that a cluster resumed from them
continues."""


class WandbMetrics:
    """Logs to Weights & Biases the way a multi-run job is read there: each cluster is one run, named after
    its galaxy rank (``cluster{rank}``, or ``--run-name``), the clusters of a galaxy share a group (its
    ``--hv.run-id``), and a cluster resumed from a checkpoint continues its own run (the id kept in
    :data:`WANDB_RUN_FILE` beside the checkpoints, resumed with ``resume="allow"``) rather than starting a new
    one for the rest of its curve. Never prompts for a login: without credentials it runs offline."""

    def __init__(self, config: Config, wandb_mode: str | None, resumed_from: Path | None):
        import wandb  # imported here: wandb is heavy and most runs do not use it

        from open_diloco.world import env_flag

        mode = wandb_mode or ("online" if env_flag("WANDB_API_KEY") else "offline")
        galaxy_rank = config.hv.world_rank if config.hv is not None else 0
        kept_id = read_run_id(resumed_from.parent) if resumed_from is not None else None
        self.run = wandb.init(
            project=config.project,
            group=config.hv.run_id if config.hv is not None else None,
            name=config.run_name or f"cluster{galaxy_rank}",
            id=kept_id,
            resume="allow" if kept_id else None,
            config=config.model_dump(mode="json"),
            mode=mode,
            settings=wandb.Settings(silent=True),
        )
        self.last_step: int | None = None
        """The last step given to wandb, which takes steps in order (two records at one step: one row)."""
        self.step_shift = 0
        """What the galaxy's clock went back by in this run: added to each step given to wandb."""
        if config.ckpt.interval is not None:  # this run's checkpoints will say which run to continue
            keep_run_id(config.ckpt.path, self.run.id)

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if isinstance(step, int):
            # wandb drops a record at a step it has passed: after the galaxy's clock went back (a cluster
            # that held, back in the galaxy) steps go on shifted past wandb's, the galaxy's kept as a value
            if self.last_step is not None and step + self.step_shift < self.last_step:
                self.step_shift = self.last_step + 1 - step
            if self.step_shift:
                numbers["galaxy_step"] = step
            step = self.last_step = step + self.step_shift
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


def read_run_id(checkpoints: Path) -> str | None:
    """The wandb run id kept beside the checkpoints under ``checkpoints``; ``None`` when there is none (they
    were written without wandb, or before ids were kept) or it cannot be read: then the run starts afresh."""
    try:
        run_id = json.loads((checkpoints / WANDB_RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def keep_run_id(checkpoints: Path, run_id: str) -> None:
    """Write :data:`WANDB_RUN_FILE` under ``checkpoints``, whole or not at all (a new file renamed over the
    old one)."""
    checkpoints.mkdir(parents=True, exist_ok=True)
    partial = checkpoints / f".{WANDB_RUN_FILE}.partial"
    partial.write_text(json.dumps({"run_id": run_id}) + "\n")
    partial.replace(checkpoints / WANDB_RUN_FILE)


def build_metrics(
    config: Config, is_main: bool, run_name: str, resumed_from: Path | None, restarts: int = 0
) -> Metrics:
    """The sink for this rank (``--metric-logger-type`` on rank 0, nothing on the others). ``run_name`` names
    the run in the jsonl file's start record; ``resumed_from``: the checkpoint this run resumed from (if
    any), and ``restarts``: torchrun's restarts of the cluster so far, both in that record too."""
    if not is_main or config.metric_logger_type == "dummy":
        return DummyMetrics()
    if config.metric_logger_type == "jsonl":
        run_info = {
            "run_name": run_name,
            "config": config.model_dump(mode="json"),
            "resumed_from": None if resumed_from is None else str(resumed_from),
            "restarts": restarts,
        }
        return JsonlMetrics(config.metrics_path, run_info)
    from open_diloco.world import env_flag

    return WandbMetrics(config, env_flag("WANDB_MODE"), resumed_from)
