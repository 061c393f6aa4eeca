"""DiLoCo's outer loop for one shard of one cluster, as two halves: :meth:`DiLoCo.start_round` computes the
pseudo-gradient and launches the galaxy average; :meth:`DiLoCo.finish_round` waits for it and commits it, or
adopts it from a cluster that did, or runs it again (``outer/round.py`` has the rule). :meth:`DiLoCo.after_inner_step`
drives them on the schedule of ``outer/streaming.py``: back to back every H inner steps by default, or one fragment
of the model every H/P steps with the round in flight for ``--hv.sync-delay`` inner steps while training goes on.

Cluster-level decisions (commit, retry, adopt) are agreed by all local ranks through :class:`ClusterComm`, so
every shard of a cluster follows the same path, through the same collectives.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from open_diloco.errors import ConfigError, GalaxyError, GalaxyMismatch, RoundFailed
from open_diloco.outer.adoption import Downloaded, StateAdoption
from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.codecs import all_finite, build_compressor
from open_diloco.outer.guard import NormHistory, wire_norm
from open_diloco.outer.policy import Decision, RoundOutcome, RoundPolicy
from open_diloco.outer.protocols import (
    AloneRound,
    Averager,
    NullStatusBoard,
    PendingRound,
    RoundReport,
    StatusBoard,
)
from open_diloco.outer.round import RoundInFlight, RoundResult, RoundView
from open_diloco.outer.state import OuterState, combine_hashes
from open_diloco.outer.streaming import SyncSchedule

if TYPE_CHECKING:
    from open_diloco.config import HvConfig

FINAL_CHECK_SECONDS = 15.0
"""How long a finished cluster waits for the others' records to reach its last outer step (:meth:`verify_final`)."""


