"""The snapshots a cluster holds for striped state downloads (``galaxy/striped_download.py``): the server's
side, in the averager's process; no hivemind here.

Why pin: a striped download asks one server for many parts over seconds or minutes, while the server trains
on and commits rounds. Every part must come from the same state, so the first request takes one snapshot
(through the trainer's ``get_state``, as hivemind's own download does) and keeps it for its outer step; parts
are cut from that. Memory stays bounded: at most :data:`MAX_PINS` snapshots, each dropped after
:data:`PIN_IDLE_SECONDS` without a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from open_diloco.galaxy.stripe_plan import MIN_PART_BYTES, PART_BYTES, split_into_parts
from open_diloco.outer.digests import fingerprint_bytes

PIN_IDLE_SECONDS = 30.0
"""A snapshot nobody asked for a part of for this long is dropped."""
MAX_PINS = 2
"""Snapshots kept at once (the least recently asked goes first): joiners at two outer steps, at most."""


@dataclass
class Pin:
    """One snapshot of the served state, and the hashes of its parts for every part size asked so far."""

    metadata: dict[str, Any]
    tensors: list[torch.Tensor]
    used: float
    hashes: dict[int, list[list[str]]] = field(default_factory=dict)

    @property
    def outer_step(self) -> Any:
        return self.metadata.get("outer_step")

    def part_values(self, part_bytes: int) -> list[int]:
        """How many values of each tensor make a part of ``part_bytes`` (clamped to the allowed sizes)."""
        part_bytes = max(MIN_PART_BYTES, min(PART_BYTES, int(part_bytes)))
        return [max(1, part_bytes // tensor.element_size()) for tensor in self.tensors]

    def describe(self, part_bytes: int) -> dict[str, Any]:
        """What a downloader needs before the parts: the state's metadata, each tensor's shape and dtype, the
        part size and the hash of every part (per tensor, in order)."""
        if part_bytes not in self.hashes:
            values = self.part_values(part_bytes)
            parts = split_into_parts([tensor.numel() for tensor in self.tensors], values)
            hashes: list[list[str]] = [[] for _ in self.tensors]
            for part in parts:
                hashes[part.tensor].append(fingerprint_bytes(self.flat(part.tensor)[part.start : part.end]))
            self.hashes[part_bytes] = hashes
        return dict(
            metadata=self.metadata,
            shapes=[list(tensor.shape) for tensor in self.tensors],
            dtypes=[str(tensor.dtype).removeprefix("torch.") for tensor in self.tensors],
            part_values=self.part_values(part_bytes),
            hashes=self.hashes[part_bytes],
        )

    def flat(self, index: int) -> torch.Tensor:
        return self.tensors[index].reshape(-1)

    def part(self, index: int, start: int, end: int) -> torch.Tensor | None:
        """Values ``start:end`` of tensor ``index``; ``None`` for a request out of bounds or over the largest
        part (a confused or hostile caller)."""
        if not 0 <= index < len(self.tensors):
            return None
        numel = self.tensors[index].numel()
        if not (0 <= start < end <= numel) or (end - start) * self.tensors[index].element_size() > PART_BYTES:
            return None
        return self.flat(index)[start:end]


class StatePins:
    """The pinned snapshots by outer step (see the module docstring)."""

    def __init__(self, idle_seconds: float = PIN_IDLE_SECONDS, max_pins: int = MAX_PINS):
        self.idle_seconds, self.max_pins = idle_seconds, max_pins
        self._pins: dict[Any, Pin] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, outer_step: Any, now: float) -> Pin | None:
        """The snapshot pinned at ``outer_step``, marked used now; ``None`` when there is none (never pinned,
        or dropped)."""
        self.drop_idle(now)
        pin = self._pins.get(outer_step)
        if pin is not None:
            pin.used = now
        return pin

    def add(self, pin: Pin, now: float) -> Pin:
        """Keep ``pin`` under its outer step (the one already there wins: parts already served came from it),
        dropping the least recently used beyond :attr:`max_pins`."""
        self.drop_idle(now)
        kept = self._pins.setdefault(pin.outer_step, pin)
        kept.used = now
        while len(self._pins) > self.max_pins:
            oldest = min(self._pins, key=lambda step: self._pins[step].used)
            del self._pins[oldest]
        return kept

    def drop_idle(self, now: float) -> None:
        """Forget every snapshot not asked for within :attr:`idle_seconds`."""
        for step in [step for step, pin in self._pins.items() if now - pin.used > self.idle_seconds]:
            del self._pins[step]
