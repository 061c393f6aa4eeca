"""What the trainer (and the checkpoint) need from the outer loop (:class:`OuterLoop`), and the loop of a run
without a galaxy (:class:`NullOuterLoop`): the trainer never asks ``if enabled:``. ``outer/diloco.py``'s
``DiLoCo`` is the real one."""

from __future__ import annotations

from typing import Any, Protocol

from open_diloco.outer.round_result import RoundResult


class OuterLoop(Protocol):
    """What the trainer (and the checkpoint) call: once to join the galaxy, then after every inner step."""

    outer_step: int
    """Outer steps applied so far (the galaxy's round counter)."""

    fragments: int
    """``--hv.fragments``: the slices of θ_outer that sync in turn (1: the whole model at once)."""

    def join_galaxy(self) -> int:
        """Adopt the galaxy's current state if it is ahead; return the inner step to continue after."""
        ...

    joined: dict[str, Any] | None
    """After :meth:`join_galaxy`: the metrics record of the state it took then (``{"event": "took_state",
    "galaxy_outer_step", "state_source"}``: what this cluster trained before is gone, which no sync record
    says), ``None`` when it took none."""

    def trains_at(self, inner_step: int) -> bool:
        """Whether this cluster takes an inner step at galaxy step ``inner_step`` (1-based): always, unless
        ``--hv.round-steps by-speed`` plans fewer steps for a slower cluster (``outer/pacing.py``)."""
        ...

    def data_position(self, inner_step: int) -> int:
        """The inner steps this cluster took up to galaxy step ``inner_step``: where its data goes on (the
        galaxy step itself unless ``--hv.round-steps by-speed``)."""
        ...

    def page_at(self, inner_step: int) -> int | None:
        """The page galaxy step ``inner_step`` reads (elastic galaxy: :meth:`pages_from`), else ``None``."""
        ...

    def pages_from(self, inner_step: int) -> list[int] | None:
        """The pages the ledger dealt this cluster for its inner steps from galaxy step ``inner_step`` on, as
        far as they are known (an elastic galaxy: ``outer/deal.py``); ``None``: the data is not dealt (the
        cluster reads its own part, positioned by :meth:`data_position`)."""
        ...

    def syncs_after_inner_step(
        self, inner_step: int, last: bool = False, trained: bool = True
    ) -> list[RoundResult]:
        """Land the sync in flight when its delay is over (or, with ``last``, at once), start a sync if
        ``inner_step`` (1-based, a galaxy step) is on the schedule; return the metrics of every round that
        ended, oldest first (most steps none, a sync's landing one; two when ``--hv.sync-delay`` = H/P lands
        a sync at the step the next starts and that one ends at once as well). ``trained``: this cluster took
        an inner step at it (:meth:`trains_at`)."""
        ...

    def settle_run(self) -> RoundResult | None:
        """After the run's last round was logged: end on the galaxy's final θ_outer, before the final
        checkpoint (a cluster of the smaller side of a split galaxy takes the larger side's). Returns that
        re-sync's result, a record of its own (``None``: this cluster already holds it)."""
        ...

    def inner_step_of_galaxy(self) -> int:
        """The inner step the galaxy's current round started at (a cluster behind it catches up)."""
        ...

    def go_on_from(self, inner_step: int) -> int:
        """The galaxy step the trainer goes on from after galaxy step ``inner_step`` and its rounds:
        ``inner_step`` itself, unless a round held (a stride back: its stride is trained again) or took a
        state while this cluster's clock was not the galaxy's: behind it (the galaxy trains past that state:
        catch up), or past it (the clock ran on while it held or sat out: go back)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the outer loop, as torch.distributed.checkpoint's ``Stateful`` gives it:
        ``outer_step`` and ``fragments``; each per-value buffer it holds (``outer/stateful.py``'s ``PIECES``:
        the outer momentum, the error feedback; θ_outer and a round in flight's start where the model may
        differ from θ_outer at a save) as one tensor per parameter, placed like the parameter so that DCP
        reshards it; this rank's ``sparse_scores`` when kept (cut from its shard: not reshardable). A piece it
        does not hold is absent; ``{}``: no outer state (no galaxy). Views where it can: copy before the state
        changes."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take what :meth:`state_dict` gave, or the part of it a checkpoint of another kind of run holds,
        once the model's own state is loaded (θ_outer is the model's weights unless ``outer_params`` is
        there); a round in flight is sent again by :meth:`join_galaxy`."""
        ...

    def report(self, record: dict[str, Any]) -> None:
        """Take this cluster's record of an inner step (the metrics record), or ``{"state": ...}`` once at the
        end, for the galaxy's status board; no I/O on the caller's thread."""
        ...

    def close(self) -> None:
        """Leave the galaxy; idempotent and bounded in time."""
        ...


class NullOuterLoop:
    """No galaxy: plain data-parallel training inside the cluster."""

    outer_step = 0
    fragments = 1
    joined = None

    def join_galaxy(self) -> int:
        return 0

    def inner_step_of_galaxy(self) -> int:
        return 0

    def go_on_from(self, inner_step: int) -> int:
        return inner_step

    def trains_at(self, inner_step: int) -> bool:
        return True

    def data_position(self, inner_step: int) -> int:
        return inner_step

    def page_at(self, inner_step: int) -> int | None:
        return None

    def pages_from(self, inner_step: int) -> list[int] | None:
        return None

    def syncs_after_inner_step(
        self, inner_step: int, last: bool = False, trained: bool = True
    ) -> list[RoundResult]:
        return []

    def settle_run(self) -> RoundResult | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def report(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
