"""One shard's hivemind averager, and the adapter that gives the outer loop its ``Averager``.

``galaxy/build.py`` starts them from the configuration (wire compression included); what lives here is how a
round runs once they exist."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_tensor_stream
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture

from open_diloco.errors import DuplicateGalaxyRank, GalaxyMismatch, RoundFailed
from open_diloco.galaxy.allowlist import Allowlist, RefusedStub
from open_diloco.galaxy.allreduce import CanonicalAllReduce
from open_diloco.galaxy.dht import REBOOTSTRAP_SECONDS, GalaxyDHT, rebootstrap, shutdown_dht
from open_diloco.galaxy.lifecycle import become_galaxy_child, end_child
from open_diloco.galaxy.record_ages import RecordAges
from open_diloco.galaxy.status import (
    DHT_PIPE_LOCK,
    departed,
    lead_outer_step,
    lead_progress,
    past_round,
    read_records,
    schema_conflict,
    shard_peer,
    silent,
    status_key,
)
from open_diloco.outer.codecs import wire_codecs
from open_diloco.outer.guard import ClaimCheck, valid_claim, wire_norm
from open_diloco.outer.policy import out_of_cohort
from open_diloco.outer.protocols import Membership, RoundReport

if TYPE_CHECKING:
    from open_diloco.config import HvConfig

# Importing hivemind switches torch's process-wide tensor sharing strategy to "file_system" (mpfuture.py),
# which starts a torch_shm_manager daemon that outlives our peers and leaks /dev/shm files when a process is
# killed; it also changes how the trainer's DataLoader workers share batches. Put torch's default back: we
# only pass a few tensors between the trainer and its averager process.
torch.multiprocessing.set_sharing_strategy("file_descriptor")
log = logging.getLogger(__name__)

_NO_GROUP = "could not find a group"  # hivemind 1.1.12's message when matchmaking reaches its deadline alone
_GRACE = 1.0  # seconds past averaging_timeout for hivemind to report a lonely deadline before we give up
MEMBERSHIP_READ_SECONDS = 3.0  # what reading the membership records may add to a round's start, at most
MEMBERSHIP_POLL_SECONDS = 2.0  # how often a peer looking for a group checks whether anyone is left to find
SHUTDOWN_SECONDS = 3.0  # what the averager gets to shut down in order before it is ended by PID
DRAIN_SECONDS = 3.0  # at a stop: how long after a round with others this peer's p2pd stays up, at most
FINISH_DRAIN_SECONDS = 15.0  # at the end of a run: the same, waiting for the peers of the last round to finish it
LINGER_SECONDS = 5.0  # how long a join request's answer stays open for the caller to read it, at most
STATE_NUMELS = "state_numels"  # the served state's metadata: the size of each tensor it sends


class CanonicalAverager(DecentralizedAverager):
    """DecentralizedAverager running :class:`CanonicalAllReduce`, copying results, serving a caller's state."""

    get_state: Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]] | None = None
    _round_stats: dict[bytes, dict[str, int]]
    delta_norm_bound: float = 0.0
    """``--hv.delta-norm-bound`` for our reducers (``open_diloco.outer.guard``); 0: claims are held to, not bounded."""
    robust_mean: bool = False
    """``--hv.robust-mean``: our reducers clip every sender to the round's median claim."""
    allowlist: Allowlist | None = None
    """``--hv.allowlist``: the only peers this averager deals with (``galaxy/allowlist.py``); ``None``: anyone."""
    _process_allowlist: Allowlist | None = None
    """The allowlist of the one averager in this (averager) process, for :meth:`get_stub`, a classmethod."""

    # Always fork, like hivemind.DHT (a ForkProcess): the averager cannot be pickled for "spawn", which is
    # the default start method inside processes started with spawn (and wherever a program chose it).
    _Popen = staticmethod(mp.context.ForkProcess._Popen)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        strangers = [peer for peer in group_info.peer_ids if not self._admits(peer, "a group")]
        if strangers:  # cannot happen through our own matchmaking; a group with a stranger is never averaged
            refused = AllreduceException(f"the group has peers not on --hv.allowlist: {strangers}")
            self._running_groups[group_id].set_exception(refused)  # peers waiting for this group fail at once
            self._running_groups[group_id].exception()  # (retrieved: no "never retrieved" warning without them)
            raise refused
        runner = CanonicalAllReduce(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            claims=self._claims(group_info),
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        assert runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX
        async for _ in runner:  # the runner writes the canonical result into ``tensors`` as parts arrive
            pass
        await runner.finish_serving()
        if not hasattr(self, "_round_stats"):
            self._round_stats = {}
        self._round_stats[group_id] = runner.stats()

    def _claims(self, group_info) -> ClaimCheck:
        """Every peer's claimed ‖Δ‖ (``delta_norm`` in the metadata gathered in matchmaking, the same table on
        every peer of the group)."""
        claims, own_theta, metadata = {}, None, {}
        for peer, blob in zip(group_info.peer_ids, group_info.gathered, strict=True):
            try:
                metadata[peer] = self.serializer.loads(self.serializer.loads(blob)[2])
                claims[peer] = valid_claim(metadata[peer].get("delta_norm"))
                if peer == self.peer_id:
                    own_theta = valid_claim(metadata[peer].get("theta_norm"))
            except Exception:  # a peer that sent no metadata of ours: it makes no claim, so it is not averaged
                claims[peer] = None
        stale = frozenset(out_of_cohort(metadata))
        return ClaimCheck(claims, self.peer_id, self.delta_norm_bound, self.robust_mean, own_theta, stale)

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        stats = self._round_stats.pop(group_info.group_id)
        return dict(gathered={peer.to_base58(): data for peer, data in gathered.items()}, **stats)

    def run(self) -> None:
        become_galaxy_child(self._parent_pid)
        CanonicalAverager._process_allowlist = self.allowlist
        logging.getLogger("hivemind.averaging.averager").addFilter(one_line_download_failures)
        super().run()

    # -- the allowlist, on every averager RPC (galaxy/allowlist.py) ---------------------------------------
    # Parts need no check of their own: hivemind's runner takes parts only from its group's senders, and a group
    # with a stranger is refused before its runner exists (``_run_allreduce_inplace_``).
    def _admits(self, peer, what: str) -> bool:
        if self.allowlist is None or peer == self.peer_id or self.allowlist.admits(peer):
            return True
        self.allowlist.refuse(peer, what)
        return False

    @classmethod
    def get_stub(cls, p2p, peer, *, namespace=None):
        """Every outgoing averager RPC (join a leader, send a part, download state) gets its stub here."""
        allowlist = cls._process_allowlist
        if allowlist is not None and peer != p2p.peer_id and not allowlist.admits(peer):
            allowlist.refuse(peer, "to contact it")
            return RefusedStub()
        return super().get_stub(p2p, peer, namespace=namespace)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind reads typing's AsyncIterator here
        if not self._admits(context.remote_id, "its join request"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        else:
            async for response in super().rpc_join_group(request, context):
                yield response
        await _until_the_caller_closes()

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        if not self._admits(context.remote_id, "its state download"):
            return  # an empty answer: hivemind's "this peer does not share state"
        async for message in super().rpc_download_state(request, context):
            yield message

    def download_state_from(self, peer: str, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download the state one named peer serves (base58 PeerID); ``None`` when it serves none or fails in time.

        hivemind's ``load_state_from_peers`` takes whichever peer its DHT lists first: two ranks of one cluster
        could then assemble a θ_outer from two clusters. A re-sync names its source instead (``outer/adoption.py``)."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(peer=peer, timeout=timeout, future=future)))
        try:
            return future.result(timeout=timeout + _GRACE)
        except TimeoutError:
            return None

    async def _download_state_from(self, peer: str, timeout: float, future: MPFuture) -> None:
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout)
            metadata: list[bytes] = []

            async def parts():
                async for message in aiter_with_timeout(stream, timeout=timeout):
                    if message.metadata:
                        metadata.append(message.metadata)
                    yield [message.tensor_part]

            tensors = await asyncio.wait_for(deserialize_tensor_stream(parts()), timeout)
            future.set_result((self.serializer.loads(metadata[0]), tensors) if metadata else None)
        except Exception as err:  # unreachable, gone, refused, slow: the caller tries again or elsewhere
            log.warning("state download from %s failed: %r", peer, err)
            if not future.done():
                future.set_result(None)

    def get_current_state(self):
        """Runs in the host process when a peer downloads state: answer with the caller's ``get_state()``, and
        the size of every tensor, so the downloader can tell a download cut short (see ``download_state``)."""
        if self.get_state is None:
            return {}, [], None
        metadata, tensors = self.get_state()
        return {**metadata, STATE_NUMELS: [tensor.numel() for tensor in tensors]}, list(tensors), None


async def _until_the_caller_closes() -> None:
    """Keep a stream we answered open until the caller has read our last message and closed its end (hivemind
    cancels the handler then), for :data:`LINGER_SECONDS` at most. A stream its answerer ends first can lose the
    messages the caller had not read yet (the all-reduce's one-sided race, ``galaxy/allreduce.py``); here that
    would be a follower that never reads the leader's ``BEGIN_ALLREDUCE`` and is left out of a group its leader
    averages with (what an e2e failure looked like, docs/LOG.md: the leader's round waited for its follower and
    came out partial, the follower found no group)."""
    await asyncio.sleep(LINGER_SECONDS)


def one_line_download_failures(record: logging.LogRecord) -> bool:
    """hivemind logs a failed state download as an ERROR with a full traceback, though it is routine: a cluster
    that starts beside a peer not yet listening (libp2p's "dial backoff"), or a peer that left, and the download
    is tried again or from another peer. Its message already names the peer and the error: keep that one line, as
    a warning."""
    if record.funcName == "_load_state_from_peers" and record.exc_info:
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
    return True


class HivemindRound:
    """A hivemind round in flight (see ``PendingRound``)."""

    def __init__(self, owner: HivemindAverager, control: StepControl | None, metadata: dict[str, Any], start: float):
        self.owner, self.control, self.metadata, self.start = owner, control, metadata, start

    def wait(self) -> RoundReport:
        owner, round_id = self.owner, self.metadata["round_id"]
        if self.control is None:  # a galaxy of one
            return owner.lonely_report(self.metadata, self.start)
        try:
            result = self._result_unless_left_alone()
        except TimeoutError:
            self.control.cancel()
            raise RoundFailed(
                f"round {round_id} did not finish within --hv.averaging-timeout={owner.averaging_timeout}s"
            ) from None
        except _LeftAlone:
            return owner.lonely_report(self.metadata, self.start)
        except _Overtaken:
            return owner.lonely_report(self.metadata, self.start, overtaken=True)
        except _MovedOn:
            return owner.lonely_report(self.metadata, self.start, moved_on=True)
        except (Exception, asyncio.CancelledError) as e:  # hivemind can end a step cancelled: a BaseException
            if _NO_GROUP in str(e):  # nobody else showed up before the deadline: a group of one
                return owner.lonely_report(self.metadata, self.start)
            raise RoundFailed(f"round {round_id} failed: {e!r}") from e
        peers: dict[int, dict[str, Any]] = {}
        for peer, data in result["gathered"].items():
            rank = data.get("galaxy_rank")
            if rank == owner.galaxy_rank and peer != owner.peer_id:
                raise DuplicateGalaxyRank(
                    f"peer {peer} also claims galaxy rank {rank}; give every cluster a "
                    f"unique --hv.world-rank in 0..{owner.galaxy_size - 1}"
                )
            peers[rank] = data
        owner.last_group_round_end = time.monotonic()
        owner.last_group = (round_id, frozenset(peers) - {owner.galaxy_rank})
        stale_peers = out_of_cohort(result["gathered"])
        stale = sorted(result["gathered"][peer].get("galaxy_rank", -1) for peer in stale_peers)
        rejected = sorted({result["gathered"][peer].get("galaxy_rank", -1) for peer in result["rejected"]
                           if peer in result["gathered"] and peer not in stale_peers})
        return RoundReport(
            group_size=len(result["gathered"]),
            complete=result["failed_size"] == 0 and result["banned_senders"] == 0,
            peers=peers,
            seconds=time.monotonic() - self.start,
            bytes_sent=result["bytes_sent"],
            bytes_received=result["bytes_received"],
            rejected=rejected,
            stale=stale,
        )


    def _result_unless_left_alone(self) -> dict[str, Any]:
        """The round's result, within the averaging timeout. While this peer still looks for a group, the
        membership records can say nobody will come, and the round would otherwise wait out the whole timeout:
        :class:`_LeftAlone` when every other cluster left (stopped or crashed after this round began);
        :class:`_Overtaken` when the galaxy already applied this round without us (see ``RoundReport.overtaken``)."""
        owner, control = self.owner, self.control
        deadline = self.start + owner.averaging_timeout + _GRACE
        while True:
            now = time.monotonic()
            try:
                return control.result(timeout=max(0.0, min(deadline, now + MEMBERSHIP_POLL_SECONDS) - now))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
            if control.stage != AveragingStage.LOOKING_FOR_GROUP:
                continue
            view = owner.membership()
            if owner.alone_in(view):
                control.cancel()
                raise _LeftAlone
            if view.lead > self.metadata["round_id"]:
                control.cancel()
                raise _Overtaken
            if self._everyone_moved_on(view):
                control.cancel()
                raise _MovedOn

    def _everyone_moved_on(self, view: Membership) -> bool:
        return everyone_moved_on(view, self.owner.galaxy_rank, self.metadata["round_id"] + 1,
                                 self.metadata.get("attempt", 0))


def everyone_moved_on(view: Membership, galaxy_rank: int, round_no: int, attempt: int) -> bool:
    """Every other live cluster with a record of its attempts started a later attempt of round ``round_no`` (or a
    later round) than ``attempt``: nobody will come to this one. A cluster still at an earlier round may yet come."""
    others = [started for rank, started in view.attempts.items() if rank != galaxy_rank]
    return bool(others) and all(started > (round_no, attempt) for started in others)


class _LeftAlone(Exception):
    """Every other cluster left while this peer looked for a group."""


class _MovedOn(Exception):
    """Every other cluster left this attempt of the round while this peer looked for a group."""


class _Overtaken(Exception):
    """The galaxy applied this round without this peer while it looked for a group."""


class HivemindAverager:
    """One shard's averager: a DHT node plus a :class:`CanonicalAverager` over a flat fp32 buffer.

    The buffer is hivemind's own (moved to shared memory so its process can average it in place), and it is
    the buffer the outer loop computes Δ into: no private copy of the shard. Access goes through
    :meth:`buffer`, under hivemind's tensor lock, so a round that outlived its timeout can never write into
    a Δ being computed.
    """

    def __init__(self, dht: GalaxyDHT, averager: CanonicalAverager, hv: HvConfig, *, shard_index: int,
                 schema: dict[str, Any], initial_peers: Sequence[str], allowlist: Allowlist | None,
                 wire_buffer: torch.Tensor):
        """Built by ``galaxy.build.start_shard_averager``, which starts ``dht`` and ``averager`` from ``hv``."""
        self.dht, self.averager = dht, averager
        self.wire_buffer = wire_buffer
        """The whole flat buffer a round averages, in shared memory: the values, then (sparse ``magnitude``) the
        block scores; hivemind's tensors are views of it."""
        self.sparse_rule = hv.sparse_rule
        self.shard_index = shard_index
        """Which shard of the cluster this averager serves: it averages with the same shard of every other cluster."""
        self.galaxy_rank, self.galaxy_size = hv.world_rank, hv.galaxy_size
        self.averaging_timeout, self.join_timeout = hv.averaging_timeout, hv.join_timeout
        self.status_key, self.member_expiry = status_key(hv.run_id), hv.member_expiry
        self.record_ages = RecordAges(self.member_expiry)
        """Ages of the records on this machine's clock, kept across reads (``galaxy/record_ages.py``)."""
        self.schema = schema
        """What this cluster must share with the others to average (``galaxy.status.SCHEMA_KEYS``)."""
        self.allowlist = allowlist
        self.compression = hv.compression
        self.initial_peers = list(initial_peers)
        """Where this peer's DHT node joined, asked again now and then (``galaxy.dht.rebootstrap``)."""
        self._rebootstrapped = float("-inf")
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
        if not lock.acquire(timeout=self.averaging_timeout + _GRACE):
            raise RoundFailed("the averager is still busy with a previous round")
        try:
            yield self.wire_buffer
        finally:
            lock.release()

    def start_round(self, round_id: int, fingerprint: dict[str, Any], attempt: int = 0) -> HivemindRound:
        """Matchmaking waits ``--hv.matchmaking-time`` for the whole galaxy, then goes with whoever came (at
        least two); a peer still alone at ``--hv.averaging-timeout`` gets a group of one (buffer unchanged).

        The round and the attempt are in the matchmaking key (:func:`round_key_bits`): a retry of a round can
        never meet the galaxy's next round, nor a shard late for one attempt the group of the next."""
        start = time.monotonic()
        metadata = {**fingerprint, "galaxy_rank": self.galaxy_rank, "round_id": round_id, "attempt": attempt}
        if self.galaxy_size == 1:
            return HivemindRound(self, None, metadata, start)
        self.averager.set_group_bits(round_key_bits(round_id, attempt))
        control = self.averager.step(gather=metadata, timeout=self.averaging_timeout, allow_retries=False, wait=False)
        return HivemindRound(self, control, metadata, start)

    def membership(self) -> Membership:
        """See ``Averager``; also raises :class:`GalaxyMismatch` when a live cluster's record says it cannot
        average with this one (matchmaking would silently never group the two)."""
        if self.galaxy_size == 1:
            return Membership()
        records = read_records(self.dht, self.status_key, MEMBERSHIP_READ_SECONDS, self.record_ages)
        if self.allowlist is not None:  # a stranger's record (say, a mismatched schema) must not stop or stall us
            records = [record for record in records if self.allowlist.admits(str(record.get("peer_id", "")))]
        conflict = schema_conflict(records, self.galaxy_rank, self.schema, self.member_expiry)
        if conflict is not None:
            raise GalaxyMismatch(conflict)
        gone = frozenset(departed(records, self.member_expiry))
        quiet = frozenset(silent(records, self.member_expiry))
        if gone - {self.galaxy_rank}:  # this shard's counterparts: the peers its rounds run over
            peers = {rank: peer for record in records if (rank := record["galaxy_rank"]) != self.galaxy_rank
                     and (peer := shard_peer(record, self.shard_index))}
            self._find_the_others_again([peer for rank, peer in peers.items() if rank in quiet],
                                        [peer for rank, peer in peers.items() if rank not in gone])
        lead = lead_outer_step(records, self.member_expiry)
        lead_step, lead_seen = lead_progress(records, self.member_expiry, self.galaxy_rank, lead)
        live = [record for record in records if record["galaxy_rank"] not in gone]
        return Membership(departed=gone, lead=lead, silent=quiet,
                          lead_inner_step=lead_step, lead_seen_seconds=lead_seen,
                          steps={record["galaxy_rank"]: int(record.get("outer_step", -1)) for record in live},
                          sources={record["galaxy_rank"]: peer for record in live
                                   if (peer := shard_peer(record, self.shard_index))},
                          attempts={record["galaxy_rank"]: (int(attempt[0]), int(attempt[1])) for record in live
                                    if isinstance(attempt := record.get("round_attempt"), list) and len(attempt) == 2},
                          reported={record["galaxy_rank"]: (int(record.get("outer_step", -1)), record.get("param_hash"),
                                                            record["galaxy_rank"] not in gone) for record in records})

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
        others = set(range(self.galaxy_size)) - {self.galaxy_rank}
        return others <= view.departed

    def lonely_report(self, metadata: dict[str, Any], start: float, overtaken: bool = False,
                      moved_on: bool = False) -> RoundReport:
        return RoundReport(group_size=1, complete=not moved_on, peers={self.galaxy_rank: metadata},
                           seconds=time.monotonic() - start, overtaken=overtaken, moved_on=moved_on)

    def all_reduce(self, values: torch.Tensor, round_id: int, fingerprint: dict[str, Any],
                   attempt: int = 0) -> RoundReport:
        """Average ``values`` in place with the other peers in one blocking round (benchmarks and tests of the
        averager alone; the outer loop writes into :meth:`buffer` directly and skips both copies)."""
        with self.buffer() as shared:
            shared.copy_(values.view(-1))
        codecs = wire_codecs(self.compression, self.sparse_rule)
        on_wire = values.reshape(-1)
        if codecs is not None:  # what the parts will decode to, tensor by tensor (values, then any block scores)
            pieces = []
            for key, tensor in enumerate(values.reshape(-1).split(self._tensor_sizes())):
                codec = codecs.for_key(key)
                pieces.append(codec.decode(codec.encode(tensor, on_grid=True)))
            on_wire = torch.cat(pieces)
        fingerprint = {"delta_norm": wire_norm(on_wire), **fingerprint}  # the claim: what the parts will carry
        report = self.start_round(round_id, fingerprint, attempt).wait()
        with self.buffer() as shared:
            values.view(-1).copy_(shared)
        return report

    def _tensor_sizes(self) -> list[int]:
        return [tensor.numel() for tensor in self.averager._averaged_tensors]

    def serve_state(self, get_state: Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]]) -> None:
        """Answer late joiners' ``download_state`` with ``get_state()`` (called in this process, on demand)."""
        self.averager.get_state = get_state
        self.averager.allow_state_sharing = True

    def download_state(self, timeout: float, source: str | None = None
                       ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download ``(metadata, tensors)`` from ``source`` (a PeerID), or any peer serving this shard; ``None``
        if none answers in time.

        Retries until ``timeout``: a serving peer's DHT declaration may not have propagated yet."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                if source is not None:
                    state = self.averager.download_state_from(source, left)
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
                log.warning("a state download came short (%s values of the %s announced): trying again",
                            sizes, announced)
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def _let_last_averages_drain(self, seconds: float) -> None:
        """Our round is done once *we* hold every averaged part; the averages we computed for the others may still
        sit in our p2pd on their way. Ending p2pd at once cut that tail off (the other cluster's final round then
        came out partial, hivemind's "received …% results", seen on loopback under load and over an emulated 150 ms
        link), so keep it up until every other cluster of the last round says (in its status record) that it is
        past that round, or has stopped, or ``seconds`` after the round ended: a run's end waits
        :data:`FINISH_DRAIN_SECONDS` for slow peers, a stop :data:`DRAIN_SECONDS` (inside the trainer's stop
        grace)."""
        if self.last_group_round_end is None:
            return
        deadline = self.last_group_round_end + seconds
        round_id, others = self.last_group
        while (left := deadline - time.monotonic()) > 0:
            if self._past_round(round_id, others, timeout=min(left, MEMBERSHIP_READ_SECONDS)):
                return
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    def _past_round(self, round_id: int, ranks: frozenset[int], timeout: float) -> bool:
        """``galaxy.status.past_round`` over the records read now (nothing to read when ``ranks`` is empty)."""
        if not ranks:
            return True
        return past_round(read_records(self.dht, self.status_key, timeout, self.record_ages), round_id, ranks,
                          self.member_expiry)

    def shutdown(self, finished: bool = False) -> None:
        """Stop the averager, then the DHT (and its p2pd); idempotent, a few seconds at most (``finished``: the
        run ended, nothing hurries it; see :meth:`_let_last_averages_drain`)."""
        if self._closed:
            return
        self._closed = True
        # a finished run serves the last round's state until the others took it (or join_timeout at most): a
        # cluster whose last average never came takes the round from us (outer/diloco.py)
        self._let_last_averages_drain(max(FINISH_DRAIN_SECONDS, self.join_timeout) if finished else DRAIN_SECONDS)
        try:
            if self.averager.is_alive():
                self.averager.shutdown()  # joins for at most SHUTDOWN_SECONDS, then terminates
            end_child(self.averager)
        finally:
            shutdown_dht(self.dht)


ROUND_BITS, ATTEMPT_BITS = 40, 8


def round_key_bits(round_id: int, attempt: int) -> str:
    """hivemind's group bits for (round, attempt): its matchmaking key is ``{prefix}.0b{bits}``, so only peers of
    the same round and attempt can ever form a group. Attempts past 255 wrap (a round is never retried that often:
    ``--hv.max-retries``)."""
    return format(round_id % (1 << ROUND_BITS), f"0{ROUND_BITS}b") + format(attempt % (1 << ATTEMPT_BITS),
                                                                           f"0{ATTEMPT_BITS}b")
