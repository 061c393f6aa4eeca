"""DiLoCo's outer loop for one shard of one cluster: :class:`DiLoCo` owns the outer state and drives rounds on
the schedule of ``outer/streaming.py`` (back to back every H inner steps by default, or one fragment of the
model every H/P steps with the round in flight for ``--hv.sync-delay`` inner steps while training goes on).
Its parts, composed: ``outer/round.py`` is one round from its start to what it came to,
``outer/catching_up.py`` takes the galaxy's state instead (joining, re-syncing, the run's end), and
``outer/committed_state.py`` keeps θ_outer and the ledger chain that ends at it together.

Cluster-level decisions (commit, retry, adopt) are agreed by all local ranks through :class:`ClusterComm`, so
every shard of a cluster follows the same path, through the same collectives.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from open_diloco.errors import ConfigError, GalaxyMismatch
from open_diloco.outer.adoption import StateAdoption
from open_diloco.outer.catching_up import CatchUp
from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.codecs import build_compressor
from open_diloco.outer.committed_state import CommittedState
from open_diloco.outer.goodput import Goodput
from open_diloco.outer.guard import NormHistory
from open_diloco.outer.hold_pause import pause_while_held
from open_diloco.outer.ledger import Ledger
from open_diloco.outer.own_pages import OwnPages
from open_diloco.outer.pacing import Pace, StepTime
from open_diloco.outer.policy import RoundPolicy
from open_diloco.outer.protocols import Averager, NullStatusBoard, StatusBoard
from open_diloco.outer.round import Contribution, Round, RoundContext
from open_diloco.outer.round_result import RoundResult
from open_diloco.outer.state import OuterState
from open_diloco.outer.streaming import SyncSchedule

if TYPE_CHECKING:
    from open_diloco.config import HvConfig


class DiLoCo:
    """The outer loop of one shard: θ_outer and momentum in :class:`OuterState`, rounds as :class:`Round`
    objects through an :class:`Averager`, decisions by :class:`RoundPolicy`. The inner optimizer is untouched:
    its state carries across rounds."""

    def __init__(
        self,
        model: torch.nn.Module,
        averager: Averager,
        hv: HvConfig,
        *,
        cluster: ClusterComm | None = None,
        warn: Any = print,
        status: StatusBoard | None = None,
        tokens_per_step: int = 1,
    ):
        self.averager, self.status, self.hv, self.warn = averager, status or NullStatusBoard(), hv, warn
        self.galaxy_rank, self.fragments = hv.world_rank, hv.fragments
        self.cluster = cluster or ClusterComm(next(model.parameters()).device)
        self._finished = False
        """The trainer reported the run finished (not stopped): leaving may wait for its last peers."""
        self.schedule = SyncSchedule(hv.local_steps, hv.fragments, hv.sync_delay)
        self.pace = Pace(hv.local_steps, hv.fragments, hv.round_steps == "by-speed", hv.cluster_speed)
        """Which galaxy steps this cluster trains at, and the weight of each sync (``--hv.round-steps``)."""
        self.step_time = StepTime()
        self.own_pages = OwnPages.of(hv, self.pace, lambda: self.ledger.last and self.ledger.last.dealt)
        """An elastic galaxy's pages dealt to this cluster and carried by its Δ (``outer/deal.py``)."""
        self._sync_pace: dict[int, tuple[int, float]] = {}
        """(inner steps behind the Δ, weight) of each started sync by its round number, for its metrics."""
        self.in_flight: Round | None = None
        """The round running in the background while inner steps go on (``--hv.sync-delay``)."""
        self._resumed_contribution: Contribution | None = None  # set by load_state_dict, read by join_galaxy
        self._window_start: float | None = None
        self._held = 0.0
        """Seconds the trainer spent in the outer loop since the last round's metrics (for utilization)."""
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
        self.goodput = Goodput(self.galaxy_rank, max(1, tokens_per_step), hv.local_steps, hv.fragments)
        deals = self.pace.stride if hv.elastic else None
        self.committed = CommittedState(self.state, self.cluster, self.galaxy_rank, warn, self.goodput, deals)
        """θ_outer with the ledger chain that ends at it: what a commit changes and a peer downloads."""
        self.averager.serve_state(self.committed.served)
        adoption = StateAdoption(
            averager, self.cluster, self.galaxy_rank, warn, own_work=lambda: self.committed.work
        )
        self.catch_up = CatchUp(
            hv,
            self.committed,
            averager,
            self.cluster,
            adoption,
            self.schedule,
            self.status,
            self.step_time,
            warn,
        )
        self.rounds = RoundContext(
            hv=hv,
            committed=self.committed,
            averager=averager,
            cluster=self.cluster,
            status=self.status,
            policy=RoundPolicy(hv.on_partial_round, hv.max_retries),
            norm_history=NormHistory(hv.delta_norm_bound),
            adoption=adoption,
            catch_up=self.catch_up,
            galaxy_rank=self.galaxy_rank,
            warn=warn,
            alive_before=hv.galaxy_size,
            tokens_per_step=max(1, tokens_per_step),
        )
        """What every round works with (``outer/round.py``)."""
        self._last_round: RoundResult | None = None
        """The run's last round, until :meth:`settle_run` settles it."""
        self._final_hash: str | None = None
        """``param_hash`` of the last round this cluster ended, for ``CatchUp.verify_final``."""

    joined: dict[str, Any] | None = None  # the record of a state taken as it joined (OuterLoop.joined)

    @property
    def outer_step(self) -> int:
        return self.state.outer_step

    @property
    def ledger(self) -> Ledger:
        return self.committed.ledger

    def join_galaxy(self) -> int:
        """Adopt the galaxy's outer state if a live cluster's record shows it ahead of this one (a late
        joiner, or a resume from an older checkpoint), else send again a round a checkpoint holds in flight;
        return the inner step to continue after."""
        previous = self.outer_step
        self.status.update({"committed_work": self.committed.work})  # the others compare their chain to it
        got = self.catch_up.take_newer()
        if got is None and self.hv.elastic and not self.ledger.entries:
            self._refuse_a_second_genesis()
        if got is not None:  # θ_local is the downloaded θ_outer: no step of ours is behind its next Δ
            self.pace.dropped()
            if self.own_pages is not None:
                self.own_pages.reset()
            self.joined = {"event": "took_state", "galaxy_outer_step": got.step, "state_source": got.source}
            self.warn(
                f"the galaxy is at outer step {got.step} (this cluster was at {previous}): downloaded "
                f"θ_outer and the outer momentum from cluster {got.source} "
                f"(param_hash {self.committed.cluster_hash()})"
            )
        elif self._resumed_contribution is not None:  # resumed from a checkpoint, the galaxy not ahead of it
            in_flight = self.state.local_at_start is not None
            resumed_at = self.schedule.inner_step_of(self.outer_step + int(in_flight))
            self.pace.resume_at(resumed_at)
            if in_flight:  # a checkpoint taken with a round in flight: send it again (every cluster
                # resumed from the same step does the same, so the round meets and lands where it would have)
                self.warn(
                    f"outer step {self.outer_step + 1}: the checkpoint holds this round in flight: "
                    "sending it again"
                )
                resent = self._resumed_contribution
                self._sync_pace[self.outer_step + 1] = (resent.inner_steps or 0, resent.weight)
                lands_at = resumed_at + self.schedule.sync_delay
                self._hold(Round.start(self.rounds, resent), resumed_at, lands_at)
        self._resumed_contribution = None
        return self.inner_step_of_galaxy()

    def inner_step_of_galaxy(self) -> int:
        return self.catch_up.inner_step_of_galaxy()

    def _refuse_a_second_genesis(self) -> None:
        """An elastic cluster with no chain, which no live cluster is ahead of, would make the run's first
        round: refused when the DHT's ledger mirror holds one already (the galaxy ran, and its clusters are
        gone or stopped): a second first round would start another history, and deal its pages again, under
        the same run id."""
        genesis = self.averager.genesis_entry()
        if self.cluster.all_true(genesis is None):
            return
        members = sorted(m["rank"] for m in genesis["members"]) if genesis else "?"
        raise GalaxyMismatch(
            f"--hv.run-id {self.hv.run_id} had its first round already (members {members}; the DHT's ledger "
            "mirror holds it), and this cluster holds no chain of it nor took a running cluster's state: "
            "resume from a checkpoint of that galaxy (--ckpt.resume), join while one of its clusters runs, "
            "or start a new galaxy with another --hv.run-id"
        )

    def go_on_from(self, inner_step: int) -> int:
        rewind, self.catch_up.rewind_to = self.catch_up.rewind_to, None
        return rewind if rewind is not None else max(inner_step, self.inner_step_of_galaxy())

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this shard's outer state (:meth:`OuterLoop.state_dict`), θ_outer itself
        where the schedule lets the model differ from it at a save (fragments, a sync delay)."""
        state = self.state.checkpoint_state(streaming=self.schedule.streaming)
        if (pace := self.pace.state_dict()) is not None:
            state["pace"] = pace
        state["param_hash"] = self.committed.cluster_hash()
        if self.ledger.entries:
            state["ledger"] = self.ledger.state_dict()
        state["goodput"] = self.goodput.state_dict()
        if self.own_pages is not None:
            state["own_pages"] = self.own_pages.state_dict()
        if self.in_flight is not None and "sync_start" in state:
            sent = self.in_flight.contribution
            state["in_flight"] = {"weight": sent.weight, "inner_steps": sent.inner_steps}
            state["in_flight"] |= {"carries": sent.carries} if sent.carries is not None else {}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a checkpoint's outer state (:meth:`OuterLoop.load_state_dict`). A round it holds in flight is
        sent again by :meth:`join_galaxy`: it must be a round of this run's fragments."""
        saved_fragments = int(state_dict.get("fragments", 1))
        if "sync_start" in state_dict and saved_fragments != self.hv.fragments:
            raise ConfigError(
                f"the checkpoint holds a round of one of {saved_fragments} fragments in flight, this run has "
                f"--hv.fragments {self.hv.fragments}: resume with --hv.fragments {saved_fragments}"
            )
        if not self.state.sparse_scores_fit(state_dict.get("sparse_scores")):
            self.warn(
                "the checkpoint holds no sparse block scores for this rank's shard (saved with another "
                "number of ranks, or another --hv.compression): they start from zero, so each fragment's "
                "next round picks its blocks at random, as a first round does"
            )
        self.state.load_checkpoint_state(state_dict)
        self.pace.load_state_dict(state_dict.get("pace"))
        self.ledger.load_state_dict(state_dict.get("ledger"))
        self.goodput.load_state_dict(state_dict.get("goodput"))
        if self.own_pages is not None:
            self.own_pages.load_state_dict(state_dict.get("own_pages"))
        # the contribution of a round the checkpoint holds in flight (its weight and inner steps): sent again
        # as it was, its average and its ledger entry are the straight run's. A checkpoint of before this
        # kept none: weight 1, no step count, as such rounds were sent.
        self._resumed_contribution = Contribution(**(state_dict.get("in_flight") or {}))

    # -- the outer step -------------------------------------------------------------------------------------
    def after_inner_step(self, inner_step: int, last: bool = False, trained: bool = True) -> dict[str, Any]:
        """The metrics of the latest sync :meth:`syncs_after_inner_step` ended, else ``{}`` (tests,
        benches)."""
        results = self.syncs_after_inner_step(inner_step, last, trained)
        return results[-1].metrics() if results else {}

    def trains_at(self, inner_step: int) -> bool:
        """See :class:`OuterLoop` (``outer/pacing.py``; an elastic galaxy's step trains only with a page)."""
        if self.own_pages is not None:
            return self.own_pages.page_at(inner_step) is not None
        return self.pace.trains_at(inner_step)

    def page_at(self, inner_step: int) -> int | None:
        """See :class:`OuterLoop`."""
        return None if self.own_pages is None else self.own_pages.page_at(inner_step)

    def pages_from(self, inner_step: int) -> list[int] | None:
        """See :class:`OuterLoop`."""
        return None if self.own_pages is None else self.own_pages.upcoming(inner_step)

    def data_position(self, inner_step: int) -> int:
        """See :class:`OuterLoop`."""
        return self.pace.data_position(inner_step)

    def syncs_after_inner_step(
        self, inner_step: int, last: bool = False, trained: bool = True
    ) -> list[RoundResult]:
        """Land the round in flight when its delay is over, start a sync when ``inner_step`` is on the
        schedule (see :class:`OuterLoop`); ``last``: the run ends here, so nothing stays in flight;
        ``trained``: the cluster took an inner step at this galaxy step (``--hv.round-steps by-speed``).
        Returns every round that landed (or was sat out), oldest first: two when τ = H/P lands one sync at
        the step the next starts and that one ends at once too (sat out, or at the run's end)."""
        began = time.perf_counter()
        self.pace.count(trained)
        if trained and self.own_pages is not None:
            self.own_pages.trained(inner_step)
        if trained:
            self.goodput.trained()
        if self._window_start is None:
            self._window_start = began
        results: list[RoundResult] = []
        if self.in_flight is not None and (inner_step >= self.in_flight.lands_at or last):
            flight, self.in_flight = self.in_flight, None
            results.append(flight.finish())
            results[-1].sync_step = flight.started_after
            self._after_round(results[-1])
        # (at τ = H/P a landing that re-synced may have adopted a state past this sync: the galaxy ran it
        # already)
        skip = bool(results) and self.inner_step_of_galaxy() >= inner_step
        if (
            self.schedule.starts_sync(inner_step)
            and not skip
            and (result := self._start_sync(inner_step, last))
        ):
            results.append(result)
            self._after_round(result)
        # after a take, a sync in flight is the one this step started (a landing clears the one before)
        held = any(result.outcome == "held" for result in results)
        if held and not last:  # what it trains cannot commit before news comes (outer/hold_pause.py)
            pause_while_held(self.rounds)
        back_to = self.catch_up.clock_after(inner_step, self.in_flight is not None, last, held)
        if back_to is not None and self.in_flight is not None:
            shift = inner_step - back_to  # it started and lands as far into the galaxy's clock
            self.in_flight.started_after -= shift
            self.in_flight.lands_at -= shift
        self._held += time.perf_counter() - began
        if results:
            window = time.perf_counter() - self._window_start
            # the share of the wall time since the last round's metrics that the trainer was not held by the
            # outer loop (Δ, matchmaking and all-reduce waits, the outer step): 1.0 when the network is hidden
            utilization = max(0.0, 1.0 - self._held / window) if window > 0 else 1.0
            for result in results:
                result.compute_utilization = utilization
                result.goodput = self.goodput.metrics()
                if self.pace.by_speed and (pace := self._sync_pace.get(result.outer_step)):
                    result.round_inner_steps, result.round_weight = pace
            self._sync_pace = {rnd: pace for rnd, pace in self._sync_pace.items() if rnd > self.outer_step}
            self._last_round = results[-1] if last else None
            self._final_hash = results[-1].param_hash
            self._window_start, self._held = time.perf_counter(), 0.0
        return results

    def settle_run(self) -> RoundResult | None:
        """See ``OuterLoop.settle_run`` (``CatchUp.settle_final``). Apart from the last step's rounds so
        that their records are written when they end: the settling may wait for a partition to heal
        (``--hv.final-wait``), and dashboards (and the chaos soak's judge) read the record's time."""
        last, self._last_round = self._last_round, None
        if last is None:
            return None
        settled = self.catch_up.settle_final(last)
        if settled is not None:  # the galaxy split and its larger side ended elsewhere
            self._final_hash = settled.param_hash
            settled.goodput = self.goodput.metrics()
        return settled

    def _after_round(self, result: RoundResult) -> None:
        """What the round did to the steps (and an elastic galaxy's pages) behind the next Δ."""
        if result.dropped_progress:
            self.pace.dropped()
        if self.own_pages is not None:
            self.own_pages.round_ended(result)

    def _contribution(self, fragment: int) -> Contribution:
        """What the next sync puts in beside its Δ: by pacing (``outer/pacing.py``), or in an elastic galaxy
        the pages the Δ carries (its weight counts them)."""
        if self.own_pages is None:
            return Contribution(self.pace.weight_of(fragment), self.pace.since_sync[fragment])
        weight, pages, carries = self.own_pages.contribution(self.outer_step + 1, self.hv.local_steps)
        return Contribution(weight, pages, carries)

    def _start_sync(self, inner_step: int, last: bool) -> RoundResult | None:
        """Start the sync of the next fragment; finish it at once without a delay (or at the run's end)."""
        delay = 0 if last else self.schedule.sync_delay
        fragment = self.schedule.fragment_of(self.outer_step)
        contribution = self._contribution(fragment)
        self._sync_pace[self.outer_step + 1] = (contribution.inner_steps or 0, contribution.weight)
        self.pace.synced(fragment)
        self.state.begin_round(fragment, keep_local=delay > 0)
        flight = Round.start(self.rounds, contribution)
        if self.pace.by_speed:  # the next stride's steps, from the speeds this round's start read
            planned = self.pace.plan(self.step_time.seconds, self.rounds.fastest_seconds)
            self.pace.agree(self.cluster.min_int(planned))
        at_once = delay == 0 and not flight.sits_out
        result = flight.finish() if at_once else self._hold(flight, inner_step, inner_step + delay)
        if result is not None:
            result.sync_step = inner_step
        return result

    def _hold(self, flight: Round, started_after: int, lands_at: int) -> RoundResult | None:
        """Keep a round started after inner step ``started_after`` in flight until ``lands_at``, or sit it out
        at once."""
        if flight.sits_out:
            return flight.sit_out()
        flight.started_after, flight.lands_at, self.in_flight = started_after, lands_at, flight
        return None

    def step(self) -> dict[str, Any]:
        """One blocking outer step of the next fragment: start the round and finish it (or sit it out, see
        :meth:`Round.sit_out`); its metrics."""
        self.state.begin_round(self.schedule.fragment_of(self.outer_step), keep_local=False)
        flight = Round.start(self.rounds, Contribution())
        return (flight.sit_out() if flight.sits_out else flight.finish()).metrics()

    def report(self, record: dict[str, Any]) -> None:
        self.step_time.observe(record)
        if self.pace.by_speed and self.step_time.seconds is not None:
            record = {**record, "inner_step_seconds": self.step_time.seconds}  # the others plan by it
        self.status.update(record)
        self._finished = record.get("state") == "finished"

    def close(self) -> None:
        try:
            if self._finished and self._final_hash and not isinstance(self.status, NullStatusBoard):
                self.catch_up.verify_final(self._final_hash)  # the cluster's rank 0 (it publishes: reads)
            self.status.close()  # while the DHT still runs
        finally:
            # a finished run may wait for the peers of its last round to take their averages; a stop may not
            self.averager.shutdown(finished=self._finished)
