"""The DiLoCo outer loop, in pure torch. It talks to the galaxy through the :class:`Averager` protocol and
imports nothing from hivemind, so the math is unit-testable with an in-process averager."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class RoundReport:
    """What one all-reduce of one shard did.

    ``peers`` maps each participating cluster's galaxy rank to the metadata it sent with the round
    (its ``fingerprint``: e.g. the hash of its θ_outer shard before the round), so every cluster can check
    that it and every other cluster started the round from the same weights.
    """

    group_size: int
    """Clusters whose pseudo-gradient went into the average (this one included)."""
    complete: bool
    """True when every span of the buffer was averaged over the whole group (no failed reducer)."""
    peers: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


class Averager(Protocol):
    """Averages one FSDP shard's flat fp32 buffer with the same shard of every other cluster."""

    def all_reduce(self, buffer: torch.Tensor, round_id: int, fingerprint: dict[str, Any]) -> RoundReport:
        """Replace ``buffer`` (flat, fp32, CPU, contiguous) in place by the galaxy average.

        Promise: every participant of the round ends with *bitwise-identical* contents (a canonical result,
        not ``own + (avg - own)``), also under compression. On a failed or partial round the report says so;
        the buffer then holds whatever could be averaged and the caller decides what to do.
        """
        ...

    def serve_state(self, get_state: Any) -> None:
        """Let late joiners download the outer state: ``get_state()`` returns ``(metadata, tensors)``."""
        ...

    def download_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Fetch ``(metadata, tensors)`` from a peer serving this shard; ``None`` when none answers in time."""
        ...

    def shutdown(self) -> None:
        """Stop the averager and its DHT; idempotent; leaves no process behind."""
        ...


class OuterLoop(Protocol):
    """What the trainer calls after every inner step."""

    def after_inner_step(self, inner_step: int) -> dict[str, Any]:
        """Run an outer step if ``inner_step`` (1-based) ends a round; return its metrics, else ``{}``."""
        ...

    def close(self) -> None: ...


class NullOuterLoop:
    """No galaxy: plain data-parallel training inside the cluster."""

    def after_inner_step(self, inner_step: int) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