class DiLoCo:
    """The outer loop of one shard: θ_outer and momentum in :class:`OuterState`, rounds through an
    :class:`Averager`, decisions by :class:`RoundPolicy`. The inner optimizer is untouched: its state carries
    across rounds."""

    def __init__(
        self,
        model: torch.nn.Module,
        averager: Averager,
        hv: HvConfig,
        *,
        cluster: ClusterComm | None = None,
        warn: Any = print,
        status: StatusBoard | None = None,
    ):
        self.averager = averager
        self.status = status or NullStatusBoard()
        self._alive_before = hv.galaxy_size
        self._finished = False
        """The trainer reported the run finished (not stopped): leaving may wait for the last round's peers."""
        self.bad_rounds = 0
        """Rounds in a row this cluster sat out with a bad pseudo-gradient (not finite, or out of bound)."""
        self.norm_history = NormHistory(hv.delta_norm_bound)
        self.hv = hv
        self.galaxy_rank = hv.world_rank
        self.policy = RoundPolicy(hv.on_partial_round, hv.max_retries)
        self.cluster = cluster or ClusterComm(next(model.parameters()).device)
        self.warn = warn
        self.schedule = SyncSchedule(hv.local_steps, hv.fragments, hv.sync_delay)
        self.in_flight: RoundInFlight | None = None
        """The round running in the background while inner steps go on (``--hv.sync-delay``)."""
        self._window_start: float | None = None
        self._held = 0.0
        """Seconds the trainer spent in the outer loop since the last round's metrics (for compute utilization)."""
        self._step_seconds: float | None = None
        """A running mean of the trainer's inner-step time (from its records), to turn seconds into steps."""
        self._catch_up_step = 0
        """Where the trainer goes on after this cluster adopted a state the galaxy is already training past
        (:meth:`_catch_up_target`); 0 when it goes on from the adopted round's start."""
        self.state = OuterState(
            model,
            lr=hv.outer_lr,
            momentum=hv.outer_momentum,
            nesterov=hv.outer_nesterov,
            warmup_rounds=hv.outer_warmup_rounds,
            compressor=build_compressor(hv.compression, hv.sparse_density, hv.sparse_rule),
            error_feedback=hv.error_feedback,
            fragments=hv.fragments,
            sync_alpha=hv.sync_alpha,
        )
        self.averager.serve_state(self._served_state)
        self.adoption = StateAdoption(averager, self.cluster, self.galaxy_rank, warn)
        self._joined_from = self.outer_step
        self._started = time.monotonic()
        self._final_hash: str | None = None
        """``param_hash`` of the last round this cluster ended, for :meth:`verify_final`."""

    @property
    def outer_step(self) -> int:
        return self.state.outer_step

    @property
    def fragments(self) -> int:
        return self.hv.fragments

    def _served_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        metadata, tensors = self.state.snapshot()
        return {**metadata, "galaxy_rank": self.galaxy_rank}, tensors

    # -- joining --------------------------------------------------------------------------------------------
    def join_galaxy(self) -> int:
        """Adopt the galaxy's outer state if a live cluster's record shows it ahead of this one (a late joiner, or a
        resume from an older checkpoint); return the inner step to continue after. Nothing is downloaded when no
        cluster is ahead: the records carry each cluster's outer step. The state comes from one source cluster,
        every rank's shard from it (``outer/adoption.py``), or is not taken at all."""
        wanted = self.hv.galaxy_size > 1 and not self.hv.skip_load_from_peers
        got = self._find_and_take_newer() if wanted else None
        if got is not None:
            self.warn(
                f"the galaxy is at outer step {got.step} (this cluster was at {self._joined_from}): downloaded "
                f"θ_outer and the outer momentum from cluster {got.source}"
            )
        elif self.state.local_at_start is not None:  # a checkpoint taken with a round in flight: send it again
            self._resume_round_in_flight()
        return self.inner_step_of_galaxy()

    def _find_and_take_newer(self) -> Downloaded | None:
        """Wait (up to ``--hv.join-timeout``) for the records of the other clusters to show up: a cluster that
        starts beside running ones must not train alone from scratch because the DHT had not answered yet. Once
        any other cluster's record is seen, download only if one of them is ahead."""
        self._joined_from = self.outer_step
        deadline = time.monotonic() + self.hv.join_timeout
        while True:
            view = self.averager.membership()
            others = [step for rank, step in view.steps.items() if rank != self.galaxy_rank]
            known = -self.cluster.min_int(-len(others))
            ahead = -self.cluster.min_int(-max(others, default=-1)) > self.outer_step
            if ahead:
                got = self.adoption.download(self.outer_step + 1, max(1.0, deadline - time.monotonic()))
                if got is not None:
                    self.state.adopt(got.metadata, got.tensors)
                return got
            if known or not self.cluster.all_true(time.monotonic() + 1.0 < deadline):
                return None
            time.sleep(1.0)

    def _resume_round_in_flight(self) -> None:
        """Start again the round a checkpoint recorded in flight (every cluster resumed from the same step does
        the same, so the round meets and lands where it would have)."""
        started_at = self.schedule.inner_step_of(self.outer_step + 1)
        self.warn(f"outer step {self.outer_step + 1}: the checkpoint holds this round in flight: sending it again")
        self._hold(self.start_round(), started_at + self.schedule.sync_delay)

    def inner_step_of_galaxy(self) -> int:
        return max(self.schedule.inner_step_of(self.outer_step), self._catch_up_step)

    def _catch_up_target(self) -> int:
        """The inner step to go on from after adopting the state of a galaxy that was ahead: as far as the lead
        cluster has come since (its status record, moved on by the record's age at our step time), but at least a
        quarter of --hv.averaging-timeout of steps before the next sync.

        Why: a cluster that sat a round out (a side of a healed partition, a slow cluster) adopts the state at the
        galaxy's latest round, while the lead cluster is already that far into the next one. Training the whole
        stride again, it would reach the next sync that much later than the lead cluster, which waits at most
        --hv.averaging-timeout for it: behind by more, it sits out again, round after round. Skipping those
        steps (their batches are not trained on, as for a late joiner) puts it at the sync with the others, and
        its Δ of fewer steps enters that round's average. The margin keeps it inside the lead's wait when the lead
        is already waiting at the sync. The same on every rank of the cluster."""
        start, next_sync = self.schedule.inner_step_of(self.outer_step), self.schedule.inner_step_of(self.outer_step + 1)
        target = start
        if self.hv.galaxy_size > 1 and self._step_seconds:
            view = self.averager.membership()
            if view.lead == self.outer_step and view.lead_inner_step > start:
                lead_now = view.lead_inner_step + int(view.lead_seen_seconds / self._step_seconds)
                margin = max(1, math.ceil(self.hv.averaging_timeout / 4 / self._step_seconds))
                target = max(start, min(lead_now, next_sync - margin))
        return self.cluster.min_int(target)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this shard's outer state (:meth:`OuterLoop.state_dict`), θ_outer itself where
        the schedule lets the model differ from it at a save (fragments, a sync delay)."""
        return self.state.checkpoint_state(streaming=self.schedule.streaming)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a checkpoint's outer state (:meth:`OuterLoop.load_state_dict`). A round it holds in flight is sent
        again by :meth:`join_galaxy`: it must be a round of this run's fragments."""
        saved_fragments = int(state_dict.get("fragments", 1))
        if "sync_start" in state_dict and saved_fragments != self.hv.fragments:
            raise ConfigError(
                f"the checkpoint holds a round of one of {saved_fragments} fragments in flight, this run has "
                f"--hv.fragments {self.hv.fragments}: resume with --hv.fragments {saved_fragments}"
            )
        if not self.state.sparse_scores_fit(state_dict.get("sparse_scores")):
            self.warn("the checkpoint holds no sparse block scores for this rank's shard (saved with another number "
                      "of ranks, or another --hv.compression): they start from zero, so each fragment's next round "
                      "picks its blocks at random, as a first round does")
        self.state.load_checkpoint_state(state_dict)

    # -- the outer step -------------------------------------------------------------------------------------
    def after_inner_step(self, inner_step: int, last: bool = False) -> dict[str, Any]:
        """The metrics of the latest sync :meth:`syncs_after_inner_step` ended, else ``{}`` (tests, benches)."""
        results = self.syncs_after_inner_step(inner_step, last)
        return results[-1].metrics() if results else {}

    def syncs_after_inner_step(self, inner_step: int, last: bool = False) -> list[RoundResult]:
        """Land the round in flight when its delay is over, start a sync when ``inner_step`` is on the schedule
        (see :class:`OuterLoop`); ``last``: the run ends here, so nothing stays in flight. Returns every round that
        landed (or was sat out), oldest first: two when τ = H/P lands one sync at the step the next starts and
        that one ends at once too (sat out, or at the run's end)."""
        began = time.perf_counter()
        if self._window_start is None:
            self._window_start = began
        results: list[RoundResult] = []
        if self.in_flight is not None and (inner_step >= self.in_flight.lands_at or last):
            flight, self.in_flight = self.in_flight, None
            results.append(self.finish_round(flight))
        # (at τ = H/P a landing that re-synced may have adopted a state past this sync: the galaxy ran it already)
        skip = bool(results) and self.inner_step_of_galaxy() >= inner_step
        if self.schedule.starts_sync(inner_step) and not skip and (result := self._start_sync(inner_step, last)):
            results.append(result)
        self._held += time.perf_counter() - began
        if results:
            window = time.perf_counter() - self._window_start
            # the share of the wall time since the last round's metrics that the trainer was not held by the
            # outer loop (Δ, matchmaking and all-reduce waits, the outer step): 1.0 when the network is hidden
            utilization = max(0.0, 1.0 - self._held / window) if window > 0 else 1.0
            for result in results:
                result.compute_utilization = utilization
            self._final_hash = results[-1].param_hash
            self._window_start, self._held = time.perf_counter(), 0.0
        return results

    def _start_sync(self, inner_step: int, last: bool) -> RoundResult | None:
        """Start the sync of the next fragment; finish it at once without a delay (or at the run's end)."""
        delay = 0 if last else self.schedule.sync_delay
        self.state.begin_round(self.schedule.fragment_of(self.outer_step), keep_local=delay > 0)
        flight = self.start_round()
        if delay == 0 and not flight.sits_out:
            return self.finish_round(flight)
        return self._hold(flight, inner_step + delay)

    def _hold(self, flight: RoundInFlight, lands_at: int) -> RoundResult | None:
        """Keep a started round in flight until inner step ``lands_at``, or sit it out at once."""
        if flight.sits_out:
            return self.sit_out(flight)
        flight.lands_at, self.in_flight = lands_at, flight
        return None

    def step(self) -> dict[str, Any]:
        """One blocking outer step of the next fragment: start the round and finish it (or sit it out, see
        :meth:`sit_out`); its metrics."""
        self.state.begin_round(self.schedule.fragment_of(self.outer_step), keep_local=False)
        flight = self.start_round()
        return (self.sit_out(flight) if flight.sits_out else self.finish_round(flight)).metrics()

    @torch.no_grad()
    def start_round(self, attempts: int = 0) -> RoundInFlight:
        """Δ = θ_outer − θ_local into the averager's buffer, then launch the galaxy average of it (attempt
        ``attempts`` of the round). Every rank runs the same collectives whatever happens on it."""
        own_hash = self.state.hash()
        alive, lead, silent, galaxy_attempt = self._membership()
        attempts = max(attempts, galaxy_attempt)  # join the galaxy's current attempt, not one nobody is in
        self.status.update({"round_attempt": [self.outer_step + 1, attempts]})
        if lead > self.outer_step:  # the galaxy applied rounds without this cluster (a late joiner, a healed cut)
            return RoundInFlight(None, own_hash, float("nan"), alive, attempts, lead=lead, silent=silent)
        with contextlib.ExitStack() as held:
            pseudo_grad = self._locked_buffer(held)
            if pseudo_grad is None:
                error = "the averager is still busy with a previous round"
                return RoundInFlight(None, own_hash, float("nan"), alive, attempts, start_error=error, silent=silent)
            local_sq = self.state.pseudo_grad_for_wire_into(pseudo_grad)
            finite = math.isfinite(local_sq)
            # the claim the reducers hold our parts to: the norm of exactly what is sent (guard.py)
            claim = math.sqrt(local_sq) if self.state.compressor is None or not finite else wire_norm(pseudo_grad)
        if not self.cluster.all_true(finite):  # never sent: it would poison every cluster
            return RoundInFlight(None, own_hash, local_sq, alive, attempts, diverged=True, lead=lead, silent=silent)
        theta_norm = math.sqrt(self.state.sq_norm())
        bound = self.norm_history.bound(theta_norm)
        if not self.cluster.all_true(bound is None or claim <= bound):  # finite, but blown up: not sent
            return RoundInFlight(None, own_hash, local_sq, alive, attempts, bound=bound, out_of_bound=True,
                                 lead=lead, silent=silent)
        fingerprint = {"param_hash": own_hash, "numel": self.state.numel, "delta_norm": claim,
                       "theta_norm": theta_norm, "committed_by": len(self.state.committed_group)}
        try:
            if alive == 1 < self.hv.galaxy_size:  # everyone else is gone: waiting could only time out
                meta = {**fingerprint, "galaxy_rank": self.galaxy_rank, "round_id": self.outer_step}
                pending: PendingRound = AloneRound(self.galaxy_rank, meta)
            else:
                pending = self.averager.start_round(self.outer_step, fingerprint, attempts)
        except RoundFailed as err:  # the round fails on this rank: its wait reports it, at the same collectives
            return RoundInFlight(None, own_hash, local_sq, alive, attempts, start_error=str(err), bound=bound,
                                 silent=silent)
        return RoundInFlight(pending, own_hash, local_sq, alive, attempts, bound=bound, silent=silent)

    def _locked_buffer(self, held: contextlib.ExitStack) -> torch.Tensor | None:
        """The averager's buffer, locked until ``held`` closes; ``None`` on every rank when any rank could not
        lock it in time (a round that outlived its timeout still writes there), so no rank skips a collective its
        siblings enter."""
        try:
            buffer = held.enter_context(self.averager.buffer())
        except RoundFailed:
            buffer = None
        return buffer if self.cluster.all_true(buffer is not None) else None

    def _membership(self) -> tuple[int, int, int, int]:
        """(clusters alive, the galaxy's lead outer step, other clusters gone silent, the latest attempt of the next
        round a live cluster started), the same on every rank of this cluster.

        Alive: the galaxy less the clusters whose record says they are gone (never this one), the largest count
        any rank saw, so that a rank that could not read the DHT in time makes the round wait rather than skip a
        cluster that is there. A cluster with no record at all counts as alive for ``--hv.join-timeout`` after this
        one started (a galaxy that starts together waits for all of it), then as absent until its record appears:
        a cluster that never started must not cost every round its retries. Lead: the highest outer step any rank
        saw in a live cluster's record. Silent: the most gone-by-silence clusters any rank saw (see
        ``Membership.silent``)."""
        view = self.averager.membership()
        ours = range(self.hv.galaxy_size)
        gone = {rank for rank in view.departed if rank != self.galaxy_rank and rank in ours}
        if view.reported and time.monotonic() - self._started > self.hv.join_timeout:  # (the DHT answered)
            gone |= {rank for rank in ours if rank != self.galaxy_rank and rank not in view.reported}
        silent = {rank for rank in view.silent if rank != self.galaxy_rank and rank in ours}
        alive = -self.cluster.min_int(-(self.hv.galaxy_size - len(gone)))
        attempt = -self.cluster.min_int(-view.attempt_of(self.outer_step + 1))
        return alive, -self.cluster.min_int(-view.lead), -self.cluster.min_int(-len(silent)), attempt

    @torch.no_grad()
    def finish_round(self, flight: RoundInFlight) -> RoundResult:
        """Wait for the round and commit it (``outer/round.py``): apply the average when every shard got it whole
        from the same clusters, else take the round from a cluster that committed it, else run it again under the
        next attempt; a round the policy calls partial runs again too (``--hv.on-partial-round``)."""
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
                self.warn(f"outer step {round_no}: the galaxy applied this round without this cluster while it "
                          "looked for a group: it takes the galaxy's state rather than wait for the next round")
                return self._take_round(flight, view, report, network_wait)
            if view.left_out:
                self.warn(f"outer step {round_no}: this cluster started the round from another θ_outer than the "
                          "galaxy's most advanced cluster: its Δ was left out, it takes that cluster's state")
                return self._take_round(flight, view, report, network_wait)
            clusters = len(view.group) - len(view.rejected) - len(view.stale)
            alive = flight.alive - len(view.rejected) - len(view.stale)  # garbage is no use waiting for
            if not view.committable or (clusters < alive and self.policy.on_partial_round == "retry"):
                if self._committed_elsewhere(round_no):  # whoever committed it has our Δ if we were in its group
                    return self._take_round(flight, view, report, network_wait)
            decision = Decision.RETRY if not view.committable else self.policy.decide(RoundOutcome(
                clusters=clusters, alive=alive, attempts=flight.attempts))
            if decision is not Decision.RETRY or flight.attempts >= self.hv.max_retries:
                break
            self._say_why_again(round_no, view, clusters, flight)
            flight = self.start_round(flight.attempts + 1)
            if flight.sits_out:  # the galaxy moved on meanwhile: adopt its state rather than meet its next round
                return self.sit_out(flight)

        if decision is Decision.STOP:
            raise GalaxyError(
                f"outer step {round_no}: only {clusters} of {flight.alive} live clusters averaged and "
                "--hv.on-partial-round is `fail`: stopping (use `retry` or `proceed` to tolerate missing clusters)"
            )
        alone = None if view.committable else ("no attempt came out whole and no cluster committed the round")
        return self._commit(flight, view, report, network_wait, clusters, alive, decision, alone)

    def _say_why_again(self, round_no: int, view: RoundView, clusters: int, flight: RoundInFlight) -> None:
        what = (f"partial round ({clusters} of {flight.alive} live clusters)" if view.committable else
                "an average did not arrive whole on every shard" if not view.whole else
                "its shards met different groups")
        self.warn(f"outer step {round_no}: {what}: nothing applied; attempt {flight.attempts + 1}/"
                  f"{self.hv.max_retries}")

    def _committed_elsewhere(self, round_no: int) -> bool:
        """A live cluster's record shows this round applied (agreed by the ranks): it is the round's state now."""
        return -self.cluster.min_int(-max(self.averager.membership().steps.values(), default=-1)) >= round_no

    def _commit(self, flight: RoundInFlight, view: RoundView, report: RoundReport, network_wait: float,
                clusters: int, alive: int, decision: Decision, alone: str | None = None) -> RoundResult:
        """Apply the round: the galaxy's average, or with ``alone`` (why) this cluster's own Δ alone, which keeps
        its progress and which the next round's hash check repairs; then land it in the model."""
        round_no = self.outer_step + 1
        galaxy_average = alone is None
        if view.rejected:
            self.warn(
                f"outer step {round_no}: left cluster(s) {view.rejected} out of the average: their pseudo-gradient "
                f"was not finite, larger than they claimed, or above --hv.delta-norm-bound={self.hv.delta_norm_bound}"
                " times ours"
            )
        if view.stale:
            self.warn(f"outer step {round_no}: left cluster(s) {view.stale} out of the average: they started this "
                      "round from another θ_outer; they take the galaxy's state")
        if galaxy_average:
            self.norm_history.record(meta.get("delta_norm") for rank, meta in report.peers.items()
                                     if rank not in view.rejected and rank not in view.stale)
        self._note_alive(round_no, flight.alive)
        if clusters < flight.alive and galaxy_average:
            retried = f" after {flight.attempts} retries" if flight.attempts else ""
            self.warn(f"outer step {round_no}: proceeding with {clusters} of {flight.alive} live clusters{retried}")
        elif not galaxy_average:
            self.warn(f"outer step {round_no}: {alone}: this cluster applies its own pseudo-gradient alone (the "
                      "next round's hash check re-syncs it)")
        with contextlib.ExitStack() as held:
            averaged = self._locked_buffer(held)
            if averaged is None:
                raise GalaxyError(f"outer step {round_no}: the averager is still busy with a previous round past "
                                  "--hv.averaging-timeout; stopping (resume from the last checkpoint)")
            finite = self.cluster.all_true(not galaxy_average or all_finite(averaged))
            if not finite:
                self.warn(
                    f"outer step {round_no}: the galaxy's average is not finite (a peer sent or reduced "
                    "garbage): it is not applied, this cluster takes its own pseudo-gradient this round"
                )
            if not (galaxy_average and finite):  # our own Δ again, never a partial or poisoned average
                self.state.pseudo_grad_for_wire_into(averaged)
            self.state.apply(averaged)
        averaged_over = view.group - set(view.rejected) - set(view.stale) if galaxy_average and finite else {
            self.galaxy_rank}
        self.state.committed_group = sorted(averaged_over)
        fragment = self.state.fragment
        self.state.land()
        in_sync = (view.in_sync and galaxy_average and not view.stale and clusters >= alive
                   and not (clusters == 1 and flight.silent))
        return self._result("applied", flight, report, network_wait, in_sync=in_sync, average_finite=finite,
                            galaxy_complete=view.whole, rejected_peers=view.rejected, fragment=fragment)

    def _note_alive(self, round_no: int, alive: int) -> None:
        if alive != self._alive_before:
            self.warn(f"outer step {round_no}: {alive} of {self.hv.galaxy_size} clusters alive (were "
                      f"{self._alive_before}): rounds now wait for these")
            self._alive_before = alive

    def _take_round(self, flight: RoundInFlight, view: RoundView, report: RoundReport, network_wait: float
                    ) -> RoundResult:
        """Take the round's result from a cluster that committed it, instead of applying anything of our own.
        When this cluster is in the group the round was committed with (the served state says), that average
        holds our Δ (the same at every attempt of a round): taken at exactly this round, it is this cluster's
        commit too (:meth:`OuterState.adopt_round`, nothing lost); otherwise, or at a later round, a re-sync."""
        round_no = self.outer_step + 1
        got = self.adoption.download(round_no, self.hv.join_timeout, exact=round_no)
        fragment = self.state.fragment
        if got is not None and got.step == round_no and self.galaxy_rank in got.metadata.get("committed_group", ()):
            self.state.adopt_round(got.metadata, got.tensors)
            self.state.land()
            outcome = "adopted"
        elif got is not None:
            self.state.adopt(got.metadata, got.tensors)
            self.warn(f"outer step {round_no - 1}: took cluster {got.source}'s state at outer step {got.step}")
            self._catch_up()
            outcome = "resynced"
        else:  # nobody served it in time: our own Δ alone keeps our progress; the next round's check repairs it
            return self._commit(flight, view, report, network_wait, 1, flight.alive, Decision.PROCEED,
                                alone="no cluster served the round's state within --hv.join-timeout")
        # adopted: our Δ is in the round, which its committer checked started from our θ_outer (else it would
        # have left us out of the group it committed with): in sync when that group is every live cluster
        in_sync = outcome == "adopted" and len(self.state.committed_group) >= flight.alive
        return self._result(outcome, flight, report, network_wait, fragment=fragment,
                            state_source=None if got is None else got.source, galaxy_complete=view.whole,
                            in_sync=in_sync)

    def _result(self, outcome: str, flight: RoundInFlight, report: RoundReport | None = None,
                network_wait: float = 0.0, fragment: int | None = None, **fields: Any) -> RoundResult:
        """The round's :class:`RoundResult`; the hashes and norms are the cluster's (every shard's, combined)."""
        fragment = self.state.fragment if fragment is None else fragment
        if outcome in ("applied", "adopted"):
            fields["fragment_hash"] = combine_hashes(self.cluster.gather_strings(self.state.fragment_hash(fragment)))
        if report is not None:
            fields.update(galaxy_peers=report.group_size, allreduce_seconds=report.seconds,
                          bytes_sent=report.bytes_sent, bytes_received=report.bytes_received)
        return RoundResult(
            outcome=outcome,
            outer_step=self.outer_step,
            fragment=fragment,
            attempt=flight.attempts,
            network_wait_seconds=network_wait,
            galaxy_alive=flight.alive,
            pseudo_grad_finite=not flight.diverged,
            pseudo_grad_in_bound=not flight.out_of_bound,
            pseudo_grad_bound=self._cluster_bound(flight.bound),
            pseudo_grad_norm=self._cluster_norm(flight.local_sq),  # None when not finite (JSON has no NaN)
            param_checksum=self.cluster.sum_float(self.state.sq_norm()),
            param_hash=combine_hashes(self.cluster.gather_strings(self.state.hash())),
            **fields,
        )

    @torch.no_grad()
    def sit_out(self, flight: RoundInFlight) -> RoundResult:
        """Send nothing this round, then adopt the galaxy's θ_outer once the round is applied, when:

        - the galaxy is ahead (``flight.lead``): this cluster's Δ was taken from an older θ_outer than the
          round's (a late joiner whose download is already old, a side of a healed partition), and averaging it
          would drag every cluster back;
        - this cluster's Δ is not finite (its inner training diverged). Alone, or when no peer serves the state
          in time, it drops its local progress and goes back to its own θ_outer. After ``--hv.max-bad-rounds``
          such rounds in a row it stops: the divergence is its own, not a passing spike."""
        round_no = self.outer_step + 1
        if flight.diverged or flight.out_of_bound:
            self.bad_rounds += 1
            what = "not finite" if flight.diverged else "out of bound"
            if self.bad_rounds > self.hv.max_bad_rounds:
                raise GalaxyError(
                    f"outer step {round_no}: this cluster's pseudo-gradient was {what} in {self.bad_rounds} rounds "
                    "in a row (its training diverges): stopping; lower --lr or --max-grad-norm, or resume from an "
                    "earlier checkpoint"
                )
            detail = "" if flight.diverged else " (above --hv.delta-norm-bound × the galaxy's recent median, or 100 × ‖θ_outer‖)"
            self.warn(
                f"outer step {round_no}: this cluster's pseudo-gradient is {what}{detail}: its training diverged; it "
                f"sends nothing and adopts the galaxy's θ_outer ({self.bad_rounds}/{self.hv.max_bad_rounds})"
            )
            why, wanted = "this cluster diverged", max(round_no, flight.lead)
        else:
            self.warn(
                f"outer step {round_no}: the galaxy is at outer step {flight.lead}: this cluster's pseudo-gradient "
                "comes from an older θ_outer, so it sends nothing and adopts the galaxy's state"
            )
            why, wanted = "the galaxy was ahead", flight.lead
        taken = self._resync(wanted, why) if self.hv.galaxy_size > 1 else None
        if taken is not None and not (flight.diverged or flight.out_of_bound):
            self._catch_up()
        self.state.scatter_into_model()
        self.state.local_at_start = None  # the whole model is θ_outer again: nothing of the fragment's to keep
        return self._result("resynced" if taken is not None else "sat_out", flight,
                            state_source=None if taken is None else taken.source)

    def _catch_up(self) -> None:
        """After taking the state of a galaxy that trains past it, go on where it is (:meth:`_catch_up_target`)."""
        self._catch_up_step = self._catch_up_target()
        if self._catch_up_step > self.schedule.inner_step_of(self.outer_step):
            self.warn(f"outer step {self.outer_step}: the galaxy is already training towards the next sync: "
                      f"this cluster goes on from inner step {self._catch_up_step} to meet it there")

    def _cluster_norm(self, local_sq: float) -> float | None:
        """‖Δ‖ of the whole cluster (every shard); ``None`` when not finite (or never computed)."""
        total = self.cluster.sum_float(local_sq)
        return total**0.5 if math.isfinite(total) else None

    def _cluster_bound(self, bound: float | None) -> float | None:
        """The sender-side bound for the whole cluster's ‖Δ‖ (each shard's bound, combined like norms)."""
        total = self.cluster.sum_float(bound**2 if bound is not None else float("nan"))
        return total**0.5 if math.isfinite(total) else None

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
                    f"cluster {rank} averages a shard of {meta['numel']} values, this one {self.state.numel}: "
                    "every cluster must train the same model config with the same number of ranks"
                )

    def _resync(self, at_least: int, why: str) -> Downloaded | None:
        """Take the state of the galaxy's most advanced live cluster, at outer step ``at_least`` or later, within
        ``--hv.join-timeout`` (from one source, ``outer/adoption.py``); ``None`` (state kept) when none came."""
        got = self.adoption.download(at_least, self.hv.join_timeout)
        if got is not None:
            previous = self.outer_step
            self.state.adopt(got.metadata, got.tensors)
            self.warn(f"outer step {previous}: {why}: adopted cluster {got.source}'s state at outer step {got.step}")
        else:
            self.warn(f"outer step {self.outer_step}: {why} and re-sync failed")
        return got

    def report(self, record: dict[str, Any]) -> None:
        if isinstance(seconds := record.get("step_seconds"), float) and seconds > 0:
            self._step_seconds = seconds if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * seconds
        self.status.update(record)
        self._finished = record.get("state") == "finished"

    def verify_final(self, param_hash: str, seconds: float = FINAL_CHECK_SECONDS) -> list[int] | None:
        """At the end of a finished run, compare this cluster's final θ_outer (``param_hash``) with every other
        cluster that ends at the same outer step, as their records show them: wait (``seconds`` at most) until
        every cluster still training is at least this far, then name the ones whose hash differs in one warning.
        The hash check of a round compares where rounds *start*, so without this a last round that came out
        differently in two clusters would go unnoticed. Returns the clusters compared equal (``None``: none)."""
        if self.hv.galaxy_size == 1:
            return None
        deadline = time.monotonic() + seconds
        while True:
            reported = {rank: seen for rank, seen in self.averager.membership().reported.items()
                        if rank != self.galaxy_rank}
            waiting = [rank for rank, (step, _, live) in reported.items() if live and step < self.outer_step]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        same = [rank for rank, (step, theirs, _) in reported.items() if step == self.outer_step and theirs == param_hash]
        differ = [rank for rank, (step, theirs, _) in reported.items()
                  if step == self.outer_step and theirs is not None and theirs != param_hash]
        if differ:
            self.warn(f"the run ends at outer step {self.outer_step} with a θ_outer unlike that of cluster(s) "
                      f"{differ} ({param_hash} here): the galaxy's last rounds split; resume every cluster from the "
                      "checkpoint of the cluster you trust, or compare their exports")
        return same or None

    def close(self) -> None:
        try:
            if self._finished and self._final_hash and not isinstance(self.status, NullStatusBoard):
                self.verify_final(self._final_hash)  # the cluster's rank 0 (it publishes, so it may read)
            self.status.close()  # while the DHT still runs
        finally:  # a finished run may wait for the peers of its last round to take their averages; a stop may not
            self.averager.shutdown(finished=self._finished)
