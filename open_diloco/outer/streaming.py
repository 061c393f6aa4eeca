"""When each fragment of the model syncs, and when its outer update lands: the schedule of streaming DiLoCo.

Each shard's flat θ_outer is cut into ``--hv.fragments`` P slices of equal length (the last one padded with
zeros on the wire), so every all-reduce has the same size and one averager per shard serves them all. Fragment
f syncs every H inner steps, offset by f·H/P: sync *k* (1-based, counted over all fragments) starts at inner
step k·H/P and averages fragment (k − 1) mod P. With P = 1 that is every H steps, as plain DiLoCo.

A sync's all-reduce runs in the background for ``--hv.sync-delay`` τ inner steps; its outer update lands after
inner step k·H/P + τ. τ ≤ H/P, so one sync at most is in flight at any time (one averager per shard suffices),
and a fragment's update has always landed before its next sync starts. At τ = H/P a sync lands at the very
step the next one starts (landing first): the network is never idle, and a fragment's all-reduce has a whole
stride of H/P inner steps to hide in, which is what hides a round whose all-reduce takes as long as its
compute (docs/overlap.md). The outer step counter (``outer_step``) counts syncs; a fragment's own round
number (which the outer warm-up and a sparse codec's selection follow) is ``outer_step // P + 1``.

What the τ inner steps did to the fragment is mixed in, not dropped: when the update lands, the fragment
becomes α·θ_local + (1 − α)·θ_outer_new, α = ``--hv.sync-alpha`` (0.5; torchft's ``fragment_update_alpha``,
Streaming DiLoCo's mixing). On the quality yardstick (docs/results/overlap.md) the mix at 0.5 ended level with
blocking DiLoCo, while re-applying the τ steps on top of θ_outer_new (θ_outer_new + θ_local −
θ_local_at_start, so that every step enters the galaxy exactly once) ended worse and varied more across seeds
(our reading: those steps were taken from a point the galaxy has since left, and moving them whole onto the
new one adds the cluster's own drift back); dropping them (α = 0) was worse too.
"""

from __future__ import annotations

from dataclasses import dataclass


def fragment_length(numel: int, fragments: int) -> int:
    """Values per fragment of a shard of ``numel`` values: what one all-reduce carries (the last fragment is
    shorter; its wire buffer is padded with zeros)."""
    return -(-numel // fragments)


@dataclass(frozen=True)
class SyncSchedule:
    """``--hv.local-steps`` H, ``--hv.fragments`` P and ``--hv.sync-delay`` τ as a schedule of inner steps."""

    local_steps: int
    fragments: int = 1
    sync_delay: int = 0

    @property
    def stride(self) -> int:
        """Inner steps between two syncs (of successive fragments): H/P."""
        return self.local_steps // self.fragments

    @property
    def streaming(self) -> bool:
        """Whether the model may differ from θ_outer at a sync boundary (fragments, or a delay): a checkpoint
        then stores θ_outer itself."""
        return self.fragments > 1 or self.sync_delay > 0

    def starts_sync(self, inner_step: int) -> bool:
        """Whether a sync starts after ``inner_step`` (1-based)."""
        return inner_step % self.stride == 0

    def fragment_of(self, outer_step: int) -> int:
        """The fragment the next sync averages, after ``outer_step`` syncs."""
        return outer_step % self.fragments

    def fragment_round(self, outer_step: int) -> int:
        """The next sync's round of its own fragment (1-based), after ``outer_step`` syncs."""
        return outer_step // self.fragments + 1

    def inner_step_of(self, outer_step: int) -> int:
        """The inner step sync number ``outer_step`` started at (where a cluster that adopts that state goes
        on)."""
        return outer_step * self.stride
