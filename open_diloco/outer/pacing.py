"""How many inner steps this cluster takes between two syncs, and what its pseudo-gradient weighs in the
average: ``--hv.round-steps``.

``equal`` (the default): every cluster takes every step, H per round; every pseudo-gradient weighs 1.

``by-speed``: the galaxy keeps one clock, the **galaxy step** (the trainer's ``step``: H of them per round,
the schedule of syncs, the lr, ``--max-steps``, checkpoints and catching up all count in it). The fastest
cluster takes an inner step at every galaxy step; a slower one takes n of each stride's H/P galaxy steps, n =
the stride × its speed relative to the fastest (rounded, at least 1), spread evenly over the stride, and
passes the others at once. So every cluster reaches a sync after the same wall time, busy all of it, and
nobody waits for the slowest. Each sync's pseudo-gradient enters the average weighted by the inner steps the
cluster took since that fragment's last sync, over H (the weight of a cluster that took every step is 1): with
the same tokens per inner step in every cluster (checked at the round's start), that is a weight by tokens.

Speeds come from the inner-step times the clusters publish in their membership records (the fastest live
cluster's against this cluster's own), or are fixed by ``--hv.cluster-speed``. The plan for a stride is made
when the sync before it starts, agreed by the cluster's ranks (the smallest n any rank computed), so every
rank of a cluster takes the same inner steps. Nothing needs every cluster to agree on the plan: each sends
its own weight with its Δ and the reducer of each span computes the weighted average once, so every cluster
still applies the same bytes.

Why a plan per stride and not a clock per round (train until a deadline): the trainer's step stays the one
clock of the round protocol (round identity, the delay's landing, catching up, checkpoints), a stride needs
one agreement between the ranks instead of one per inner step, and no two machines' clocks are compared.
"""

from __future__ import annotations

from typing import Any

SPEED_TOLERANCE = 0.1
"""A cluster within this share of the fastest one's speed takes every step: step times jitter (two equal
clusters measured each other 20 % apart on a loaded 2-core machine), and a cluster that took the other's
jitter for speed would shorten its rounds for nothing."""


