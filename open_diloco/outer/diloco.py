"""DiLoCo's outer loop for one shard of one cluster: :class:`DiLoCo` owns the outer state and drives rounds on
the schedule of ``outer/streaming.py`` (back to back every H inner steps by default, or one fragment of the
model every H/P steps with the round in flight for ``--hv.sync-delay`` inner steps while training goes on).
Its parts: ``outer/committing.py`` runs and commits a round, ``outer/catching_up.py`` takes the galaxy's state
instead (joining, a round another cluster committed, sitting out, the last round's check).

Cluster-level decisions (commit, retry, adopt) are agreed by all local ranks through :class:`ClusterComm`, so
every shard of a cluster follows the same path, through the same collectives.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from open_diloco.errors import ConfigError
from open_diloco.outer.adoption import Downloaded, StateAdoption
from open_diloco.outer.catching_up import CatchingUp
from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.codecs import build_compressor, codec_label
from open_diloco.outer.committing import Committing
from open_diloco.outer.digests import combine_hashes
from open_diloco.outer.guard import NormHistory
from open_diloco.outer.ledger import Ledger, LedgerEntry, round_entry
from open_diloco.outer.pacing import Pace
from open_diloco.outer.policy import RoundPolicy
from open_diloco.outer.protocols import (
    Averager,
    NullStatusBoard,
    RoundReport,
    StatusBoard,
)
from open_diloco.outer.round import RoundInFlight, RoundResult
from open_diloco.outer.state import OuterState
from open_diloco.outer.streaming import SyncSchedule

if TYPE_CHECKING:
    from open_diloco.config import HvConfig

LEDGER_LOCK_SECONDS = 10.0
"""The most a state download waits for a commit in progress to write its ledger entry."""


class DiLoCo(Committing, CatchingUp):
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
        """The trainer reported the run finished (not stopped): leaving may wait for the last round's
        peers."""
        self.bad_rounds = 0
        """Rounds in a row this cluster sat out with a bad pseudo-gradient (not finite, or out of bound)."""
        self.norm_history = NormHistory(hv.delta_norm_bound)
        self.hv = hv
        self.galaxy_rank = hv.world_rank
        self.policy = RoundPolicy(hv.on_partial_round, hv.max_retries)
        self.cluster = cluster or ClusterComm(next(model.parameters()).device)
        self.warn = warn
        self.schedule = SyncSchedule(hv.local_steps, hv.fragments, hv.sync_delay)
        self.pace = Pace(hv.local_steps, hv.fragments, hv.round_steps == "by-speed", hv.cluster_speed)
        """Which galaxy steps this cluster trains at, and the weight of each sync (``--hv.round-steps``)."""
        self._fastest_seconds: float | None = None
        """The least seconds per inner step a live cluster published, as the last round's start read it."""
        self._round_weight = 1.0
        """The weight of the sync being started (retries of it send the same)."""
        self._round_inner_steps: int | None = None
        """The inner steps behind the sync being started (its ledger entry names them)."""
        self._sync_pace: dict[int, tuple[int, float]] = {}
        """(inner steps behind the Δ, weight) of each started sync by its round number, for its metrics."""
        self.in_flight: RoundInFlight | None = None
        """The round running in the background while inner steps go on (``--hv.sync-delay``)."""
        self._window_start: float | None = None
        self._held = 0.0
        """Seconds the trainer spent in the outer loop since the last round's metrics (for compute
        utilization)."""
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
        self.ledger = Ledger()
        """The chain of committed rounds this cluster's θ_outer went through (``outer/ledger.py``)."""
        self._ledger_lock = threading.Lock()
        """Held while θ_outer and the ledger change together (a commit, an adoption), so a served state
        always carries the chain that ends at its θ (:meth:`_served_state`)."""
        self.averager.serve_state(self._served_state)
        self.adoption = StateAdoption(averager, self.cluster, self.galaxy_rank, warn)
        self._last_round: RoundResult | None = None
        """The run's last round, until :meth:`settle_run` settles it."""
        self._final_hash: str | None = None
        """``param_hash`` of the last round this cluster ended, for :meth:`verify_final`."""

    @property
    def outer_step(self) -> int:
        return self.state.outer_step

    @property
    def fragments(self) -> int:
        return self.hv.fragments

    def _served_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a peer downloads (the averager's thread): the shard's outer state and the ledger's tail that
        ends at it. A commit in progress holds the ledger lock from θ_outer's change to its entry; a download
        waits for it (bounded), else it serves no chain rather than one that does not end at its θ."""
        held = self._ledger_lock.acquire(timeout=LEDGER_LOCK_SECONDS)
        try:
            metadata, tensors = self.state.snapshot()
            tail = self.ledger.tail() if held else []
        finally:
            if held:
                self._ledger_lock.release()
        return {**metadata, "galaxy_rank": self.galaxy_rank, "ledger": tail}, tensors

    @contextlib.contextmanager
    def changing_state(self) -> Iterator[None]:
        """Around a change of θ_outer and the ledger together (see :meth:`_served_state`)."""
        with self._ledger_lock:
            yield

    def own_round_metadata(self) -> dict[str, Any]:
        """What this cluster says of itself in every round's metadata, for the members' ledger entries."""
        hv = self.hv
        return {
            "weight": self._round_weight,
            "inner_steps": self._round_inner_steps,
            "codec": codec_label(hv.compression, hv.sparse_density, hv.sparse_rule),
            "outer_optimizer": (
                f"sgd lr={hv.outer_lr:g} momentum={hv.outer_momentum:g} nesterov={hv.outer_nesterov} "
                f"warmup_rounds={hv.outer_warmup_rounds}"
            ),
        }

    def cluster_hash(self, shard_hash: str | None = None) -> str:
        """``param_hash`` of the whole cluster's θ_outer (every shard's hash, combined), from this shard's
        ``shard_hash`` (default: its θ_outer now). Collective."""
        return combine_hashes(self.cluster.gather_strings(shard_hash or self.state.hash()))

    # -- the ledger ----------------------------------------------------------------------------------------
    def _record_commit(
        self,
        flight: RoundInFlight,
        report: RoundReport,
        fragment: int,
        before: str,
        members: set[int],
        alone: bool,
    ) -> LedgerEntry:
        """The committed round's ledger entry, appended to this cluster's chain: rank 0's, on every rank (its
        shard's report names the members' metadata; every rank holds the same ``before`` and ``after``)."""
        peers = {**report.peers, self.galaxy_rank: self.own_round_metadata()}
        entry = round_entry(
            round_no=self.outer_step,
            attempt=flight.attempts,
            fragment=fragment,
            before=before,
            after=self.cluster_hash(),
            peers=peers,
            members=members,
            alone=alone,
        )
        (wire,) = self.cluster.broadcast_strings([json.dumps(entry.to_wire())])
        entry = LedgerEntry.from_wire(json.loads(wire))
        if broken := self.ledger.append(entry):
            self.warn(broken)
        return entry

    def _take_state(self, got: Downloaded, own_round: bool = False) -> None:
        """θ_outer and the chain that ends at it, from one download, together (``outer/ledger.py``):
        ``own_round``: the round this cluster sent its Δ to, taken as its own commit
        (:meth:`OuterState.adopt_round`), else a re-sync onto the source's trajectory."""
        with self.changing_state():
            if own_round:
                self.state.adopt_round(got.metadata, got.tensors)
            else:
                self.state.adopt(got.metadata, got.tensors)
            self.ledger.take(got.metadata.get("ledger"))

    def held_entry(self) -> LedgerEntry | None:
        """The ledger entry of the θ_outer this cluster holds now (``None``: its chain does not reach it, e.g.
        a source of an older version served none)."""
        last = self.ledger.last
        return last if last is not None and last.round == self.outer_step else None

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this shard's outer state (:meth:`OuterLoop.state_dict`), θ_outer itself
        where the schedule lets the model differ from it at a save (fragments, a sync delay)."""
        state = self.state.checkpoint_state(streaming=self.schedule.streaming)
        if (pace := self.pace.state_dict()) is not None:
            state["pace"] = pace
        state["param_hash"] = self.cluster_hash()
        if self.ledger.entries:
            state["ledger"] = self.ledger.state_dict()
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

    # -- the outer step -------------------------------------------------------------------------------------
    def after_inner_step(self, inner_step: int, last: bool = False, trained: bool = True) -> dict[str, Any]:
        """The metrics of the latest sync :meth:`syncs_after_inner_step` ended, else ``{}`` (tests,
        benches)."""
        results = self.syncs_after_inner_step(inner_step, last, trained)
        return results[-1].metrics() if results else {}

    def trains_at(self, inner_step: int) -> bool:
        """See :class:`OuterLoop` (``outer/pacing.py``)."""
        return self.pace.trains_at(inner_step)

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
        if self._window_start is None:
            self._window_start = began
        results: list[RoundResult] = []
        if self.in_flight is not None and (inner_step >= self.in_flight.lands_at or last):
            flight, self.in_flight = self.in_flight, None
            results.append(self.finish_round(flight))
        # (at τ = H/P a landing that re-synced may have adopted a state past this sync: the galaxy ran it
        # already)
        skip = bool(results) and self.inner_step_of_galaxy() >= inner_step
        if (
            self.schedule.starts_sync(inner_step)
            and not skip
            and (result := self._start_sync(inner_step, last))
        ):
            results.append(result)
        self._held += time.perf_counter() - began
        if results:
            window = time.perf_counter() - self._window_start
            # the share of the wall time since the last round's metrics that the trainer was not held by the
            # outer loop (Δ, matchmaking and all-reduce waits, the outer step): 1.0 when the network is hidden
            utilization = max(0.0, 1.0 - self._held / window) if window > 0 else 1.0
            for result in results:
                result.compute_utilization = utilization
                if self.pace.by_speed and (pace := self._sync_pace.get(result.outer_step)):
                    result.round_inner_steps, result.round_weight = pace
            self._sync_pace = {rnd: pace for rnd, pace in self._sync_pace.items() if rnd > self.outer_step}
            self._last_round = results[-1] if last else None
            self._final_hash = results[-1].param_hash
            self._window_start, self._held = time.perf_counter(), 0.0
        return results

    def settle_run(self) -> RoundResult | None:
        """See ``OuterLoop.settle_run`` (``CatchingUp.settle_final``). Apart from the last step's rounds so
        that their records are written when they end: the settling may wait for a partition to heal
        (``--hv.final-wait``), and dashboards (and the chaos soak's judge) read the record's time."""
        last, self._last_round = self._last_round, None
        if last is None:
            return None
        settled = self.settle_final(last)
        if settled is not None:  # the galaxy split and its larger side ended elsewhere
            self._final_hash = settled.param_hash
        return settled

    def _start_sync(self, inner_step: int, last: bool) -> RoundResult | None:
        """Start the sync of the next fragment; finish it at once without a delay (or at the run's end)."""
        delay = 0 if last else self.schedule.sync_delay
        fragment = self.schedule.fragment_of(self.outer_step)
        self._round_weight = self.pace.weight_of(fragment)
        self._round_inner_steps = self.pace.since_sync[fragment]
        self._sync_pace[self.outer_step + 1] = (self.pace.since_sync[fragment], self._round_weight)
        self.pace.synced(fragment)
        self.state.begin_round(fragment, keep_local=delay > 0)
        flight = self.start_round()
        if self.pace.by_speed:  # the next stride's steps, from the speeds this round's start read
            self.pace.agree(self.cluster.min_int(self.pace.plan(self._step_seconds, self._fastest_seconds)))
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

    def report(self, record: dict[str, Any]) -> None:
        if isinstance(seconds := record.get("step_seconds"), float) and seconds > 0:
            self._step_seconds = (
                seconds if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * seconds
            )
        if self.pace.by_speed and self._step_seconds is not None:
            record = {**record, "inner_step_seconds": self._step_seconds}  # the others plan by it
        self.status.update(record)
        self._finished = record.get("state") == "finished"

    def close(self) -> None:
        try:
            if self._finished and self._final_hash and not isinstance(self.status, NullStatusBoard):
                self.verify_final(self._final_hash)  # the cluster's rank 0 (it publishes, so it may read)
            self.status.close()  # while the DHT still runs
        finally:
            # a finished run may wait for the peers of its last round to take their averages; a stop may not
            self.averager.shutdown(finished=self._finished)
