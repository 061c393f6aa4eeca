"""DiLoCo's outer loop for one shard of one cluster, as two halves: :meth:`DiLoCo.start_round` computes the
pseudo-gradient and launches the galaxy average; :meth:`DiLoCo.finish_round` waits for it, lets the round
policy decide, and applies the outer step. :meth:`DiLoCo.after_inner_step` drives them on the schedule of
``outer/streaming.py``: back to back every H inner steps by default, or one fragment of the model every H/P steps
with the round in flight for ``--hv.sync-delay`` inner steps while training goes on.

Cluster-level decisions (retry a partial round, re-sync after a mismatch) are agreed by all local ranks
through :class:`ClusterComm`, so every shard of a cluster follows the same path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from open_diloco.errors import ConfigError, GalaxyError, GalaxyMismatch, RoundFailed
from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.codecs import all_finite, build_compressor
from open_diloco.outer.guard import NormHistory, wire_norm
from open_diloco.outer.policy import Decision, RoundOutcome, RoundPolicy, most_advanced
from open_diloco.outer.protocols import (
    AloneRound,
    Averager,
    NullStatusBoard,
    PendingRound,
    RoundReport,
    StatusBoard,
)
from open_diloco.outer.state import OuterState, combine_hashes
from open_diloco.outer.streaming import SyncSchedule

if TYPE_CHECKING:
    from open_diloco.config import HvConfig


@dataclass
class RoundInFlight:
    """A started round: what :meth:`DiLoCo.finish_round` needs to judge and apply it."""

    pending: PendingRound | None
    """The all-reduce in flight; ``None`` when it could not even start."""
    own_hash: str
    """Hash of this shard's θ_outer when the round started."""
    local_sq: float
    """‖Δ‖² of this shard before averaging (for the ``pseudo_grad_norm`` metric)."""
    alive: int
    """Clusters alive when the round started (membership), this one included; agreed by the cluster's ranks."""
    attempts: int = 0
    start_error: str | None = None
    diverged: bool = False
    """Δ is not finite on some rank of this cluster: nothing was sent (the cluster sits the round out)."""
    bound: float | None = None
    """The largest ‖Δ‖ this shard could send this round: the tighter of ``--hv.delta-norm-bound`` × the galaxy's
    recent median and ``guard.THETA_FACTOR`` × ‖θ_outer‖ (``guard.NormHistory``); ``None``: the check is off."""
    out_of_bound: bool = False
    """Δ is finite but out of bound on some rank of this cluster: nothing was sent (it sits the round out)."""
    lead: int = -1
    """The highest outer step a live cluster has applied, by the membership records (agreed by the ranks); above
    this cluster's, its Δ would come from an older θ_outer than the round's: nothing is sent."""
    silent: int = 0
    """Other clusters gone silent (not ended) when the round started (membership), the most any rank saw."""
    lands_at: int = 0
    """The inner step after which the round's update lands (its start + ``--hv.sync-delay``)."""

    @property
    def sits_out(self) -> bool:
        return self.pending is None and self.start_error is None


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
        """Adopt the galaxy's outer state if a peer serves a newer one than this cluster holds (a late joiner,
        or a resume from an older checkpoint); return the inner step to continue after. All local ranks must
        agree, else the shards would mix two galaxy states, so the state is adopted on every rank or none."""
        wanted = self.hv.galaxy_size > 1 and not self.hv.skip_load_from_peers
        downloaded = self.averager.download_state(self.hv.join_timeout) if wanted else None
        newer = downloaded is not None and int(downloaded[0].get("outer_step", -1)) > self.outer_step
        if self.cluster.all_true(newer):
            previous = self.outer_step
            self.state.adopt(*downloaded)
            self.warn(
                f"the galaxy is at outer step {self.outer_step} (this cluster was at {previous}): "
                "downloaded θ_outer and the outer momentum from a peer"
            )
        elif self.state.local_at_start is not None:  # a checkpoint taken with a round in flight: send it again
            self._resume_round_in_flight()
        return self.inner_step_of_galaxy()

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
    def momentum_pieces(self, for_load: bool = False) -> list[torch.Tensor] | None:
        return self.state.momentum_pieces(for_load)

    def restore_after_checkpoint(self, outer_step: int, momentum_pieces: list[torch.Tensor] | None) -> None:
        self.state.restore_after_checkpoint(outer_step, momentum_pieces)

    def error_feedback_pieces(self) -> list[torch.Tensor] | None:
        return self.state.error_feedback_pieces()

    def streaming_pieces(self) -> dict[str, list[torch.Tensor]]:
        if not (self.schedule.streaming or self.state.keeps_unsent):  # the model is θ_outer at every save
            return {}
        pieces = {"outer_params": self.state.outer_params_pieces()}
        sync_start = self.state.sync_start_pieces()
        if sync_start is not None:
            pieces["sync_start"] = sync_start
        return pieces

    def restore_streaming(self, pieces: dict[str, list[torch.Tensor]], saved_fragments: int) -> None:
        if "sync_start" in pieces and saved_fragments != self.hv.fragments:
            raise ConfigError(
                f"the checkpoint holds a round of one of {saved_fragments} fragments in flight, this run has "
                f"--hv.fragments {self.hv.fragments}: resume with --hv.fragments {saved_fragments}"
            )
        fragment = self.schedule.fragment_of(self.outer_step)  # the round in flight is sync outer_step + 1
        self.state.restore_streaming(pieces["outer_params"], pieces.get("sync_start"), fragment)

    def restore_error_feedback(self, pieces: list[torch.Tensor]) -> None:
        self.state.restore_error_feedback(pieces)

    def sparse_scores(self) -> torch.Tensor | None:
        return None if self.state.sparse_scores is None else self.state.sparse_scores.clone()

    def restore_sparse_scores(self, scores: torch.Tensor | None) -> None:
        if not self.state.restore_sparse_scores(scores):
            self.warn("the checkpoint holds no sparse block scores for this rank's shard (saved with another number "
                      "of ranks, or another --hv.compression): they start from zero, so each fragment's next round "
                      "picks its blocks at random, as a first round does")

    # -- the outer step -------------------------------------------------------------------------------------
    def after_inner_step(self, inner_step: int, last: bool = False) -> dict[str, Any]:
        """The metrics of the latest sync :meth:`syncs_after_inner_step` ended, else ``{}`` (tests, benches)."""
        records = self.syncs_after_inner_step(inner_step, last)
        return records[-1] if records else {}

    def syncs_after_inner_step(self, inner_step: int, last: bool = False) -> list[dict[str, Any]]:
        """Land the round in flight when its delay is over, start a sync when ``inner_step`` is on the schedule
        (see :class:`OuterLoop`); ``last``: the run ends here, so nothing stays in flight. Returns the metrics of
        every round that landed (or was sat out), oldest first: two when τ = H/P lands one sync at the step the
        next starts and that one ends at once too (sat out, or at the run's end)."""
        began = time.perf_counter()
        if self._window_start is None:
            self._window_start = began
        records: list[dict[str, Any]] = []
        if self.in_flight is not None and (inner_step >= self.in_flight.lands_at or last):
            flight, self.in_flight = self.in_flight, None
            records.append(self.finish_round(flight))
        # (at τ = H/P a landing that re-synced may have adopted a state past this sync: the galaxy ran it already)
        skip = bool(records) and self.inner_step_of_galaxy() >= inner_step
        if self.schedule.starts_sync(inner_step) and not skip and (record := self._start_sync(inner_step, last)):
            records.append(record)
        self._held += time.perf_counter() - began
        if records:
            window = time.perf_counter() - self._window_start
            # the share of the wall time since the last round's metrics that the trainer was not held by the
            # outer loop (Δ, matchmaking and all-reduce waits, the outer step): 1.0 when the network is hidden
            utilization = max(0.0, 1.0 - self._held / window) if window > 0 else 1.0
            for record in records:
                record["compute_utilization"] = utilization
            self._window_start, self._held = time.perf_counter(), 0.0
        return records

    def _start_sync(self, inner_step: int, last: bool) -> dict[str, Any]:
        """Start the sync of the next fragment; finish it at once without a delay (or at the run's end)."""
        delay = 0 if last else self.schedule.sync_delay
        self.state.begin_round(self.schedule.fragment_of(self.outer_step), keep_local=delay > 0)
        flight = self.start_round()
        if delay == 0 and not flight.sits_out:
            return self.finish_round(flight)
        return self._hold(flight, inner_step + delay)

    def _hold(self, flight: RoundInFlight, lands_at: int) -> dict[str, Any]:
        """Keep a started round in flight until inner step ``lands_at``, or sit it out at once (its metrics)."""
        if flight.sits_out:
            return self.sit_out(flight)
        flight.lands_at, self.in_flight = lands_at, flight
        return {}

    def step(self) -> dict[str, Any]:
        """One blocking outer step of the next fragment: start the round and finish it (or sit it out, see
        :meth:`sit_out`)."""
        self.state.begin_round(self.schedule.fragment_of(self.outer_step), keep_local=False)
        flight = self.start_round()
        return self.sit_out(flight) if flight.sits_out else self.finish_round(flight)

    @torch.no_grad()
    def start_round(self, attempts: int = 0) -> RoundInFlight:
        """Δ = θ_outer − θ_local into the averager's buffer, then launch the galaxy average of it."""
        own_hash = self.state.hash()
        alive, lead, silent = self._membership()
        if lead > self.outer_step:  # the galaxy applied rounds without this cluster (a late joiner, a healed cut)
            return RoundInFlight(None, own_hash, float("nan"), alive, attempts, lead=lead, silent=silent)
        try:
            with self.averager.buffer() as pseudo_grad:
                local_sq = self.state.pseudo_grad_for_wire_into(pseudo_grad)
                finite = math.isfinite(local_sq)
                # the claim the reducers hold our parts to: the norm of exactly what is sent (guard.py)
                claim = math.sqrt(local_sq) if self.state.compressor is None or not finite else wire_norm(pseudo_grad)
            if not self.cluster.all_true(finite):  # never sent: it would poison every cluster
                return RoundInFlight(None, own_hash, local_sq, alive, attempts, diverged=True, lead=lead,
                                     silent=silent)
            theta_norm = math.sqrt(self.state.sq_norm())
            bound = self.norm_history.bound(theta_norm)
            if not self.cluster.all_true(bound is None or claim <= bound):  # finite, but blown up: not sent
                return RoundInFlight(None, own_hash, local_sq, alive, attempts, bound=bound, out_of_bound=True,
                                     lead=lead, silent=silent)
            fingerprint = {"param_hash": own_hash, "numel": self.state.numel, "delta_norm": claim,
                           "theta_norm": theta_norm}
            if alive == 1 < self.hv.galaxy_size:  # everyone else is gone: waiting could only time out
                meta = {**fingerprint, "galaxy_rank": self.galaxy_rank, "round_id": self.outer_step}
                pending: PendingRound = AloneRound(self.galaxy_rank, meta)
            else:
                pending = self.averager.start_round(self.outer_step, fingerprint)
        except RoundFailed as err:
            return RoundInFlight(None, own_hash, float("nan"), alive, attempts, start_error=str(err), silent=silent)
        return RoundInFlight(pending, own_hash, local_sq, alive, attempts, bound=bound, silent=silent)

    def _membership(self) -> tuple[int, int, int]:
        """(clusters alive, the galaxy's lead outer step, other clusters gone silent), the same on every rank of
        this cluster.

        Alive: the galaxy less the clusters whose record says they are gone (never this one), the largest count
        any rank saw, so that a rank that could not read the DHT in time makes the round wait rather than skip a
        cluster that is there. Lead: the highest outer step any rank saw in a live cluster's record. Silent: the
        most gone-by-silence clusters any rank saw (see ``Membership.silent``)."""
        view = self.averager.membership()
        ours = range(self.hv.galaxy_size)
        gone = {rank for rank in view.departed if rank != self.galaxy_rank and rank in ours}
        silent = {rank for rank in view.silent if rank != self.galaxy_rank and rank in ours}
        alive = -self.cluster.min_int(-(self.hv.galaxy_size - len(gone)))
        return alive, -self.cluster.min_int(-view.lead), -self.cluster.min_int(-len(silent))

    @torch.no_grad()
    def finish_round(self, flight: RoundInFlight) -> dict[str, Any]:
        """Wait for the round, decide with the policy (retrying as it says), apply the outer step, copy θ_outer
        into the model, and return the round's metrics."""
        round_no = self.outer_step + 1
        self.bad_rounds = 0
        network_wait = 0.0
        while True:
            waited = time.perf_counter()
            report, failed = self._wait(flight, round_no)
            network_wait += time.perf_counter() - waited
            overtaken = not self.cluster.all_true(not report.overtaken)  # any shard: a cluster never half-adopts
            if overtaken and flight.attempts <= self.hv.max_retries:
                self.warn(f"outer step {round_no}: the galaxy applied this round without this cluster while it "
                          "looked for a group: it adopts the galaxy's state rather than wait for the next round")
                flight = self.start_round(flight.attempts + 1)  # reads the records again: the lead is past us
                if flight.sits_out:
                    return self.sit_out(flight)
                continue  # the records said otherwise this time: a round like any other
            self._check_peers(report)
            rejected = self._ranks_by_any_rank(report.rejected)
            # peers that started from another round or θ_outer: left out by every reducer, they re-sync
            stale = self._ranks_by_any_rank(report.stale)
            left_out = self.galaxy_rank in stale
            clusters = self.cluster.min_int(report.group_size - len(rejected) - len(stale) if report.complete else 1)
            # within the cohort: those left out cannot spoil the average. A cluster left out itself is not in sync
            # even when every other peer was left out too (by another shard's reducers): nothing was compared
            in_sync = self.cluster.all_true(
                not left_out and all(meta.get("param_hash") == flight.own_hash for rank, meta in report.peers.items()
                                     if rank not in stale or rank == self.galaxy_rank)
            )
            reference = most_advanced(report.peers, self.outer_step, self.galaxy_rank)
            behind = not self.cluster.all_true(reference <= (self.outer_step, -self.galaxy_rank))
            outcome = RoundOutcome(  # a rejected cluster's Δ is garbage: waiting or retrying for it is no use
                clusters=clusters,
                alive=flight.alive - len(rejected) - len(stale),
                in_sync=in_sync,
                behind=behind,
                attempts=flight.attempts,
                left_out=left_out,
            )
            decision = self.policy.decide(outcome)
            if decision is not Decision.RETRY:
                break
            self.warn(
                f"outer step {round_no}: partial round ({clusters} of {flight.alive} live clusters): "
                f"retry {flight.attempts + 1}/{self.hv.max_retries}"
            )
            flight = self.start_round(flight.attempts + 1)
            if flight.sits_out:  # the galaxy moved on meanwhile: adopt its state rather than meet its next round
                return self.sit_out(flight)

        size = self.hv.galaxy_size
        if decision is Decision.STOP:
            raise GalaxyError(
                f"outer step {round_no}: only {clusters} of {flight.alive} live clusters averaged and "
                "--hv.on-partial-round is `fail`: stopping (use `retry` or `proceed` to tolerate missing clusters)"
            )
        if rejected:
            self.warn(
                f"outer step {round_no}: left cluster(s) {rejected} out of the average: their pseudo-gradient "
                f"was not finite, larger than they claimed, or above --hv.delta-norm-bound={self.hv.delta_norm_bound}"
                " times ours"
            )
        if stale and not left_out:
            self.warn(
                f"outer step {round_no}: left cluster(s) {stale} out of the average: they started this round from "
                "another round or θ_outer; they re-sync"
            )
        if left_out:
            self.warn(f"outer step {round_no}: this cluster started the round from another round or θ_outer than "
                      "the galaxy's most advanced cluster: its Δ was left out, it re-syncs")
            failed = True  # the buffer holds the cohort's average, taken from another θ_outer: never applied here
        self.norm_history.record(
            meta.get("delta_norm") for rank, meta in report.peers.items() if rank not in rejected and rank not in stale
        )
        if flight.alive != self._alive_before:
            self.warn(
                f"outer step {round_no}: {flight.alive} of {size} clusters alive (were {self._alive_before}): "
                "rounds now wait for these"
            )
            self._alive_before = flight.alive
        if clusters < flight.alive:
            retried = f" after {flight.attempts} retries" if flight.attempts else ""
            self.warn(f"outer step {round_no}: proceeding with {clusters} of {flight.alive} live clusters{retried}")
        reference_round = -self.cluster.min_int(-reference[0])
        wanted_step = reference_round + 1
        # a peer already in a later round may be stuck in it (waiting on us, say): its state at that round's start
        # is the galaxy's too, and far better than keeping our own
        fallback_step = reference_round if reference_round > round_no - 1 else None

        try:
            with self.averager.buffer() as averaged:
                finite = self.cluster.all_true(failed or all_finite(averaged))
                if not finite:
                    self.warn(
                        f"outer step {round_no}: the galaxy's average is not finite (a peer sent or reduced "
                        "garbage): it is not applied, this cluster takes its own pseudo-gradient this round"
                    )
                if failed or not finite:  # the buffer holds a dead round's leftovers or garbage: our own Δ again
                    self.state.pseudo_grad_for_wire_into(averaged)
                self.state.apply(averaged)
        except RoundFailed as err:  # a round that outlived its timeout still holds the buffer: nothing to apply
            raise GalaxyError(
                f"outer step {round_no}: {err} past --hv.averaging-timeout; stopping (resume from the last "
                "checkpoint)"
            ) from None
        fragment = self.state.fragment
        complete = self.cluster.all_true(bool(report.complete))  # every shard's span: one failed part spoils it
        resynced = self._resync(wanted_step, fallback_step=fallback_step) if decision is Decision.RESYNC else False
        if not resynced:  # a re-sync already put the adopted θ_outer into the whole model
            self.state.land()

        return {
            "outer_step": self.outer_step,
            "fragment": fragment,
            "fragment_hash": combine_hashes(self.cluster.gather_strings(self.state.fragment_hash(fragment))),
            "network_wait_seconds": network_wait,
            "galaxy_peers": report.group_size,
            "galaxy_alive": flight.alive,
            "galaxy_complete": complete,
            "allreduce_seconds": report.seconds,
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "retries": flight.attempts,
            # every live cluster took part and all started from this θ_outer: with one missing, nobody can tell.
            # Alone while some cluster fell silent (crashed, or cut off and training on), nothing was compared
            "in_sync": in_sync and not stale and clusters >= outcome.alive and not (clusters == 1 and flight.silent),
            "resynced": resynced,
            "pseudo_grad_finite": True,
            "pseudo_grad_in_bound": True,
            "pseudo_grad_bound": self._cluster_bound(flight.bound),
            "average_finite": finite,
            "rejected_peers": rejected,
            "pseudo_grad_norm": self._cluster_norm(flight.local_sq),
            "param_checksum": self.cluster.sum_float(self.state.sq_norm()),
            "param_hash": combine_hashes(self.cluster.gather_strings(self.state.hash())),
        }

    @torch.no_grad()
    def sit_out(self, flight: RoundInFlight) -> dict[str, Any]:
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
        adopted = self.hv.galaxy_size > 1 and self._resync(wanted, why)
        if adopted and not (flight.diverged or flight.out_of_bound):
            self._catch_up_step = self._catch_up_target()
            if self._catch_up_step > self.schedule.inner_step_of(self.outer_step):
                self.warn(f"outer step {self.outer_step}: the galaxy is already training towards the next sync: "
                          f"this cluster goes on from inner step {self._catch_up_step} to meet it there")
        self.state.scatter_into_model()
        self.state.local_at_start = None  # the whole model is θ_outer again: nothing of the fragment's to keep
        return {
            "outer_step": self.outer_step,
            "fragment": self.state.fragment,
            "network_wait_seconds": 0.0,
            "galaxy_peers": 0,
            "galaxy_alive": flight.alive,
            "galaxy_complete": False,
            "allreduce_seconds": 0.0,
            "bytes_sent": 0,
            "bytes_received": 0,
            "retries": 0,
            "in_sync": False,
            "resynced": adopted,
            "pseudo_grad_finite": not flight.diverged,
            "pseudo_grad_in_bound": not flight.out_of_bound,
            "pseudo_grad_bound": self._cluster_bound(flight.bound),
            "pseudo_grad_norm": self._cluster_norm(flight.local_sq),  # None when not finite (JSON has no NaN)
            "param_checksum": self.cluster.sum_float(self.state.sq_norm()),
            "param_hash": combine_hashes(self.cluster.gather_strings(self.state.hash())),
        }

    def _cluster_norm(self, local_sq: float) -> float | None:
        """‖Δ‖ of the whole cluster (every shard); ``None`` when not finite (or never computed)."""
        total = self.cluster.sum_float(local_sq)
        return total**0.5 if math.isfinite(total) else None

    def _cluster_bound(self, bound: float | None) -> float | None:
        """The sender-side bound for the whole cluster's ‖Δ‖ (each shard's bound, combined like norms)."""
        total = self.cluster.sum_float(bound**2 if bound is not None else float("nan"))
        return total**0.5 if math.isfinite(total) else None

    def _ranks_by_any_rank(self, ranks: list[int]) -> list[int]:
        """Galaxy ranks some shard's report names (left out as garbage, or out of the cohort), the same list on
        every rank of the cluster."""
        gathered = self.cluster.gather_strings(",".join(map(str, ranks)))
        return sorted({int(rank) for ranks in gathered for rank in ranks.split(",") if rank})

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

    def _resync(self, wanted_step: int, why: str = "θ_outer differed from the galaxy",
                fallback_step: int | None = None) -> bool:
        """Adopt the outer state (θ_outer, momentum, round counter) of the galaxy's most advanced cluster after
        a hash mismatch, and say whether it worked.

        The peer may still be applying the round we want, so an older state is refused and asked for again,
        for at most ``--hv.join-timeout`` in all; then a state at ``fallback_step`` or later, if one came, is
        taken instead (the cluster is a round behind and catches up at its next round, as a late joiner does).
        Every local rank takes part and all must end on the same round, else the cluster keeps its own state on
        every shard (never a mix)."""
        deadline = time.monotonic() + self.hv.join_timeout
        downloaded = fallback = None
        while (left := deadline - time.monotonic()) > 0:
            downloaded = self.averager.download_state(left)
            step = int(downloaded[0].get("outer_step", -1)) if downloaded is not None else -1
            if step >= wanted_step:
                break
            if fallback_step is not None and step >= fallback_step:
                fallback = downloaded
            downloaded = None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        downloaded = downloaded or fallback
        step = int(downloaded[0]["outer_step"]) if downloaded is not None else -1
        ok = step >= 0 and self.cluster.min_int(step) == step == -self.cluster.min_int(-step)
        if ok:
            previous = self.outer_step
            self.state.adopt(*downloaded)
            self.warn(f"outer step {previous}: {why}: adopted a peer's state at outer step {self.outer_step}")
        else:
            self.warn(f"outer step {self.outer_step}: {why} and re-sync failed")
        return ok

    def report(self, record: dict[str, Any]) -> None:
        if isinstance(seconds := record.get("step_seconds"), float) and seconds > 0:
            self._step_seconds = seconds if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * seconds
        self.status.update(record)
        self._finished = record.get("state") == "finished"

    def close(self) -> None:
        try:
            self.status.close()  # while the DHT still runs
        finally:  # a finished run may wait for the peers of its last round to take their averages; a stop may not
            self.averager.shutdown(finished=self._finished)