class StepTime:
    """A running mean of the trainer's inner-step seconds, from its records: turns seconds into steps (the
    by-speed plan, how far a cluster that took a later state skips ahead)."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def observe(self, record: dict[str, Any]) -> None:
        if isinstance(seconds := record.get("step_seconds"), float) and seconds > 0:
            self.seconds = seconds if self.seconds is None else 0.8 * self.seconds + 0.2 * seconds


class Pace:
    """This cluster's inner steps per stride and the weight of each sync. ``equal``: every galaxy step trains
    and every weight is 1, whatever is planned."""

    def __init__(self, local_steps: int, fragments: int, by_speed: bool, fixed_speed: float = 0.0):
        self.local_steps, self.fragments = local_steps, fragments
        self.stride = local_steps // fragments
        self.by_speed = by_speed
        self.fixed_speed = fixed_speed
        self.planned = self._steps_for(fixed_speed) if fixed_speed else self.stride
        """Inner steps this cluster takes in the current stride (of ``stride`` galaxy steps)."""
        self.taken = 0
        """Inner steps this cluster took in the run so far: where its data goes on."""
        self.since_sync = [0] * fragments
        """Inner steps taken since each fragment's last sync started: its next sync's weight × H."""

    def trains_at(self, galaxy_step: int) -> bool:
        """Whether this cluster takes an inner step at ``galaxy_step`` (1-based): the ``planned`` steps of a
        stride are spread evenly over it, its last galaxy step (the sync's) always among them."""
        if not self.by_speed:
            return True
        position = (galaxy_step - 1) % self.stride + 1  # 1..stride within the stride
        return position * self.planned // self.stride > (position - 1) * self.planned // self.stride

    def count(self, trained: bool) -> None:
        """One galaxy step passed; ``trained``: this cluster took an inner step in it."""
        if trained:
            self.taken += 1
            self.since_sync = [steps + 1 for steps in self.since_sync]

    def weight_of(self, fragment: int) -> float:
        """The weight of fragment ``fragment``'s sync starting now: 1 with equal steps, else the inner steps
        taken since its last sync over H, in (0, 1] (a sync after no step at all weighs as one step: hivemind
        takes no weight 0 from a peer that averages)."""
        if not self.by_speed:
            return 1.0
        return min(max(self.since_sync[fragment], 1), self.local_steps) / self.local_steps

    def synced(self, fragment: int) -> None:
        """Fragment ``fragment``'s sync started: the steps after it count towards its next one."""
        self.since_sync[fragment] = 0

    def dropped(self) -> None:
        """θ_local went back to θ_outer on every fragment (a held, re-synced or sat-out round): no step
        taken before is behind any next Δ. Why: counted on, a cluster that held for a minute committed
        its next Δ (one stride) as 108 inner steps (chaos soak `intercontinental`, seed 5): its ledger
        work, which decides the heal, and its goodput counted steps whose progress was thrown away."""
        self.since_sync = [0] * self.fragments

    def plan(self, own_seconds: float | None, fastest_seconds: float | None) -> int:
        """The inner steps to take in the next stride: the stride × this cluster's speed relative to the
        fastest (``--hv.cluster-speed``, else the seconds per inner step of the fastest live cluster over this
        one's own); every step when a speed is unknown. Not yet agreed with the other ranks: see
        :meth:`agree`."""
        if not self.by_speed:
            return self.stride
        if self.fixed_speed:
            return self._steps_for(self.fixed_speed)
        if not own_seconds or not fastest_seconds or own_seconds <= 0 or fastest_seconds <= 0:
            return self.stride
        speed = fastest_seconds / own_seconds
        return self.stride if speed >= 1 - SPEED_TOLERANCE else self._steps_for(speed)

    def agree(self, planned: int) -> None:
        """Take the plan the cluster's ranks agreed on (the smallest any rank made) for the next stride."""
        self.planned = max(1, min(planned, self.stride))

    def _steps_for(self, speed: float) -> int:
        return max(1, min(self.stride, round(self.stride * speed)))

    def resume_at(self, galaxy_step: int) -> None:
        """Equal steps, resumed from a checkpoint at ``galaxy_step``: the inner steps each fragment took since
        its last sync started, which such a checkpoint does not keep (every step was trained, and sync n
        started at step n · stride with fragment (n − 1) mod P), so that the next syncs say the steps behind
        them as the straight run's do."""
        if self.by_speed:
            return
        started = galaxy_step // self.stride
        for fragment in range(self.fragments):
            if started < fragment + 1:
                self.since_sync[fragment] = galaxy_step
            else:
                last = started - (started - (fragment + 1)) % self.fragments
                self.since_sync[fragment] = galaxy_step - last * self.stride

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint must keep to go on with the same steps (``None`` with equal steps: nothing)."""
        if not self.by_speed:
            return None
        return {"planned": self.planned, "taken": self.taken, "since_sync": list(self.since_sync)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take :meth:`state_dict`'s values. A checkpoint without them (saved with equal steps) took every
        step up to its galaxy step: :meth:`data_position` says so."""
        if not self.by_speed:
            return
        if not state:
            self.taken = -1  # every step so far: known once the trainer says where it resumes
            return
        self.planned = max(1, min(int(state["planned"]), self.stride))
        self.taken = int(state["taken"])
        saved = [int(steps) for steps in state["since_sync"]]
        self.since_sync = saved if len(saved) == self.fragments else [min(saved, default=0)] * self.fragments

    def data_position(self, galaxy_step: int) -> int:
        """The inner steps this cluster took up to ``galaxy_step``, where its data goes on: the galaxy step
        itself with equal steps (then also after catching up with the galaxy: the steps it skipped are its
        own data's too), the count with ``by-speed``."""
        if not self.by_speed:
            return galaxy_step
        if self.taken < 0:
            self.taken = galaxy_step
        return self.taken
