"""One shard's hivemind averager, and the adapter that gives the outer loop its ``Averager``.

``galaxy/build.py`` starts them from the configuration (wire compression included); what lives here is how a
round runs once they exist."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from hivemind.utils import get_dht_time

from open_diloco.errors import GalaxyMismatch, RoundFailed
from open_diloco.galaxy.allowlist import Allowlist
from open_diloco.galaxy.canonical_averager import GRACE_SECONDS, STATE_NUMELS, CanonicalAverager
from open_diloco.galaxy.cut_off import CutOffWatch
from open_diloco.galaxy.dht import (
    DHT_PIPE_LOCK,
    REBOOTSTRAP_SECONDS,
    GalaxyDHT,
    forget_finished_searches,
    rebootstrap,
    shutdown_dht,
)
from open_diloco.galaxy.ledger_mirror import first_round
from open_diloco.galaxy.lifecycle import end_child
from open_diloco.galaxy.link_probe import LinkProbe
from open_diloco.galaxy.record_ages import RecordAges
from open_diloco.galaxy.round_wait import HivemindRound, round_key_bits
from open_diloco.galaxy.status import read_records, status_key
from open_diloco.membership_record import (
    departed,
    lead_of,
    lead_progress,
    never_heard,
    no_reachable_cluster,
    past_round,
    previous_lives,
    schema_conflict,
    silent,
)
from open_diloco.outer.codecs import wire_codecs
from open_diloco.outer.guard import wire_norm
from open_diloco.outer.matchmaking import MatchmakingClock, MatchmakingPlan
from open_diloco.outer.protocols import MEMBERSHIP_READ_SECONDS, Membership, RoundReport

if TYPE_CHECKING:
    from open_diloco.config import HvConfig

log = logging.getLogger(__name__)

NOT_HEARD_SECONDS = 120.0
"""How long after this peer's start a cluster of the galaxy with no record still counts as alive. A galaxy
that starts together waits for all of it: clusters' starts differ by tens of seconds (torchrun, the model,
the DHT). One not come by then is not coming soon, and waiting for it cost every round two retries (~40 s
against ~13 s a round over `home`, in the soak's late joiner); it joins late, as a restarted cluster does."""

SETTINGS_SECONDS = 10.0  # how long the averager's process may take to set up a round's matchmaking
SHUTDOWN_SECONDS = 3.0  # what the averager gets to shut down in order before it is ended by PID
DRAIN_SECONDS = 3.0  # at a stop: how long after a round with others this peer's p2pd stays up, at most
FINISH_DRAIN_SECONDS = 15.0  # at a run's end: the same, waiting for its last round's peers to finish it


class HivemindAverager:
    """One shard's averager: a DHT node plus a :class:`CanonicalAverager` over a flat fp32 buffer.

    The buffer is hivemind's own (moved to shared memory so its process can average it in place), and it is
    the buffer the outer loop computes Δ into: no private copy of the shard. Access goes through
    :meth:`buffer`, under hivemind's tensor lock, so a round that outlived its timeout can never write into
    a Δ being computed.
    """

    def __init__(
        self,
        dht: GalaxyDHT,
        averager: CanonicalAverager,
        hv: HvConfig,
        *,
        shard_index: int,
        schema: dict[str, Any],
        initial_peers: Sequence[str],
        allowlist: Allowlist | None,
        wire_buffer: torch.Tensor,
    ):
        """Made by ``galaxy.build.start_shard_averager``, which starts ``dht`` and ``averager``."""
        self.dht, self.averager = dht, averager
        self.wire_buffer = wire_buffer
        """The whole flat buffer a round averages, in shared memory: the values, then (sparse ``magnitude``)
        the block scores; hivemind's tensors are views of it."""
        self.sparse_rule = hv.sparse_rule
        self.shard_index = shard_index
        """Which shard of the cluster this averager serves: it averages with the same shard of every other
        cluster."""
        self.galaxy_rank, self.galaxy_size, self.elastic = hv.world_rank, hv.galaxy_size, hv.elastic
        self.alone = hv.alone  # a galaxy of one by its flags: its rounds need no DHT
        self.averaging_timeout, self.join_timeout = hv.averaging_timeout, hv.join_timeout
        self.status_key, self.member_expiry, self.run_id = status_key(hv.run_id), hv.member_expiry, hv.run_id
        self.record_ages = RecordAges(self.member_expiry)
        """Ages of the records on this machine's clock, kept across reads (``galaxy/record_ages.py``)."""
        self.schema = schema
        """What this cluster must share with the others to average (``membership_record.SCHEMA_KEYS``)."""
        self.allowlist = allowlist
        self.compression, self.initial_peers = hv.compression, list(initial_peers)
        """Where this peer's DHT node joined, asked again now and then (``galaxy.dht.rebootstrap``)."""
        self._rebootstrapped = float("-inf")
        self._started = time.monotonic()
        self.clock = MatchmakingClock(hv.matchmaking_time, hv.averaging_timeout / 4)
        """Round trips to the counterparts and whole rounds' matchmaking: each round's plan
        (``outer/matchmaking.py``)."""
        self.link_probe = LinkProbe(dht, self.clock)
        self.cut_off = CutOffWatch(dht, hv.world_rank, shard_index, hv.member_expiry)
        """Whether this cluster sits behind a NAT from another that does too (``galaxy/cut_off.py``)."""
        self._seen_training: set[int] = set()
        """Galaxy ranks whose record this process read saying "training"
        (``membership_record.previous_lives``)."""
        self.peer_id = dht.peer_id.to_base58()
        """This peer's libp2p PeerID (base58): how other peers' reports and errors name it."""
        self._closed = False
        self.last_group_round_end: float | None = None
        """When this peer's last round with others ended (see :meth:`shutdown`)."""
        self.last_group: tuple[int, frozenset[int]] = (-1, frozenset())
        """That round's id and the galaxy ranks of the other clusters in it."""

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs other peers can pass as ``initial_peers`` to join this peer's DHT."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    @contextlib.contextmanager
    def buffer(self) -> Iterator[torch.Tensor]:
        lock = self.averager.lock_averaged_tensors
        if not lock.acquire(timeout=self.averaging_timeout + GRACE_SECONDS):
            raise RoundFailed("the averager is still busy with a previous round")
        try:
            yield self.wire_buffer
        finally:
            lock.release()

    def matchmaking_plan(self, live_clusters: int, coming: bool = False) -> MatchmakingPlan:
        return self.clock.plan(live_clusters, coming)

    def start_round(
        self,
        round_id: int,
        fingerprint: dict[str, Any],
        attempt: int = 0,
        plan: MatchmakingPlan | None = None,
    ) -> HivemindRound:
        """Matchmaking waits ``plan.window`` (``outer/matchmaking.py``: ``--hv.matchmaking-time`` at least)
        for ``plan.group_size`` clusters, forming the group as soon as they all joined, then goes with whoever
        came (at least ``plan.min_group``; at least two once ``--hv.member-expiry`` more has passed); a peer
        still alone at ``--hv.averaging-timeout`` gets a group of one (buffer unchanged).

        The round and the attempt are in the matchmaking key (:func:`round_key_bits`): a retry of a round can
        never meet the galaxy's next round, nor a shard late for one attempt the group of the next."""
        start = time.monotonic()
        metadata = {**fingerprint, "galaxy_rank": self.galaxy_rank, "round_id": round_id, "attempt": attempt}
        if self.alone:
            return HivemindRound(self, None, metadata, start)
        plan = plan or self.matchmaking_plan(self.galaxy_size)
        forget_finished_searches(self.dht)  # the last round's key, among others
        try:
            bits = round_key_bits(round_id, attempt)
            group, relax = max(2, plan.group_size), self.member_expiry + plan.window  # their records expired
            floor = max(2, min(plan.min_group, group))
            self.averager.set_round(bits, group, plan.request_timeout, SETTINGS_SECONDS, floor, relax)
        except TimeoutError:
            raise RoundFailed(f"the averager did not take round {round_id}'s settings in time") from None
        control = self.averager.step(
            gather=metadata,
            scheduled_time=get_dht_time() + plan.window,
            weight=float(fingerprint.get("weight", 1.0)),  # --hv.round-steps by-speed: steps behind the Δ
            timeout=self.averaging_timeout,
            allow_retries=False,
            wait=False,
        )
        return HivemindRound(self, control, metadata, start, plan)

    def genesis_entry(self) -> dict[str, Any] | None:
        """See ``Averager`` (``galaxy/ledger_mirror.py``)."""
        return None if self.alone else first_round(self.dht, self.run_id, MEMBERSHIP_READ_SECONDS)

    def membership(self) -> Membership:
        """See ``Averager``; also raises :class:`GalaxyMismatch` when a live cluster's record says it cannot
        average with this one (matchmaking would silently never group the two)."""
        if self.alone:
            return Membership()
        records = read_records(self.dht, self.status_key, MEMBERSHIP_READ_SECONDS, self.record_ages)
        # a stranger's record (say, a mismatched schema) must not stop or stall us
        if self.allowlist is not None:
            records = [record for record in records if self.allowlist.admits(record.peer_id or "")]
        # every record, ended ones too: a cluster that stopped on the mismatch must not hide it from this one
        conflict = schema_conflict(records, self.galaxy_rank, self.schema, self.member_expiry)
        if conflict is not None:
            raise GalaxyMismatch(conflict)
        if no_reachable_cluster(records, self.galaxy_size, self.member_expiry):
            raise GalaxyMismatch(
                f"all {self.galaxy_size} clusters of the galaxy run with --hv.client-mode: a round needs one "
                "that the others can dial (it reduces their spans); start one cluster without it, reachable "
                "at its --hv.announce-maddrs"
            )
        self._seen_training.update(record.galaxy_rank for record in records if record.training)
        earlier_runs = previous_lives(records, self._seen_training)
        records = [record for record in records if record.galaxy_rank not in earlier_runs]
        gone = frozenset(departed(records, self.member_expiry))
        if not self.elastic and time.monotonic() - self._started > NOT_HEARD_SECONDS:  # it will join late
            gone |= never_heard(records, self.galaxy_size, self.galaxy_rank)
        silence = silent(records, self.member_expiry)
        quiet = frozenset(silence)
        if cut_off := self.cut_off.line(records, gone, averaged=self.last_group_round_end is not None):
            raise GalaxyMismatch(cut_off)
        if gone - {self.galaxy_rank}:  # this shard's counterparts: the peers its rounds run over
            peers = {
                record.galaxy_rank: peer
                for record in records
                if record.galaxy_rank != self.galaxy_rank and (peer := record.shard_peer(self.shard_index))
            }
            self._find_the_others_again(
                [peer for rank, peer in peers.items() if rank in quiet],
                [peer for rank, peer in peers.items() if rank not in gone],
            )
        self.link_probe.poll(
            [
                peer
                for record in records
                if record.galaxy_rank not in gone | {self.galaxy_rank}
                and (peer := record.shard_peer(self.shard_index))
            ]
        )
        lead, lead_work = lead_of(records, self.member_expiry)
        lead_step, lead_seen = lead_progress(records, self.member_expiry, self.galaxy_rank, lead)
        live = [record for record in records if record.galaxy_rank not in gone]
        serving = live + [record for record in records if record.finished_and_serving(self.member_expiry)]
        return Membership(
            departed=gone,
            lead=lead,
            lead_work=lead_work,
            works={record.galaxy_rank: record.committed_work or 0 for record in records},
            silent=quiet,
            silent_seconds=silence,
            lead_inner_step=lead_step,
            lead_seen_seconds=lead_seen,
            steps={record.galaxy_rank: record.outer_step for record in serving},
            sources={  # a client-mode cluster cannot be dialled: it serves no state
                record.galaxy_rank: peer
                for record in serving
                if (peer := record.shard_peer(self.shard_index)) and not record.client_mode
            },
            attempts={
                record.galaxy_rank: attempt for record in live if (attempt := record.attempt) is not None
            },
            step_seconds={
                record.galaxy_rank: seconds for record in live if (seconds := record.step_seconds) is not None
            },
            reported={
                record.galaxy_rank: (record.outer_step, record.param_hash, record.galaxy_rank not in gone)
                for record in records
            },
            ages={record.galaxy_rank: record.last_seen_seconds for record in records},
        )

    def _find_the_others_again(self, silent_peers: list[str], live_peers: list[str]) -> None:
        """While some cluster looks gone, re-bootstrap this peer's DHT node every ``REBOOTSTRAP_SECONDS``
        (``galaxy.dht.rebootstrap``): it may sit behind a link that just came back, and after a partition
        neither side's DHT would find the other by itself. Rounds read the membership at every start and every
        2 s while they look for a group, so this needs no thread of its own; a whole galaxy costs nothing."""
        if time.monotonic() - self._rebootstrapped > REBOOTSTRAP_SECONDS:
            self._rebootstrapped = time.monotonic()
            with DHT_PIPE_LOCK:
                rebootstrap(self.dht, self.initial_peers, silent_peers, live_peers)

    def alone_in(self, view: Membership) -> bool:
        """Every other cluster of the galaxy is known to be gone."""
        others = (set(view.reported) if self.elastic else set(range(self.galaxy_size))) - {self.galaxy_rank}
        return others <= view.departed

    def lonely_report(
        self, metadata: dict[str, Any], start: float, overtaken: bool = False, moved_on: bool = False
    ) -> RoundReport:
        return RoundReport(
            group_size=1,
            complete=not moved_on,
            peers={self.galaxy_rank: metadata},
            seconds=time.monotonic() - start,
            overtaken=overtaken,
            moved_on=moved_on,
        )

    def all_reduce(
        self, values: torch.Tensor, round_id: int, fingerprint: dict, plan: MatchmakingPlan | None = None
    ) -> RoundReport:
        """Average ``values`` in place with the other peers in one blocking round (benchmarks and tests of the
        averager alone; the outer loop writes into :meth:`buffer` directly and skips both copies)."""
        with self.buffer() as shared:
            shared.copy_(values.view(-1))
        codecs = wire_codecs(self.compression, self.sparse_rule)
        on_wire = values.reshape(-1)
        # what the parts will decode to, tensor by tensor (values, then any block scores)
        if codecs is not None:
            pieces = []
            for key, tensor in enumerate(values.reshape(-1).split(self._tensor_sizes())):
                codec = codecs.for_key(key)
                pieces.append(codec.decode(codec.encode(tensor, on_grid=True)))
            on_wire = torch.cat(pieces)
        fingerprint = {"delta_norm": wire_norm(on_wire), **fingerprint}  # the claim: what the parts carry
        report = self.start_round(round_id, fingerprint, plan=plan).wait()
        with self.buffer() as shared:
            values.view(-1).copy_(shared)
        return report

    def _tensor_sizes(self) -> list[int]:
        return [tensor.numel() for tensor in self.averager._averaged_tensors]

    def serve_state(self, get_state: Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]]) -> None:
        """Answer late joiners' ``download_state`` with ``get_state()`` (called in this process, on
        demand); a ``--hv.client-mode`` cluster serves nobody (nobody can dial it)."""
        self.averager.get_state = get_state
        if not self.averager.client_mode:
            self.averager.allow_state_sharing = True

    def download_state(
        self, timeout: float, source: str | None = None, holders: Sequence[str] | None = None
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download ``(metadata, tensors)`` from ``source`` (a PeerID; in parts from it and ``holders`` too,
        when given, even empty), or any peer serving this shard; ``None`` if none answers in time.

        Retries until ``timeout``: a serving peer's DHT declaration may not have propagated yet."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                if source is not None:
                    state = self.averager.download_state_from(source, left, holders)
                else:
                    state = self.averager.load_state_from_peers(timeout=left)
            except TimeoutError:
                return None
            if state is not None and state[0]:
                metadata, tensors = state
                announced = metadata.pop(STATE_NUMELS, None)  # (an older peer announces nothing)
                sizes = [tensor.numel() for tensor in tensors]
                if announced is None or announced == sizes:
                    return metadata, [tensor.clone() for tensor in tensors]  # own memory, not the IPC segment
                log.warning(
                    "a state download came short (%s values of the %s announced): trying again",
                    sizes,
                    announced,
                )
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def _let_last_averages_drain(self, seconds: float) -> None:
        """Our round is done once *we* hold every averaged part; the averages we computed for the others may
        still sit in our p2pd on their way. Ending p2pd at once cut that tail off (the other cluster's final
        round then came out partial, hivemind's "received …% results", seen on loopback under load and over an
        emulated 150 ms link), so keep it up until every other cluster of the last round says (in its status
        record) that it is past that round, or has stopped, or ``seconds`` after the round ended: a run's end
        waits :data:`FINISH_DRAIN_SECONDS` for slow peers, a stop :data:`DRAIN_SECONDS` (inside the trainer's
        stop grace)."""
        if self.last_group_round_end is None:
            return
        deadline = self.last_group_round_end + seconds
        round_id, others = self.last_group
        while (left := deadline - time.monotonic()) > 0:
            if self._past_round(round_id, others, timeout=min(left, MEMBERSHIP_READ_SECONDS)):
                return
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    def _past_round(self, round_id: int, ranks: frozenset[int], timeout: float) -> bool:
        """``membership_record.past_round`` over the records read now (nothing to read when ``ranks`` is
        empty)."""
        if not ranks:
            return True
        return past_round(
            read_records(self.dht, self.status_key, timeout, self.record_ages),
            round_id,
            ranks,
            self.member_expiry,
        )

    def shutdown(self, finished: bool = False) -> None:
        """Stop the averager, then the DHT (and its p2pd); idempotent, a few seconds at most (``finished``:
        the run ended, nothing hurries it; see :meth:`_let_last_averages_drain`)."""
        if self._closed:
            return
        self._closed = True
        # a finished run serves the last round's state until the others took it (or join_timeout at most): a
        # cluster whose last average never came takes the round from us (outer/diloco.py)
        self._let_last_averages_drain(
            max(FINISH_DRAIN_SECONDS, self.join_timeout) if finished else DRAIN_SECONDS
        )
        try:
            if self.averager.is_alive():
                self.averager.shutdown()  # joins for at most SHUTDOWN_SECONDS, then terminates
            end_child(self.averager)
        finally:
            shutdown_dht(self.dht)
