"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP), taken at outer-step boundaries.

What a checkpoint holds, and why that is enough for an exact resume:
- model and inner-optimizer state as DTensors (DCP reshards them when the rank count changes);
- the outer loop's state, saved and loaded as one ``Stateful`` (``outer.state_dict()``, placed for DCP by
  ``outer/stateful.py``): the outer momentum and, with a lossy ``--hv.compression``, the error feedback,
  shaped like the parameters so DCP reshards them too (a run with error feedback resumed from a checkpoint
  without it starts from zero). θ_outer itself is not stored: saves land right after an outer step, where
  θ_local ← θ_outer, so the model weights *are* θ_outer. Streaming (``--hv.fragments`` > 1 or
  ``--hv.sync-delay`` > 0) breaks that: the other fragments, or the τ steps of the fragment in flight, hold
  local progress. Then θ_outer is stored too (``outer_params``), and a round in flight is recorded, not waited
  for (``sync_start``: the fragment's θ_local when the round started), so the save costs training nothing and
  a resume sends the same round again and lands it where the straight run did;
- step counters, each rank's RNG states, the config and model config it was made with, θ_outer's
  ``param_hash`` and the galaxy's ledger (``ledger.jsonl``, ``outer/ledger.py``). The data position and the
  learning-rate schedule are pure functions of the step: derived on resume (as for late joiners), not stored.

Atomicity: every rank writes into ``step_<N>.tmp``; after a barrier rank 0 writes ``metadata.json`` last and
renames the directory to ``step_<N>``. A kill leaves the old set of checkpoints or the new one, never a half.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from open_diloco.config import CkptConfig
from open_diloco.errors import ConfigError
from open_diloco.model import SHAPE_FIELDS
from open_diloco.outer.ledger import read_checkpoint_ledger, write_checkpoint_ledger
from open_diloco.outer.loop import OuterLoop
from open_diloco.outer.stateful import zeros_placed_like_params

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA = "metadata.json"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (a directory without metadata is not one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / METADATA).is_file()]
    return sorted(found, key=lambda p: p.name)


def read_metadata(path: Path, checked_by: str = "--ckpt.resume (or use `latest`)") -> dict[str, Any]:
    """The checkpoint's metadata, or a one-line error for a partial or corrupt checkpoint (a missing one
    names ``checked_by``, the flag or argument to correct)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist: check {checked_by}")
    meta_file = path / METADATA
    if not meta_file.is_file() or not (path / ".metadata").is_file():
        raise ConfigError(
            f"checkpoint {path} is incomplete (no {METADATA} or DCP .metadata): resume from another one"
        )
    try:
        metadata = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(
            f"checkpoint {path} has an unreadable {METADATA} ({err}): resume from another one"
        ) from None
    if metadata.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {path} has format {metadata.get('format')}, expected {FORMAT_VERSION}")
    return metadata


def resolve_resume(ckpt: CkptConfig, model_config: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from, vetted before any rank talks to another (a bad one makes every rank exit
    on its own); one of another model shape is refused."""
    if ckpt.resume is None:
        return None
    if ckpt.resume in ("latest", "auto"):
        found = list_checkpoints(ckpt.path)
        if not found and ckpt.resume == "auto":  # a first start, or a restart before the first save
            log.info("--ckpt.resume auto: no checkpoint under %s yet: starting fresh", ckpt.path)
            return None
        if not found:
            raise ConfigError(
                f"--ckpt.resume latest: no complete checkpoint under {ckpt.path}: check --ckpt.path"
            )
        path = found[-1]
    else:
        path = Path(ckpt.resume)
    metadata = read_metadata(path)
    saved = metadata.get("model_config", {})
    # the model's own list of what decides the parameters' shapes: one list, so none is left out
    differing = [k for k in SHAPE_FIELDS if saved.get(k) != model_config.get(k)]
    if differing:
        details = ", ".join(f"{k} {saved.get(k)} vs {model_config.get(k)}" for k in differing)
        raise ConfigError(
            f"checkpoint {path} was made for another model ({details}): use the matching --path-model"
        )
    return path, metadata


# Where the outer loop's state dict goes besides DCP: its counters are fields of metadata.json under their own
# names (with what their absence means); per-rank values (cut from this rank's shard: DCP could not reshard
# them) are files <key>_rank<N>.pt beside the RNG state. Every per-value piece is a top-level DCP entry of its
# own name. ``pace`` (by-speed's step counts) is null with equal steps, ``goodput`` counts tokens
# (outer/goodput.py), ``in_flight`` is a round in flight's weight and steps, ``own_pages`` an elastic
# galaxy's pages its Δ carries (outer/own_pages.py).
_OUTER_COUNTERS = dict(
    outer_step=0, fragments=1, pace=None, param_hash=None, goodput=None, in_flight=None, own_pages=None
)
_OUTER_PER_RANK = ("sparse_scores",)


