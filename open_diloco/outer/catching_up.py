"""How a cluster takes the galaxy's state instead of its own progress: joining (a late start, a resume from
an older checkpoint), re-syncing (a round sat out, a round taken from a later state), catching up with the
galaxy's inner step after it, and ending the run on the galaxy's final θ_outer. Every path takes the state
from one source (``outer/adoption.py``), with the chain that ends at it (``outer/committed_state.py``)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from open_diloco.outer.adoption import Downloaded
from open_diloco.outer.final_round import FinalVerdict, final_step, final_verdict
from open_diloco.outer.protocols import Membership
from open_diloco.outer.round_result import RoundResult

if TYPE_CHECKING:
    from open_diloco.config import HvConfig
    from open_diloco.outer.adoption import StateAdoption
    from open_diloco.outer.cluster import ClusterComm
    from open_diloco.outer.committed_state import CommittedState
    from open_diloco.outer.pacing import StepTime
    from open_diloco.outer.protocols import Averager, StatusBoard
    from open_diloco.outer.streaming import SyncSchedule

FINAL_CHECK_SECONDS = 15.0
"""How long a finished cluster waits for the others' records to reach its last outer step
(:meth:`CatchUp.verify_final`)."""


class CatchUp:
    """One cluster's ways to take the galaxy's state (see the module docstring)."""

    def __init__(
        self,
        hv: HvConfig,
        committed: CommittedState,
        averager: Averager,
        cluster: ClusterComm,
        adoption: StateAdoption,
        schedule: SyncSchedule,
        status: StatusBoard,
        step_time: StepTime,
        warn: Any,
    ):
        self.hv, self.committed, self.state = hv, committed, committed.state
        self.averager, self.cluster, self.adoption = averager, cluster, adoption
        self.schedule, self.status, self.step_time, self.warn = schedule, status, step_time, warn
        self.galaxy_rank = hv.world_rank
        self.catch_up_step = 0
        """Where the trainer goes on after this cluster adopted a state the galaxy is already training past
        (:meth:`_catch_up_target`); 0 when it goes on from the adopted round's start."""
        self.took_state = False
        """A round took another cluster's state since the trainer last asked (:meth:`clock_after`)."""
        self.rewind_to: int | None = None
        """Where the trainer goes back to: a round held, or a take found this cluster's clock past the
        galaxy's (:meth:`clock_after`)."""

    @property
    def outer_step(self) -> int:
        return self.state.outer_step

    def take_newer(self) -> Downloaded | None:
        """At the start of a run: wait (up to ``--hv.join-timeout``) for the records of the other clusters to
        show up (a cluster that starts beside running ones must not train alone from scratch because the DHT
        had not answered yet); once any other cluster's record is seen, download and take the state only if
        one of them is ahead: its chain holds more committed work (or as much, further on). Nothing is
        downloaded when no cluster is ahead: the records carry each cluster's outer step and work."""
        if self.hv.alone or self.hv.skip_load_from_peers:
            return None
        deadline = time.monotonic() + self.hv.join_timeout
        while True:
            view = self.averager.membership()
            own = (self.committed.work, self.outer_step)
            ahead_here = any(
                (view.works.get(rank, 0), step) > own
                for rank, step in view.steps.items()
                if rank != self.galaxy_rank
            )
            # someone's record came
            known = -self.cluster.min_int(-len(set(view.reported) - {self.galaxy_rank}))
            if not self.cluster.all_true(not ahead_here):  # any rank saw a cluster ahead
                got = self.adoption.download(0, max(1.0, deadline - time.monotonic()))
                if got is not None:
                    self.committed.take(got)
                return got
            if known or not self.cluster.all_true(time.monotonic() + 1.0 < deadline):
                return None
            time.sleep(1.0)

    def inner_step_of_galaxy(self) -> int:
        return max(self.schedule.inner_step_of(self.outer_step), self.catch_up_step)

    def _catch_up_target(self) -> int:
        """The inner step to go on from after adopting the state of a galaxy that was ahead: as far as the
        lead cluster has come since (its status record, moved on by the record's age at our step time), but at
        least a quarter of --hv.averaging-timeout of steps before the next sync.

        Why: a cluster that sat a round out (a side of a healed partition, a slow cluster) adopts the state at
        the galaxy's latest round, while the lead cluster is already that far into the next one. Training the
        whole stride again, it would reach the next sync that much later than the lead cluster, which waits at
        most --hv.averaging-timeout for it: behind by more, it sits out again, round after round. Skipping
        those steps (their batches are not trained on, as for a late joiner) puts it at the sync with the
        others, and its Δ of fewer steps enters that round's average. The margin keeps it inside the lead's
        wait when the lead is already waiting at the sync. The same on every rank of the cluster."""
        start, next_sync = (
            self.schedule.inner_step_of(self.outer_step),
            self.schedule.inner_step_of(self.outer_step + 1),
        )
        target = start
        if not self.hv.alone and self.step_time.seconds:
            view = self.averager.membership()
            if view.lead == self.outer_step and view.lead_inner_step > start:
                lead_now = view.lead_inner_step + int(view.lead_seen_seconds / self.step_time.seconds)
                margin = max(1, math.ceil(self.hv.averaging_timeout / 4 / self.step_time.seconds))
                target = max(start, min(lead_now, next_sync - margin))
        return self.cluster.min_int(target)

    def catch_up(self) -> None:
        """After taking the state of a galaxy that trains past it, go on where it is
        (:meth:`_catch_up_target`)."""
        self.catch_up_step = self._catch_up_target()
        self.took_state = True
        if self.catch_up_step > self.schedule.inner_step_of(self.outer_step):
            self.warn(
                f"outer step {self.outer_step}: the galaxy is already training towards the next sync: "
                f"this cluster goes on from inner step {self.catch_up_step} to meet it there"
            )

    def clock_after(self, inner_step: int, sync_started: bool, last: bool, held: bool = False) -> int | None:
        """After the rounds of galaxy step ``inner_step``: where this cluster's clock left the galaxy's, the
        galaxy step to go back to (also :attr:`rewind_to`); ``None`` when it did not. ``held``: a round held
        (no quorum, ``outer/quorum.py``): its stride is dropped, so the clock goes back a stride and the
        round's next attempt starts where the round did. After a round took a state: where this cluster's
        clock stands past the galaxy's. ``sync_started``: the round after it started at this step (a landing
        at ``--hv.sync-delay`` = H/P, with the galaxy's: then the galaxy's clock is that round's start); else
        the galaxy's next sync is ahead, and a cluster at or past it would meet it a stride late: back to the
        catch-up target.

        Why: a cluster that held (a side of a partition without a quorum, a survivor while the other cluster
        of two restarts) trained a stride a round at its own pace and without the rounds' waits, so its clock
        ran ahead of the galaxy's: it met the galaxy's next round a stride late (the galaxy waited
        ``--hv.averaging-timeout`` in vain and it took the state again), or, in step with the rounds at τ =
        H/P, reached ``--max-steps`` rounds before the galaxy and ended on its own θ. The held strides were
        dropped (nothing of them is in θ_outer): going back loses nothing of the galaxy's, and their batches
        are trained again. The same on every rank of the cluster (the target is agreed, the rest is the
        cluster's shared state). Not at the run's last step: the end of a run takes the galaxy's final θ
        anyway."""
        took, self.took_state = self.took_state, False
        next_sync = self.schedule.inner_step_of(self.outer_step + 1)
        if last or not (took or held):
            return None
        if not took:  # held: this round again, a stride back
            back_to: int | None = inner_step - self.schedule.stride
        elif sync_started:
            back_to = next_sync if inner_step > next_sync else None
        else:
            back_to = self.inner_step_of_galaxy() if inner_step >= next_sync else None
        if back_to is not None:
            self.rewind_to = back_to
            if took:
                self.warn(
                    f"outer step {self.outer_step}: this cluster's clock ran past the galaxy's while it was "
                    f"apart: back from inner step {inner_step} to {back_to}, the galaxy's"
                )
        return back_to

    def resync(self, at_least: int, why: str) -> Downloaded | None:
        """Take the state of the galaxy's most advanced live cluster, at outer step ``at_least`` or later,
        within ``--hv.join-timeout`` (from one source, ``outer/adoption.py``); ``None`` (state kept) when none
        came."""
        got = self.adoption.download(at_least, self.hv.join_timeout)
        if got is not None:
            previous = self.outer_step
            self.committed.take(got)
            self.warn(
                f"outer step {previous}: {why}: adopted cluster {got.source}'s state at outer step {got.step}"
            )
        else:
            self.warn(f"outer step {self.outer_step}: {why} and re-sync failed")
        return got

    def settle_final(self, last: RoundResult) -> RoundResult | None:
        """At the end of the run, after its ``last`` round: end on the galaxy's final θ_outer
        (``outer/final_round.py``). Wait for the clusters still training behind this one to reach its outer
        step (:data:`FINAL_CHECK_SECONDS`, or ``--hv.final-wait`` when longer) and for those gone silent to
        come back (``--hv.final-wait``); if more clusters end at this outer step on another θ_outer (ties: the
        side of the lowest galaxy rank), take it from one of them, every rank from the same source, before the
        final checkpoint. Returns that re-sync's result (``None``: this cluster already holds it)."""
        if self.hv.alone:
            return None
        # this cluster's rounds are over: say so now, so that no cluster takes its state as the galaxy's lead
        # (that would hand the galaxy to the side that trained alone) while it waits
        work = self.committed.work
        self.status.update(
            {
                "outer_step": self.outer_step,
                "param_hash": last.param_hash,
                "committed_work": work,
                "state": "finished",
            }
        )
        view = self._final_view()
        end_work, ends_at = final_step(view, self.galaxy_rank, self.outer_step, work)
        # rank 0's view may lag: the furthest any rank read (the most work, then the furthest step at it)
        most_work = -self.cluster.min_int(-end_work)
        ends_at = -self.cluster.min_int(-(ends_at if end_work == most_work else -1))
        own_hash = last.param_hash if ends_at == self.outer_step else None
        verdict = final_verdict(view, self.galaxy_rank, ends_at, own_hash, work)
        source = verdict.source_for(self.galaxy_rank, view)
        chosen = self.cluster.gather_strings("" if source is None else str(source))[0]  # rank 0's
        if not chosen:
            if self.galaxy_rank in verdict.winners and verdict.losers:
                self._serve_until_taken(verdict)
            return None
        sides = (
            f"{len(verdict.winners)} cluster(s) {sorted(verdict.winners)} against {sorted(verdict.losers)}"
        )
        got = self.adoption.download(
            ends_at, self.hv.join_timeout, exact=ends_at, only=frozenset({int(chosen)})
        )
        behind = ends_at > self.outer_step
        why = (
            f"the galaxy went on to outer step {ends_at} after this cluster's last round"
            if behind
            else f"the galaxy split and its larger side wins ({sides})"
        )
        if got is None or got.step != ends_at:
            self.warn(
                f"the run ends at outer step {self.outer_step}, not on the galaxy's final θ_outer ({why}): "
                f"cluster {chosen}'s could not be downloaded"
            )
            return None
        self.committed.take(got)
        self.state.scatter_into_model()
        self.state.local_at_start = None
        dropped = "" if behind else "; this cluster's own rounds since the split are dropped"
        self.warn(
            f"the run ends at outer step {self.outer_step} on cluster {got.source}'s θ_outer: {why}{dropped}"
        )
        return RoundResult(
            outcome="resynced",
            outer_step=self.outer_step,
            fragment=last.fragment,
            param_hash=self.committed.cluster_hash(),
            param_checksum=self.cluster.sum_float(self.state.sq_norm()),
            galaxy_alive=last.galaxy_alive,
            state_source=got.source,
            ledger=self.committed.held_entry(),
            committed_work=self.committed.work,
            ledger_dropped=self.committed.pop_dropped(),
        )

    def _serve_until_taken(self, verdict: FinalVerdict) -> None:
        """A cluster of the winning side keeps serving its final state (its averagers up, this rank here)
        until every cluster of the smaller side shows the winning hash, or ``--hv.join-timeout`` passes: the
        smaller side often finished first and is waiting for exactly this state."""
        deadline = time.monotonic() + self.hv.join_timeout
        while time.monotonic() < deadline:
            reported = self.averager.membership().reported
            if all(
                reported.get(rank, (-1, None, False))[1] == verdict.winner_hash for rank in verdict.losers
            ):
                return
            time.sleep(1.0)

    def _final_view(self) -> Membership:
        """The membership once no other cluster is still training (waited for up to
        ``max(FINAL_CHECK_SECONDS, --hv.final-wait)``: behind this one's outer step, or at it and past it on
        its last rounds) and none went silent less than ``--hv.final-wait`` ago (waited for up to that too).
        Why the recent ones: a cut across the run's end is back within minutes, and a cluster that comes back
        to a finished galaxy ends on its final state (``adoption._galaxy_finished``) only while the finished
        clusters still serve it; a crash is never back, and one long past costs no wait."""
        started = time.monotonic()
        while True:
            view = self.averager.membership()
            others = {rank: seen for rank, seen in view.reported.items() if rank != self.galaxy_rank}
            training = any(live for _, _, live in others.values())
            recent = {
                rank
                for rank in view.silent - {self.galaxy_rank}
                if view.silent_seconds.get(rank, 0.0) < self.hv.final_wait
            }
            waited = time.monotonic() - started
            # no record of any other cluster is a read that failed (records outlive their clusters by an
            # hour), not a galaxy gone: a DHT read that met a cut-off node came back empty, and the cluster
            # ended at once without waiting for it (seen in the test of a cut across the run's end)
            unread = not others and waited < FINAL_CHECK_SECONDS
            if (
                not unread
                and (not training or waited >= max(FINAL_CHECK_SECONDS, self.hv.final_wait))
                and (not recent or waited >= self.hv.final_wait)
            ):
                return view
            time.sleep(1.0)

    def verify_final(self, param_hash: str, seconds: float = FINAL_CHECK_SECONDS) -> list[int] | None:
        """At the end of a finished run, compare this cluster's final θ_outer (``param_hash``) with every
        other cluster that ends at the same outer step, as their records show them: wait (``seconds`` at most)
        until every cluster still training is at least this far, then name the ones whose hash differs in one
        warning. The hash check of a round compares where rounds *start*, so without this a last round that
        came out differently in two clusters would go unnoticed; and a run that ends with nobody to compare
        with while a cluster went silent (crashed, or cut off and training on alone: a partition that outlasts
        the run) says so too. Returns the clusters compared equal (``None``: none)."""
        if self.hv.alone:
            return None
        deadline = time.monotonic() + seconds
        while True:
            membership = self.averager.membership()
            reported = {rank: seen for rank, seen in membership.reported.items() if rank != self.galaxy_rank}
            waiting = [rank for rank, (step, _, live) in reported.items() if live and step < self.outer_step]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        same = [
            rank
            for rank, (step, theirs, _) in reported.items()
            if step == self.outer_step and theirs == param_hash
        ]
        differ = [
            rank
            for rank, (step, theirs, _) in reported.items()
            if step == self.outer_step and theirs is not None and theirs != param_hash
        ]
        if differ:
            self.warn(
                f"the run ends at outer step {self.outer_step} with a θ_outer unlike that of cluster(s) "
                f"{differ} ({param_hash} here): the galaxy's last rounds split; resume every cluster from "
                "the checkpoint of the cluster you trust, or compare their exports"
            )
        elif not same and (silent := sorted(membership.silent - {self.galaxy_rank})):
            self.warn(
                f"the run ends at outer step {self.outer_step} with no other cluster confirming its θ_outer "
                f"({param_hash} here): cluster(s) {silent} went silent (crashed, or cut off and training on "
                "alone); compare their final param_hash with this one before trusting either"
            )
        return same or None
