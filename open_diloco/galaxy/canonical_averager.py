"""The hivemind averager of one shard, as open_diloco runs it: :class:`CanonicalAverager` runs the canonical
all-reduce (``galaxy/allreduce.py``), checks every averager RPC against ``--hv.allowlist``, serves the
caller's state with the size of each tensor (whole, and in pinned parts for a striped download), and downloads
the state of one named peer or, in parts, of every peer that holds it (a re-sync's sources)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager, matchmaking
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_tensor_stream, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import split_for_streaming

from open_diloco.galaxy.allowlist import Allowlist, RefusedStub
from open_diloco.galaxy.allreduce import CanonicalAllReduce
from open_diloco.galaxy.lifecycle import become_galaxy_child
from open_diloco.galaxy.paced_matchmaking import PacedGroupKeyManager, lower_floor_later, refresh_leaders
from open_diloco.galaxy.state_pins import PIN_IDLE_SECONDS, Pin, StatePins
from open_diloco.galaxy.step_tracking import StepTracking
from open_diloco.galaxy.stripe_plan import PART_BYTES
from open_diloco.galaxy.striped_download import StripedDownload
from open_diloco.galaxy.task_refs import tend_averager_loop
from open_diloco.outer.guard import ClaimCheck, valid_claim, valid_weight
from open_diloco.outer.policy import out_of_cohort

# Importing hivemind switches torch's tensor sharing strategy to "file_system" (mpfuture.py), whose daemon
# outlives our peers and leaks /dev/shm files when a process is killed, and changes how DataLoader workers
# share batches. Put torch's default back: only a few tensors pass between trainer and averager process.
torch.multiprocessing.set_sharing_strategy("file_descriptor")
log = logging.getLogger(__name__)

GRACE_SECONDS = 1.0  # past averaging_timeout: for hivemind to report a lonely deadline, a download to come
LINGER_SECONDS = 5.0  # how long a join request's answer stays open for the caller to read it, at most
STATE_NUMELS = "state_numels"  # the served state's metadata: the size of each tensor it sends


class CanonicalAverager(StepTracking, DecentralizedAverager):
    """DecentralizedAverager running :class:`CanonicalAllReduce`, copying results, serving a caller's
    state."""

    get_state: Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]] | None = None
    _round_stats: dict[bytes, dict[str, int]]
    delta_norm_bound: float = 0.0
    """``--hv.delta-norm-bound`` for our reducers (``open_diloco.outer.guard``); 0: claims are held to, not
    bounded."""
    robust_mean: bool = False
    """``--hv.robust-mean``: our reducers clip every sender to the round's median claim."""
    allowlist: Allowlist | None = None
    """``--hv.allowlist``: the only peers this averager deals with (``galaxy/allowlist.py``); ``None``:
    anyone."""
    _process_allowlist: Allowlist | None = None
    """The allowlist of the one averager in this (averager) process, for :meth:`get_stub`, a classmethod."""
    _round_tasks: tuple[asyncio.Task, ...] = ()
    """The round's matchmaking helpers in the averager's process (``paced_matchmaking``): its leader refresh
    and the pending lowering of its floor; cancelled when the next round is set."""

    # Always fork, like hivemind.DHT (a ForkProcess): the averager cannot be pickled for "spawn", which is
    # the default start method inside processes started with spawn (and wherever a program chose it).
    _Popen = staticmethod(mp.context.ForkProcess._Popen)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        strangers = [peer for peer in group_info.peer_ids if not self._admits(peer, "a group")]
        if strangers:  # cannot happen through our own matchmaking; a group with a stranger is never averaged
            refused = AllreduceException(f"the group has peers not on --hv.allowlist: {strangers}")
            running = self._running_groups[group_id]
            running.set_exception(refused)  # peers waiting for this group fail at once
            running.exception()  # (retrieved: no "never retrieved" warning without them)
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
        claims, own_theta, metadata, weights = {}, None, {}, {}
        for peer, blob in zip(group_info.peer_ids, group_info.gathered, strict=True):
            try:
                metadata[peer] = self.serializer.loads(self.serializer.loads(blob)[2])
                weight = valid_weight(metadata[peer].get("weight"))
                claims[peer] = valid_claim(metadata[peer].get("delta_norm")) if weight else None
                weights[peer] = weight or 1.0
                if peer == self.peer_id:
                    own_theta = valid_claim(metadata[peer].get("theta_norm"))
            except (
                Exception
            ):  # a peer that sent no metadata of ours: it makes no claim, so it is not averaged
                claims[peer] = None
        stale = frozenset(out_of_cohort(metadata))
        return ClaimCheck(
            claims, self.peer_id, self.delta_norm_bound, self.robust_mean, own_theta, stale, weights
        )

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        # When the group formed and when the average was written: the trainer splits its round's seconds into
        # matchmaking and the exchange by them (time.monotonic is the machine's clock, the same in every
        # process), which is what tells a slow link from a slow rendezvous.
        grouped_at = time.monotonic()
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        stats = self._round_stats.pop(group_info.group_id)
        return dict(
            gathered={peer.to_base58(): data for peer, data in gathered.items()},
            grouped_at=grouped_at,
            done_at=time.monotonic(),
            **stats,
        )

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind's, then this process's P2P client (a replica of the DHT's p2pd, which the DHT ends):
        hivemind leaves it open, and its socket file stayed in /tmp after every run, one per averager."""
        try:
            await super()._shutdown(timeout)
        finally:
            if getattr(self, "_p2p", None) is not None:
                await self._p2p.shutdown()

    # -- one round's matchmaking (outer/matchmaking.py) ----------------------------------------------------

    def set_round(
        self,
        group_bits: str,
        group_size: int,
        request_timeout: float,
        timeout: float,
        min_group: int = 2,
        relax_after: float = 0.0,
    ) -> None:
        """Set the next round's group key bits, the group size that makes it full, the fewest peers it may
        close with (``min_group``, lowered to 2 after ``relax_after`` seconds) and how long a join request
        waits, in the averager's process; raises ``TimeoutError`` when it does not answer within ``timeout``
        (hivemind's ``set_group_bits`` waits without limit: a rank stuck there would stall its siblings)."""
        future = MPFuture()
        settings = dict(group_bits=group_bits, group_size=group_size, request_timeout=request_timeout)
        settings.update(min_group=min_group, relax_after=relax_after, timeout=timeout, future=future)
        self._outer_pipe.send(("_set_round", [], settings))
        future.result(timeout=timeout)

    async def _set_round(
        self, group_bits, group_size, request_timeout, min_group, relax_after, timeout, future: MPFuture
    ) -> None:
        try:
            matchmaking, deadline = self._matchmaking, time.monotonic() + timeout / 2
            # a cancelled round's step or search may run on, to be met under the new key (step_tracking.py)
            if ended := await self.end_earlier_steps(timeout / 4):
                log.info(f"ended {ended} averaging step(s) of an earlier round before this round's key")
            while matchmaking.is_looking_for_group and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            matchmaking.group_key_manager.group_bits = group_bits
            matchmaking.target_group_size, matchmaking.request_timeout = group_size, request_timeout
            matchmaking.min_group_size = min_group
            for task in self._round_tasks:
                task.cancel()
            helpers = [refresh_leaders(matchmaking, group_bits)]
            if min_group > 2:
                helpers.append(lower_floor_later(matchmaking, group_bits, relax_after))
            self._round_tasks = tuple(asyncio.create_task(helper) for helper in helpers)
            future.set_result(None)
        except Exception as err:
            if not future.done():
                future.set_exception(err)

    def run(self) -> None:
        become_galaxy_child(self._parent_pid)
        CanonicalAverager._process_allowlist = self.allowlist
        logging.getLogger("hivemind.averaging.averager").addFilter(one_line_download_failures)
        matchmaking.GroupKeyManager = PacedGroupKeyManager  # this process serves this averager alone
        tend_averager_loop()  # a cancelled round's tasks are not garbage, nor its broken streams an ERROR
        super().run()

    # -- the allowlist, on every averager RPC (galaxy/allowlist.py) ---------------------------------------
    # Parts need no check of their own: hivemind's runner takes parts only from its group's senders, and a
    # group with a stranger is refused before its runner exists (``_run_allreduce_inplace_``).
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

    def download_state_from(
        self, peer: str, timeout: float, holders: Sequence[str] | None = None
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download the state one named peer serves (base58 PeerID); ``None`` when it serves none or fails in
        time. ``holders`` (a list, even empty): peers that hold the same state as ``peer``; the state comes in
        parts from all of them (``galaxy/striped_download.py``, one log line), ``peer`` deciding which state
        that is; ``None``: in one stream from ``peer``.

        hivemind's ``load_state_from_peers`` takes whichever peer its DHT lists first: two ranks of one
        cluster could then assemble a θ_outer from two clusters. A re-sync names its source instead
        (``outer/adoption.py``)."""
        if holders is not None:
            return self._download_striped([peer, *holders], timeout)
        future = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(peer=peer, timeout=timeout, future=future)))
        try:
            return future.result(timeout=timeout + GRACE_SECONDS)
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

    # -- striped downloads (galaxy/striped_download.py, galaxy/state_pins.py) -------------------------------
    def _download_striped(
        self, holders: list[str], timeout: float
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        future = MPFuture()
        settings = dict(holders=holders, timeout=timeout, future=future)
        self._outer_pipe.send(("_striped_download", [], settings))
        try:
            got = future.result(timeout=timeout + GRACE_SECONDS)
        except TimeoutError:
            return None
        if got is None:
            return None
        if len(got) == 2:  # the source pinned nothing: the state came in one stream
            return got
        metadata, tensors, stats = got
        log.info(stats.line())
        return metadata, tensors

    async def _striped_download(self, holders: list[str], timeout: float, future: MPFuture) -> None:
        try:
            download = StripedDownload(
                lambda peer: self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix),
                self.serializer,
                holders,
                timeout,
                state_bytes=sum(tensor.numel() * tensor.element_size() for tensor in self._averaged_tensors),
            )
            got = await asyncio.wait_for(download.run(), timeout)
            left = download.deadline - time.monotonic()
            if got is None and not download.source_pinned and left > 0:  # an older source: in one stream
                return await self._download_state_from(holders[0], left, future)
            future.set_result(got)
        except Exception as err:  # gone, refused, slow: the caller tries again
            log.warning("striped state download from %s failed: %r", holders, err)
            if not future.done():
                future.set_result(None)

    async def rpc_pin_state(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Pin a snapshot of the served state (``galaxy/state_pins.py``) and describe it: metadata, shapes,
        and a hash per part of the size asked. An empty answer: no state here (or not for this caller)."""
        if not self._admits(context.remote_id, "its state pin") or not self.allow_state_sharing:
            return averaging_pb2.DownloadData()
        asked = self.serializer.loads(request.metadata)
        pin = await self._pinned(asked.get("outer_step"))
        if pin is None:
            return averaging_pb2.DownloadData()
        # (hashing every part of a big state takes a while: off the event loop that serves the rounds)
        part_bytes = int(asked.get("part_bytes") or PART_BYTES)
        described = await asyncio.get_running_loop().run_in_executor(None, pin.describe, part_bytes)
        return averaging_pb2.DownloadData(metadata=self.serializer.dumps(described))

    async def rpc_download_state_part(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """One part (tensor, start, end) of a pinned snapshot; nothing when that snapshot is gone."""
        if not self._admits(context.remote_id, "its state download"):
            return
        asked = self.serializer.loads(request.metadata)
        pin = self._state_pins.get(asked.get("outer_step"), time.monotonic())
        where = (int(asked["tensor"]), int(asked["start"]), int(asked["end"]))
        values = None if pin is None else pin.part(*where)
        if values is None:
            return
        for piece in split_for_streaming(serialize_torch_tensor(values)):
            yield averaging_pb2.DownloadData(tensor_part=piece)

    @property
    def _state_pins(self) -> StatePins:
        if "_pins" not in self.__dict__:
            self._pins, self._pin_lock = StatePins(), asyncio.Lock()
        return self._pins

    async def _pinned(self, outer_step: Any) -> Pin | None:
        """The snapshot pinned at ``outer_step``, or, when ``outer_step`` is ``None`` or none is pinned, a new
        one through ``get_state`` (hivemind's path for a whole download), pinned under its own outer step
        unless that is not the one asked. Dropped when idle (:meth:`_drop_idle_pins`)."""
        pins = self._state_pins
        pin = pins.get(outer_step, time.monotonic()) if outer_step is not None else None
        if pin is not None:
            return pin
        async with self._pin_lock:
            metadata, tensors, _ = await self._get_current_state_from_host_process()
            snapshot = Pin(self.serializer.loads(metadata), list(tensors), time.monotonic())
            if outer_step is not None and snapshot.outer_step != outer_step:
                return None
            if not len(pins):
                asyncio.get_running_loop().call_later(PIN_IDLE_SECONDS, self._drop_idle_pins)
            return pins.add(snapshot, time.monotonic())

    def _drop_idle_pins(self) -> None:
        """Drop the idle snapshots, and look again later while some are left (one timer while any pin)."""
        self._state_pins.drop_idle(time.monotonic())
        if len(self._state_pins):
            asyncio.get_running_loop().call_later(PIN_IDLE_SECONDS / 2, self._drop_idle_pins)

    def get_current_state(self):
        """Runs in the host process when a peer downloads state: answer with the caller's ``get_state()``, and
        the size of every tensor, so the downloader can tell a download cut short (see ``download_state``)."""
        if self.get_state is None:
            return {}, [], None
        metadata, tensors = self.get_state()
        return {**metadata, STATE_NUMELS: [tensor.numel() for tensor in tensors]}, list(tensors), None


async def _until_the_caller_closes() -> None:
    """Keep a stream we answered open until the caller has read our last message and closed its end (hivemind
    cancels the handler then), for :data:`LINGER_SECONDS` at most. A stream its answerer ends first can lose
    the messages the caller had not read yet (the all-reduce's one-sided race, ``galaxy/allreduce.py``); here
    that would be a follower that never reads the leader's ``BEGIN_ALLREDUCE`` and is left out of a group its
    leader averages with (what an e2e failure looked like, docs/LOG.md: the leader's round waited for its
    follower and came out partial, the follower found no group)."""
    await asyncio.sleep(LINGER_SECONDS)


def one_line_download_failures(record: logging.LogRecord) -> bool:
    """hivemind logs a failed state download as an ERROR with a full traceback, though it is routine: a
    cluster that starts beside a peer not yet listening (libp2p's "dial backoff"), or a peer that left, and
    the download is tried again or from another peer. Its message already names the peer and the error: keep
    that one line, as a warning."""
    if record.funcName == "_load_state_from_peers" and record.exc_info:
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
    return True