def _outer_pieces(metadata: dict[str, Any]) -> list[str]:
    """The outer pieces a checkpoint's DCP part holds, as its metadata lists them: what a load asks for."""
    held = [key for key in ("outer_momentum", "error_feedback") if metadata.get(f"has_{key}")]
    return held + list(metadata.get("streaming", ()))


def _outer_parts(outer_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The outer loop's state dict cut along the format: (``metadata.json`` fields, DCP entries, per-rank
    files). The fields are format 1's, so that checkpoints written before the outer loop was a Stateful still
    load. A value with no place in the format stops the save, rather than a checkpoint that silently lacks
    it."""
    fields = {
        "outer_step": int(outer_state.get("outer_step", _OUTER_COUNTERS["outer_step"])),
        "has_outer_momentum": "outer_momentum" in outer_state,
        "has_error_feedback": "error_feedback" in outer_state,
        "streaming": [key for key in ("outer_params", "sync_start") if key in outer_state],
        "fragments": int(outer_state.get("fragments", _OUTER_COUNTERS["fragments"])),
        **{key: outer_state.get(key) for key in ("pace", "param_hash", "goodput", "in_flight", "own_pages")},
    }
    entries = {key: outer_state[key] for key in _outer_pieces(fields)}
    per_rank = {key: outer_state[key] for key in _OUTER_PER_RANK if key in outer_state}
    unplaced = set(outer_state) - set(_OUTER_COUNTERS) - set(entries) - set(per_rank) - {"ledger"}
    if unplaced:
        raise RuntimeError(f"checkpoint format {FORMAT_VERSION} has no place for outer {sorted(unplaced)}")
    return fields, entries, per_rank


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


SAVE_GRACE_SECONDS = 5.0
"""How long a stopping rank gives a save in flight before abandoning it (within shutdown.GRACE_SECONDS)."""


class CheckpointSaver:
    """Writes checkpoints in the background, so that a save costs the galaxy a copy in memory, not a write.

    A save blocks training only while it stages a copy of this rank's state (model, inner optimizer, outer
    momentum) in host memory; the next inner step may then change the weights freely. A background thread
    writes the copy with DCP over a gloo group of its own (the training collectives never interleave with
    the checkpoint's), and rank 0 publishes it once every rank's part is on disk: ``metadata.json`` last,
    then the rename of ``step_<N>.tmp`` to ``step_<N>``, then the pruning to ``keep``. One save at a time:
    a save that finds the previous one still writing waits for it (and says so).

    The end of a run waits for its last save; a stop (signal, error) waits a bounded time and otherwise
    abandons it: an abandoned save stays a ``.tmp`` directory, which is never taken for a checkpoint.
    Every call is collective (all ranks, same steps)."""

    def __init__(self, root: Path, keep: int, config: dict[str, Any], model_config: dict[str, Any]):
        self.root, self.keep = Path(root), keep
        self._config, self._model_config = config, model_config
        self._group: dist.ProcessGroup | None = None  # created at the first save, which every rank makes
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="checkpoint-writer"
        )
        self._in_flight: tuple[int, concurrent.futures.Future[Path | None]] | None = None
        self._abandoned = False

    def start(
        self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, outer: OuterLoop
    ) -> None:
        """Stage checkpoint ``step`` and start writing it; returns once the weights may change again."""
        self._wait_for_previous(step)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        rank = dist.get_rank()
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self._group)
        outer_state = outer.state_dict()
        outer_fields, outer_entries, outer_per_rank = _outer_parts(outer_state)
        if rank == 0 and outer_state.get("ledger"):
            write_checkpoint_ledger(tmp, outer_state["ledger"])
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, **outer_entries}
        metadata = {
            "format": FORMAT_VERSION,
            "step": step,
            **outer_fields,
            "world_size": dist.get_world_size(),
            "model_config": self._model_config,
            "config": self._config,
        }
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
        for key, value in outer_per_rank.items():
            torch.save(value, tmp / f"{key}_rank{rank}.pt")
        started = time.perf_counter()
        staged = _host_copy(state)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        staged_s = time.perf_counter() - started
        publish = metadata if rank == 0 else None
        self._in_flight = (step, self._writer.submit(self._write, staged, tmp, final, publish, staged_s))

    def _write(
        self, staged: dict[str, Any], tmp: Path, final: Path, metadata: dict[str, Any] | None, staged_s: float
    ) -> Path | None:
        """In the writer thread: write this rank's part with DCP, which returns on every rank only after rank
        0 has gathered every part and written DCP's .metadata; then rank 0 (the one given ``metadata``)
        publishes the checkpoint."""
        started = time.perf_counter()
        try:
            dcp.save(staged, checkpoint_id=tmp, process_group=self._group)
        except BaseException as err:  # CheckpointException is a BaseException
            if self._abandoned:
                return None
            log.error(
                "checkpoint %s failed (%s): the previous checkpoints are intact", final.name, _first_line(err)
            )
            return None
        if self._abandoned or metadata is None:
            return None
        meta_tmp = tmp / (METADATA + ".part")
        meta_tmp.write_text(json.dumps(metadata, indent=2))
        os.replace(meta_tmp, tmp / METADATA)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info(
            "saved checkpoint %s (training paused %.2f s to stage it, written in %.2f s more)",
            final,
            staged_s,
            time.perf_counter() - started,
        )
        return final

    def _wait_for_previous(self, step: int) -> None:
        if not self.writing:
            return
        started = time.perf_counter()
        previous = self._in_flight[0]
        self.wait()
        log.warning(
            "checkpoint %s was still being written at step %d: training waited %.1f s for it "
            "(a larger --ckpt.interval avoids this)",
            step_dir(self.root, previous).name,
            step,
            time.perf_counter() - started,
        )

    @property
    def writing(self) -> bool:
        """Whether a save is still being written."""
        return self._in_flight is not None and not self._in_flight[1].done()

    def wait(self, timeout: float | None = None) -> Path | None:
        """Wait for the save in flight; return its directory once published (None on ranks other than 0, for
        a failed save, or when none was in flight). Raises ``TimeoutError`` after ``timeout`` seconds."""
        if self._in_flight is None:
            return None
        result = self._in_flight[1].result(timeout=timeout)
        self._in_flight = None
        return result

    def close(self, timeout: float) -> None:
        """End of the saver, on the way out of a run that did not finish (stop signal, error): give the save
        in flight ``timeout`` seconds, then abandon it (it stays a ``.tmp``, never published)."""
        try:
            self.wait(timeout)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            self._abandoned = True
            log.warning(
                "abandoned checkpoint %s (still being written %.0f s after the stop): the previous "
                "checkpoints are intact",
                step_dir(self.root, self._in_flight[0]).name,
                timeout,
            )
        self._writer.shutdown(wait=False)


def _first_line(err: BaseException) -> str:
    """What a person needs of a DCP error: its first line (DCP's run to pages of per-rank tracebacks)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _host_copy(state: Any) -> Any:
    """A copy of ``state`` in host memory that training cannot touch: every tensor copied (a DTensor keeps its
    mesh and placements around a copy of its local shard), everything else deep-copied. (DCP's own stager
    fails on the outer-momentum DTensors, which are views into one flat buffer.)"""
    if isinstance(state, dict):
        return {key: _host_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_host_copy(value) for value in state)
    if isinstance(state, DTensor):
        return DTensor.from_local(
            state.to_local().to("cpu", copy=True, non_blocking=True),
            device_mesh=state.device_mesh,
            placements=state.placements,
            run_check=False,
            shape=state.shape,
            stride=state.stride(),
        )
    if isinstance(state, torch.Tensor):
        return state.to("cpu", copy=True, non_blocking=True)
    return copy.deepcopy(state)


def load(
    path: Path,
    metadata: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: OuterLoop,
) -> int:
    """Restore everything saved in ``path`` into the freshly built objects; return the inner step. Collective.

    The outer loop takes whatever outer state the checkpoint holds (a galaxy may start from a single-cluster
    checkpoint, with fresh momentum, and the other way round, dropping it), after the model: without θ_outer
    in the checkpoint, θ_outer is the model's weights."""
    outer_pieces = _outer_pieces(metadata)
    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP loads into the tensors it is given: zeros placed like the parameters receive the outer pieces
    outer_template = {key: zeros_placed_like_params(model) for key in outer_pieces}
    state = {"model": model_state, "optim": optim_state, **outer_template}
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException: name it
        raise ConfigError(
            f"checkpoint {path} could not be loaded ({_first_line(err)}): it is corrupt or from another "
            "model; resume from another checkpoint"
        ) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = Path(path) / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    outer_state = {key: metadata.get(key, absent) for key, absent in _OUTER_COUNTERS.items()}
    outer_state.update({key: state[key] for key in outer_pieces})
    for key in _OUTER_PER_RANK:
        if (file := Path(path) / f"{key}_rank{dist.get_rank()}.pt").is_file():
            outer_state[key] = torch.load(file, weights_only=True)
    outer_state["ledger"] = read_checkpoint_ledger(Path(path))
    outer.load_state_dict(outer_state)
    return int(metadata["step"])


def export_pretrained(path: Path, out_dir: Path) -> Path:
    """Write a transformers ``save_pretrained`` directory (config + safetensors) from a checkpoint, in one
    process without a process group, so `AutoModelForCausalLM.from_pretrained(out_dir)` loads it offline."""
    from transformers import AutoConfig, AutoModelForCausalLM

    metadata = read_metadata(Path(path))
    model_config = dict(metadata["model_config"])
    model_type = model_config.pop("model_type")
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **model_config), dtype=torch.float32
    )
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "no process group: loading in one process" is the intent here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=Path(path))
    except (Exception, CheckpointException) as err:
        raise ConfigError(f"checkpoint {path} could not be read for export ({_first_line(err)})") from None
    model.load_state_dict(state["model"])
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
