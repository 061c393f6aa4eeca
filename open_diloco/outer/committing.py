"""How one round of a cluster runs and ends: :meth:`Committing.start_round` computes the pseudo-gradient and
launches the galaxy average; :meth:`Committing.finish_round` waits for it and commits it, or takes it from a
cluster that did, or runs it again (``outer/round.py`` has the rule, ``docs/round-protocol.md`` the whole
story). Every branch runs the same collectives on every rank of the cluster (:class:`ClusterComm`), so every
shard follows the same path. :class:`Committing` is a part of :class:`~open_diloco.outer.diloco.DiLoCo` (its
attributes are DiLoCo's)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from open_diloco.errors import GalaxyError, GalaxyMismatch, RoundFailed
from open_diloco.outer.codecs import all_finite
from open_diloco.outer.digests import combine_hashes
from open_diloco.outer.guard import valid_claim, valid_weight, wire_norm
from open_diloco.outer.policy import Decision, RoundOutcome
from open_diloco.outer.protocols import MEMBERSHIP_READ_SECONDS, AloneRound, PendingRound, RoundReport
from open_diloco.outer.round import RoundInFlight, RoundResult, RoundView

if TYPE_CHECKING:
    from open_diloco.config import HvConfig
    from open_diloco.outer.cluster import ClusterComm
    from open_diloco.outer.guard import NormHistory
    from open_diloco.outer.policy import RoundPolicy
    from open_diloco.outer.protocols import Averager, StatusBoard
    from open_diloco.outer.state import OuterState


class Committing:
    """DiLoCo's round: start, wait, agree, commit (see the module docstring)."""

    hv: HvConfig
    state: OuterState
    averager: Averager
    cluster: ClusterComm
    status: StatusBoard
    policy: RoundPolicy
    norm_history: NormHistory
    galaxy_rank: int
    warn: Any
    bad_rounds: int
    _alive_before: int
    _round_weight: float
    _fastest_seconds: float | None
    changing_state: Any  # DiLoCo's, as the three below
    cluster_hash: Any
    _record_commit: Any
    own_round_metadata: Any

    @torch.no_grad()
    def start_round(self, attempts: int = 0) -> RoundInFlight:
        """Δ = θ_outer − θ_local into the averager's buffer, then launch the galaxy average of it (attempt
        ``attempts`` of the round). Every rank runs the same collectives whatever happens on it."""
        own_hash = self.state.hash()
        alive, lead, silent, galaxy_attempt = self._membership()
        attempts = max(attempts, galaxy_attempt)  # join the galaxy's current attempt, not one nobody is in
        self.status.update({"round_attempt": [self.outer_step + 1, attempts]})
        # the galaxy applied rounds without this cluster (a late joiner, a healed cut)
        if lead > self.outer_step:
            return RoundInFlight(None, own_hash, float("nan"), alive, attempts, lead=lead, silent=silent)
        with contextlib.ExitStack() as held:
            pseudo_grad = self._locked_buffer(held)
            if pseudo_grad is None:
                error = "the averager is still busy with a previous round"
                return RoundInFlight(
                    None, own_hash, float("nan"), alive, attempts, start_error=error, silent=silent
                )
            local_sq = self.state.pseudo_grad_for_wire_into(pseudo_grad)
            finite = math.isfinite(local_sq)
            # the claim the reducers hold our parts to: the norm of exactly what is sent (guard.py)
            claim = (
                math.sqrt(local_sq) if self.state.compressor is None or not finite else wire_norm(pseudo_grad)
            )
        if not self.cluster.all_true(finite):  # never sent: it would poison every cluster
            return RoundInFlight(
                None, own_hash, local_sq, alive, attempts, diverged=True, lead=lead, silent=silent
            )
        theta_norm = math.sqrt(self.state.sq_norm())
        bound = self.norm_history.bound(theta_norm, self._round_weight)
        if not self.cluster.all_true(bound is None or claim <= bound):  # finite, but blown up: not sent
            return RoundInFlight(
                None,
                own_hash,
                local_sq,
                alive,
                attempts,
                bound=bound,
                out_of_bound=True,
                lead=lead,
                silent=silent,
            )
        fingerprint = {
            "param_hash": own_hash,
            "numel": self.state.numel,
            "delta_norm": claim,
            "theta_norm": theta_norm,
            "committed_by": len(self.state.committed_group),
            **self.own_round_metadata(),
        }
        try:
            if alive == 1 < self.hv.galaxy_size:  # everyone else is gone: waiting could only time out
                meta = {**fingerprint, "galaxy_rank": self.galaxy_rank, "round_id": self.outer_step}
                pending: PendingRound = AloneRound(self.galaxy_rank, meta)
            else:
                plan = self.averager.matchmaking_plan(alive).agreed(self.cluster.min_int)
                pending = self.averager.start_round(self.outer_step, fingerprint, attempts, plan=plan)
        except RoundFailed as err:  # fails on this rank: its wait reports it, at the same collectives
            return RoundInFlight(
                None, own_hash, local_sq, alive, attempts, start_error=str(err), bound=bound, silent=silent
            )
        return RoundInFlight(pending, own_hash, local_sq, alive, attempts, bound=bound, silent=silent)

    def _locked_buffer(self, held: contextlib.ExitStack) -> torch.Tensor | None:
        """The averager's buffer, locked until ``held`` closes; ``None`` on every rank when any rank could not
        lock it in time (a round that outlived its timeout still writes there), so no rank skips a collective
        its siblings enter."""
        try:
            buffer = held.enter_context(self.averager.buffer())
        except RoundFailed:
            buffer = None
        return buffer if self.cluster.all_true(buffer is not None) else None

    def _membership(self) -> tuple[int, int, int, int]:
        """(clusters alive, the galaxy's lead outer step, other clusters gone silent, the latest attempt of
        the next round a live cluster started), the same on every rank of this cluster.

        Alive: the galaxy less the clusters whose record says they are gone (never this one), the largest
        count any rank saw, so that a rank that could not read the DHT in time makes the round wait rather
        than skip a cluster that is there. A cluster with no record at all counts as alive for a while (a
        galaxy that starts together waits for all of it: ``galaxy.averager.NOT_HEARD_SECONDS``). Lead: the
        highest outer step any rank saw in a live cluster's record. Silent: the most gone-by-silence clusters
        any rank saw (see ``Membership.silent``)."""
        view = self.averager.membership()
        self._fastest_seconds = min(view.step_seconds.values(), default=None)
        ours = range(self.hv.galaxy_size)
        gone = {rank for rank in view.departed if rank != self.galaxy_rank and rank in ours}
        silent = {rank for rank in view.silent if rank != self.galaxy_rank and rank in ours}
        alive = -self.cluster.min_int(-(self.hv.galaxy_size - len(gone)))
        attempt = -self.cluster.min_int(-view.attempt_of(self.outer_step + 1))
        return alive, -self.cluster.min_int(-view.lead), -self.cluster.min_int(-len(silent)), attempt

    @torch.no_grad()
    def finish_round(self, flight: RoundInFlight) -> RoundResult:
        """Wait for the round and commit it (``outer/round.py``): apply the average when every shard got it
        whole from the same clusters, else take the round from a cluster that committed it, else run it again
        under the next attempt; a round the policy calls partial runs again too
        (``--hv.on-partial-round``)."""
        round_no = self.outer_step + 1
        self.bad_rounds = 0
        network_wait = 0.0
        while True:
            waited = time.perf_counter()
            report, failed = self._wait(flight, round_no)
            network_wait += time.perf_counter() - waited
            self._check_peers(report)
            view = RoundView.agree(self.cluster, report, failed, flight.own_hash, self.galaxy_rank)
            if view.overtaken:
                self.warn(
                    f"outer step {round_no}: the galaxy applied this round without this cluster while it "
                    "looked for a group: it takes the galaxy's state rather than wait for the next round"
                )
                return self._take_round(flight, view, report, network_wait)
            if view.left_out:
                self.warn(
                    f"outer step {round_no}: this cluster started the round from another θ_outer than the "
                    "galaxy's most advanced cluster: its Δ was left out, it takes that cluster's state"
                )
                return self._take_round(flight, view, report, network_wait)
            clusters = len(view.group) - len(view.rejected) - len(view.stale)
            alive = flight.alive - len(view.rejected) - len(view.stale)  # garbage is no use waiting for
            partial = clusters < alive and self.policy.on_partial_round == "retry"
            # whoever committed it has our Δ if we were in its group
            if (not view.committable or partial) and self._committed_elsewhere(round_no):
                return self._take_round(flight, view, report, network_wait)
            decision = (
                Decision.RETRY
                if not view.committable
                else self.policy.decide(
                    RoundOutcome(clusters=clusters, alive=alive, attempts=flight.attempts)
                )
            )
            if decision is not Decision.RETRY or flight.attempts >= self.hv.max_retries:
                break
            self._say_why_again(round_no, view, clusters, flight)
            flight = self.start_round(flight.attempts + 1)
            if flight.sits_out:
                if flight.diverged or flight.out_of_bound:
                    return self.sit_out(flight)
                # it sits out because the galaxy is ahead: it committed this round after our check above (its
                # record a read behind). Take it, as a commit when our Δ is in it, rather than re-sync
                return self._take_round(flight, view, report, network_wait)

        if decision is Decision.STOP:
            raise GalaxyError(
                f"outer step {round_no}: only {clusters} of {flight.alive} live clusters averaged and "
                "--hv.on-partial-round is `fail`: stopping (use `retry` or `proceed` to tolerate missing "
                "clusters)"
            )
        if clusters <= 1 < self.hv.galaxy_size and self._committed_elsewhere(round_no):
            # alone because the others finished their run meanwhile (a finished cluster is gone from the
            # rounds but serves its last state): the round they committed is the galaxy's, not our Δ alone
            return self._take_round(flight, view, report, network_wait)
        if not view.committable or (clusters <= 1 < alive and self.policy.on_partial_round == "retry"):
            # out of attempts with nothing whole, or whole but alone: the others are likely committing this
            # round right now, their records a heartbeat behind. Take it from one when its record shows up;
            # apply our own Δ alone only when none does. Seen in the soak: applying alone at once split the
            # galaxy's last round.
            record_lag = self.hv.heartbeat_interval + 2 * MEMBERSHIP_READ_SECONDS
            return self._take_round(flight, view, report, network_wait, appear_within=record_lag)
        return self._commit(flight, view, report, network_wait, clusters, alive, decision)

    def _say_why_again(self, round_no: int, view: RoundView, clusters: int, flight: RoundInFlight) -> None:
        what = (
            f"partial round ({clusters} of {flight.alive} live clusters)"
            if view.committable
            else "an average did not arrive whole on every shard"
            if not view.whole
            else "its shards met different groups"
        )
        self.warn(
            f"outer step {round_no}: {what}: nothing applied; attempt {flight.attempts + 1}/"
            f"{self.hv.max_retries}"
        )

    def _say_who_was_left_out(self, round_no: int, view: RoundView) -> None:
        if view.rejected:
            self.warn(
                f"outer step {round_no}: left cluster(s) {view.rejected} out of the average: their "
                "pseudo-gradient was not finite, larger than they claimed, or above "
                f"--hv.delta-norm-bound={self.hv.delta_norm_bound} times ours"
            )
        if view.stale:
            self.warn(
                f"outer step {round_no}: left cluster(s) {view.stale} out of the average: they started this "
                "round from another θ_outer; they take the galaxy's state"
            )

    def _committed_elsewhere(self, round_no: int) -> bool:
        """A live cluster's record shows this round applied (agreed by the ranks): it is the round's state
        now."""
        steps = [step for rank, step in self.averager.membership().steps.items() if rank != self.galaxy_rank]
        return -self.cluster.min_int(-max(steps, default=-1)) >= round_no  # (ours may be an older life's)

    def _commit(
        self,
        flight: RoundInFlight,
        view: RoundView,
        report: RoundReport,
        network_wait: float,
        clusters: int,
        alive: int,
        decision: Decision,
        alone: str | None = None,
    ) -> RoundResult:
        """Apply the round: the galaxy's average, or with ``alone`` (why) this cluster's own Δ alone, which
        keeps its progress and which the next round's hash check repairs; then land it in the model."""
        round_no = self.outer_step + 1
        galaxy_average = alone is None
        self._say_who_was_left_out(round_no, view)
        if galaxy_average:
            self._record_claims(report, view)
        self._note_alive(round_no, flight.alive)
        if clusters < flight.alive and galaxy_average:
            retried = f" after {flight.attempts} retries" if flight.attempts else ""
            self.warn(
                f"outer step {round_no}: proceeding with {clusters} of {flight.alive} live clusters{retried}"
            )
        elif not galaxy_average:
            self.warn(
                f"outer step {round_no}: {alone}: this cluster applies its own pseudo-gradient alone (the "
                "next round's hash check re-syncs it)"
            )
        before = self.cluster_hash(flight.own_hash)
        with contextlib.ExitStack() as held:
            averaged = self._locked_buffer(held)
            if averaged is None:
                raise GalaxyError(
                    f"outer step {round_no}: the averager is still busy with a previous round past "
                    "--hv.averaging-timeout; stopping (resume from the last checkpoint)"
                )
            finite = self.cluster.all_true(not galaxy_average or all_finite(averaged))
            if not finite:
                self.warn(
                    f"outer step {round_no}: the galaxy's average is not finite (a peer sent or reduced "
                    "garbage): it is not applied, this cluster takes its own pseudo-gradient this round"
                )
            if not (galaxy_average and finite):  # our own Δ again, never a partial or poisoned average
                self.state.pseudo_grad_for_wire_into(averaged)
            held.enter_context(self.changing_state())
            self.state.apply(averaged)
            averaged_over = (
                view.group - set(view.rejected) - set(view.stale)
                if galaxy_average and finite
                else {self.galaxy_rank}
            )
            self.state.committed_group = sorted(averaged_over)
            fragment = self.state.fragment
            self.state.land()
            entry = self._record_commit(
                flight, report, fragment, before, averaged_over, alone=not (galaxy_average and finite)
            )
        in_sync = (
            view.in_sync
            and galaxy_average
            and not view.stale
            and clusters >= alive
            and not (clusters == 1 and flight.silent)
        )
        return self._result(
            "applied",
            flight,
            report,
            network_wait,
            in_sync=in_sync,
            average_finite=finite,
            galaxy_complete=view.whole,
            rejected_peers=view.rejected,
            fragment=fragment,
            ledger=entry,
            param_hash=entry.after,  # θ_outer's hash, gathered for the entry a moment ago
        )

    def _record_claims(self, report: RoundReport, view: RoundView) -> None:
        """The averaged clusters' claimed ‖Δ‖ per unit of weight into the guard's history (its bound)."""
        self.norm_history.record(
            claim / (valid_weight(meta.get("weight")) or 1.0)
            for rank, meta in report.peers.items()
            if rank not in view.rejected
            and rank not in view.stale
            and (claim := valid_claim(meta.get("delta_norm"))) is not None
        )

    def _note_alive(self, round_no: int, alive: int) -> None:
        if alive != self._alive_before:
            self.warn(
                f"outer step {round_no}: {alive} of {self.hv.galaxy_size} clusters alive (were "
                f"{self._alive_before}): rounds now wait for these"
            )
            self._alive_before = alive

    def _result(
        self,
        outcome: str,
        flight: RoundInFlight,
        report: RoundReport | None = None,
        network_wait: float = 0.0,
        fragment: int | None = None,
        **fields: Any,
    ) -> RoundResult:
        """The round's :class:`RoundResult`, hashes and norms the cluster's (every shard's, combined); a
        ``param_hash`` given is θ_outer's, already gathered (a commit's entry)."""
        fragment = self.state.fragment if fragment is None else fragment
        param_hash = fields.pop("param_hash", None) or self.cluster_hash()
        if outcome in ("applied", "adopted"):
            fields["fragment_hash"] = combine_hashes(
                self.cluster.gather_strings(self.state.fragment_hash(fragment))
            )
        if report is not None:
            fields.update(report.record_fields())
        return RoundResult(
            outcome=outcome,
            outer_step=self.outer_step,
            fragment=fragment,
            attempt=flight.attempts,
            network_wait_seconds=network_wait,
            galaxy_alive=flight.alive,
            pseudo_grad_finite=not flight.diverged,
            pseudo_grad_in_bound=not flight.out_of_bound,
            pseudo_grad_bound=self.cluster.norm(flight.bound**2 if flight.bound is not None else math.nan),
            pseudo_grad_norm=self.cluster.norm(flight.local_sq),  # None when not finite (JSON has no NaN)
            param_checksum=self.cluster.sum_float(self.state.sq_norm()),
            param_hash=param_hash,
            **fields,
        )

    def _wait(self, flight: RoundInFlight, round_no: int) -> tuple[RoundReport, bool]:
        """The round's report, or a group of one (``failed``) when it produced no result."""
        error = flight.start_error
        if flight.pending is not None:
            try:
                return flight.pending.wait(), False
            except RoundFailed as err:
                error = str(err)
        self.warn(f"outer step {round_no}: all-reduce failed ({error})")
        return RoundReport(group_size=1, complete=False), True

    def _check_peers(self, report: RoundReport) -> None:
        for rank, meta in report.peers.items():
            if rank != self.galaxy_rank and meta.get("numel") not in (None, self.state.numel):
                raise GalaxyMismatch(
                    f"cluster {rank} averages a shard of {meta['numel']} values, this one "
                    f"{self.state.numel}: every cluster must train the same model config with the same "
                    "number of ranks"
                )
