"""The galaxy: one hivemind averager per FSDP shard, averaging that shard's pseudo-gradient across clusters.

This is the ONLY module that imports hivemind, so the rest of the program (and its unit tests) never pays for
hivemind's import, processes or quirks. It implements :class:`open_diloco.diloco.Averager`.

Why we subclass hivemind (1.1.12) at all — a *canonical* result. Stock butterfly all-reduce gives each peer
``own + decompress(compress(avg - own))``, so peers end up with different bytes (~1e-7 relative uncompressed,
~1e-3 of |avg - own| with fp16) and clusters drift apart round after round. Here every reducer sends back
``compress(avg)`` (not the delta) and every peer, the reducer included for its own span, *copies*
``decompress(compress(avg))`` into its buffer, so all peers hold identical bytes after a round. The overrides:

- ``_CanonicalAllReduce._accumulate_parts_streaming``: send the average, compressed with the reducer's own
  codec (not the sender's choice), so each span has exactly one serialized form;
- ``_CanonicalAllReduce._communicate_with_peer`` (own span only): round-trip the average through the same
  serializer the wire uses, so the reducer keeps what it sent, not its more precise local value;
- ``TensorPartContainer.return_deltas = False``: a failed reducer's span is then filled with our own values
  (not zeros, which under copy semantics would erase the span); we count it and report the round incomplete;
- ``_CanonicalAverager._run_allreduce_inplace_``: ``copy_`` instead of ``add_``.

Bytes are measured on the wire messages (protobuf ``ByteSize`` of every tensor part we send and receive) and
come back to the host process, with the failed-span count, as part of ``step()``'s result.

Compression: "none" and "fp16" only. Hivemind 1.1.12's 8-bit codecs do not round-trip with NumPy 2.4
(``Uniform8BitQuantization``/``Quantile8BitQuantization`` raise ``TypeError: only 0-dimensional arrays can be
converted to Python scalars`` in ``extract``: ``int(np.frombuffer(..., count=1))``), and ``BLOCKWISE_8BIT``
needs bitsandbytes. Checked on hivemind 1.1.12, NumPy 2.4.6.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import BannedException
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor
from hivemind.utils.multiaddr import Multiaddr

from open_diloco.config import ConfigError
from open_diloco.diloco import RoundReport

# Importing hivemind switches torch's process-wide tensor sharing strategy to "file_system" (mpfuture.py),
# which starts a torch_shm_manager daemon that outlives our peers and leaks /dev/shm files when a process is
# killed; it also changes how the trainer's DataLoader workers share batches. Put torch's default back: we
# only pass a few tensors between the trainer and its averager process.
torch.multiprocessing.set_sharing_strategy("file_descriptor")

_NO_GROUP = "could not find a group"  # hivemind 1.1.12's message when matchmaking reaches its deadline alone
# seconds past averaging_timeout for hivemind to report a lonely deadline before we give up on the round
_GRACE = 1.0
COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {"none": NoCompression, "fp16": Float16Compression}


class RoundFailed(RuntimeError):
    """An all-reduce round produced no result (timed out, or hivemind raised). The caller's buffer is untouched."""


class DuplicateGalaxyRank(ConfigError):
    """Two clusters of one galaxy claim the same ``--hv.world-rank``."""


class _CanonicalAllReduce(AllReduceRunner):
    """Butterfly all-reduce whose result is bitwise identical on every peer (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Failed reducer -> its span keeps our own values (copy semantics), never zeros.
        self.tensor_part_container.return_deltas = False
        self.result_compression = self.tensor_part_container.compression.compression_type
        self.bytes_sent = self.bytes_received = 0
        self._serving, self._served = 0, asyncio.Event()

    def _serialize_result(self, averaged_part: torch.Tensor):
        return serialize_torch_tensor(averaged_part, self.result_compression)

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            if self.result_compression == runtime_pb2.CompressionType.NONE and averaged.dtype == torch.float32:
                canonical = averaged  # fp32 on the wire is exact: the others got these very bytes
            else:
                canonical = deserialize_torch_tensor(self._serialize_result(averaged))  # what the others got
            self.tensor_part_container.register_processed_part(peer_index, part_index, canonical)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # Copy of AllReduceRunner._accumulate_parts_streaming, sending compress(avg) instead of
        # compress(avg - part), compressed with our codec rather than the sender's.
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break
                serialized = await loop.run_in_executor(None, self._serialize_result, averaged)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def rpc_aggregate_part(self, stream, context):
        """We reduce a span for a peer: count its parts in and our averages out."""

        async def counted(incoming):
            async for msg in incoming:
                self.bytes_received += msg.ByteSize()
                yield msg

        self._serving += 1
        self._served.clear()
        try:
            async for msg in super().rpc_aggregate_part(counted(stream), context):
                self.bytes_sent += msg.ByteSize()
                yield msg
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._served.set()

    async def finish_serving(self) -> None:
        """Our own result is ready before the last averages went out to the peers we reduce for; wait for them
        (bounded by the reducer timeout) so the byte counts are complete."""
        if self._serving:
            try:
                await asyncio.wait_for(self._served.wait(), self.reducer_timeout)
            except asyncio.TimeoutError:
                pass

    def _get_peer_stub(self, peer):
        return _CountingStub(super()._get_peer_stub(peer), self)

    def stats(self) -> dict[str, int]:
        return dict(
            failed_size=self.tensor_part_container.failed_size,
            banned_senders=len(self.banned_senders),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )


class _CountingStub:
    """Wraps a peer stub so the parts we send to a reducer, and the averages it returns, are counted."""

    def __init__(self, stub, runner: _CanonicalAllReduce):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, inputs):
        runner = self._runner

        async def counted_inputs():
            async for msg in inputs:
                runner.bytes_sent += msg.ByteSize()
                yield msg

        stream = await self._stub.rpc_aggregate_part(counted_inputs())

        async def counted_outputs():
            async for msg in stream:
                runner.bytes_received += msg.ByteSize()
                yield msg

        return counted_outputs()


def _exit_with_parent(parent_pid: int) -> None:
    """Called first thing in our hivemind child processes. Hivemind's DHT and averager processes outlive a
    SIGKILLed trainer (and the DHT's p2pd keeps listening) because nothing tells them; a watchdog thread
    notices the re-parenting, ends this process's own children (p2pd) by PID, and exits."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        for pid in _child_pids(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class _DHT(DHT):
    """hivemind.DHT that exits (taking its p2pd with it) when the process that started it dies."""

    def run(self) -> None:
        _exit_with_parent(self._parent_pid)
        super().run()


class _CanonicalAverager(DecentralizedAverager):
    """DecentralizedAverager running :class:`_CanonicalAllReduce`, copying results, serving a caller's state."""

    get_state: Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]] | None = None
    _round_stats: dict[bytes, dict[str, int]]

    # Always fork, like hivemind.DHT (a ForkProcess): the averager cannot be pickled for "spawn", which is
    # the default start method inside processes started with spawn (and wherever a program chose it).
    _Popen = staticmethod(mp.context.ForkProcess._Popen)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        runner = _CanonicalAllReduce(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        assert runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX
        outputs = iter(tensors)
        async for averaged in runner:
            next(outputs).copy_(averaged)  # copy, not add: the canonical result
        await runner.finish_serving()
        if not hasattr(self, "_round_stats"):
            self._round_stats = {}
        self._round_stats[group_id] = runner.stats()

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        stats = self._round_stats.pop(group_info.group_id)
        return dict(gathered={peer.to_base58(): data for peer, data in gathered.items()}, **stats)

    def run(self) -> None:
        _exit_with_parent(self._parent_pid)
        super().run()

    def get_current_state(self):
        """Runs in the host process when a peer downloads state: answer with the caller's ``get_state()``."""
        if self.get_state is None:
            return {}, [], None
        metadata, tensors = self.get_state()
        return metadata, list(tensors), None


class HivemindAverager:
    """One shard's averager: a DHT client plus a :class:`_CanonicalAverager` over a private fp32 buffer.

    The buffer is private because hivemind moves averaged tensors into shared memory (``share_memory_``),
    which would silently un-pin or re-home the trainer's own buffer; we copy in and out under hivemind's
    tensor lock, so a round that outlives our timeout can never write into the caller's buffer.
    """

    def __init__(
        self,
        dht: DHT,
        averager: _CanonicalAverager,
        *,
        galaxy_rank: int,
        galaxy_size: int,
        averaging_timeout: float,
    ):
        self.dht, self.averager = dht, averager
        self.galaxy_rank, self.galaxy_size = galaxy_rank, galaxy_size
        self.averaging_timeout = averaging_timeout
        self.peer_id = dht.peer_id.to_base58()
        """This peer's libp2p PeerID (base58): how other peers' reports and errors name it."""
        self._closed = False

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs other peers can pass as ``initial_peers`` to join this peer's DHT."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def all_reduce(self, buffer: torch.Tensor, round_id: int, fingerprint: dict[str, Any]) -> RoundReport:
        """Average ``buffer`` in place with the same shard of the other clusters; see ``Averager.all_reduce``.

        Matchmaking waits ``matchmaking_time`` for the whole galaxy, then goes with whoever came (at least two);
        a peer still alone at ``averaging_timeout`` gets a group of one: ``group_size=1``, buffer unchanged,
        and the caller's partial-round policy decides. Raises :class:`RoundFailed` when hivemind fails
        or the round does not end within ``averaging_timeout`` (buffer untouched then), and
        :class:`DuplicateGalaxyRank` when another peer of the group claims our galaxy rank.
        """
        start = time.monotonic()
        metadata = {**fingerprint, "galaxy_rank": self.galaxy_rank, "round_id": round_id}
        if self.galaxy_size == 1:
            return RoundReport(
                group_size=1,
                complete=True,
                peers={self.galaxy_rank: metadata},
                seconds=time.monotonic() - start,
            )
        with self._tensors(start) as (private,):
            private.copy_(buffer.view(-1))
        control = self.averager.step(
            gather=metadata, timeout=self.averaging_timeout, allow_retries=False, wait=False
        )
        try:
            result = control.result(
                timeout=max(0.0, start + self.averaging_timeout + _GRACE - time.monotonic())
            )
        except TimeoutError:
            control.cancel()
            raise RoundFailed(
                f"round {round_id} did not finish within averaging_timeout={self.averaging_timeout}s"
            ) from None
        except Exception as e:
            if _NO_GROUP in str(e):  # nobody else showed up before the deadline: a group of one
                return RoundReport(
                    group_size=1,
                    complete=True,
                    peers={self.galaxy_rank: metadata},
                    seconds=time.monotonic() - start,
                )
            raise RoundFailed(f"round {round_id} failed: {e!r}") from e
        peers: dict[int, dict[str, Any]] = {}
        for peer, data in result["gathered"].items():
            rank = data.get("galaxy_rank")
            if rank == self.galaxy_rank and peer != self.peer_id:
                raise DuplicateGalaxyRank(
                    f"peer {peer} also claims galaxy rank {rank}; give every cluster a "
                    f"unique --hv.world-rank in 0..{self.galaxy_size - 1}"
                )
            peers[rank] = data
        with self._tensors(start) as (private,):
            buffer.view(-1).copy_(private)
        return RoundReport(
            group_size=len(result["gathered"]),
            complete=result["failed_size"] == 0 and result["banned_senders"] == 0,
            peers=peers,
            seconds=time.monotonic() - start,
            bytes_sent=result["bytes_sent"],
            bytes_received=result["bytes_received"],
        )

    @contextlib.contextmanager
    def _tensors(self, start: float):
        """Hivemind's tensor lock, with a timeout: a round that outlived its timeout may still be writing."""
        lock = self.averager.lock_averaged_tensors
        if not lock.acquire(timeout=max(1.0, start + self.averaging_timeout - time.monotonic())):
            raise RoundFailed("the averager is still busy with a previous round")
        try:
            yield self.averager._averaged_tensors
        finally:
            lock.release()

    def serve_state(self, get_state: Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]]) -> None:
        """Answer late joiners' ``download_state`` with ``get_state()`` (called in this process, on demand)."""
        self.averager.get_state = get_state
        self.averager.allow_state_sharing = True

    def download_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download ``(metadata, tensors)`` from a peer serving this shard; ``None`` if none answers in time.

        Retries until ``timeout``: a serving peer's DHT declaration may not have propagated yet."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                state = self.averager.load_state_from_peers(timeout=left)
            except TimeoutError:
                return None
            if state is not None and state[0]:
                metadata, tensors = state
                return metadata, [tensor.clone() for tensor in tensors]  # own memory, not the IPC segment
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def shutdown(self) -> None:
        """Stop the averager, then the DHT (and its p2pd); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.averager.is_alive():
                self.averager.shutdown()
        finally:
            _shutdown_dht(self.dht)


def start_shard_averager(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    run_id: str,
    shard_index: int,
    numel: int,
    galaxy_rank: int,
    galaxy_size: int,
    matchmaking_time: float,
    averaging_timeout: float,
    join_timeout: float,
    compression: str,
) -> HivemindAverager:
    """Start this shard's DHT client and averager (key prefix ``{run_id}/shard{shard_index}``).

    ``numel`` is the shard's flat buffer size: hivemind matches only peers with the same tensor schema.
    ``initial_peers`` empty: this peer starts its own DHT. Every wait is bounded by ``join_timeout``; bad
    addresses, unreachable peers and busy ports raise :class:`ConfigError` with a one-line fix.
    """
    if compression not in COMPRESSIONS:
        raise ConfigError(
            f"--hv.compression {compression!r} is not supported; use one of {sorted(COMPRESSIONS)}"
        )
    if averaging_timeout <= matchmaking_time:
        raise ConfigError(
            f"--hv.averaging-timeout ({averaging_timeout}s) must exceed --hv.matchmaking-time "
            f"({matchmaking_time}s)"
        )
    _check_initial_peers(initial_peers)
    _check_ports_free(host_maddrs)
    dht = _DHT(
        initial_peers=list(initial_peers),
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        start=True,
        await_ready=False,
        client_mode=False,
        nat_port_map=False,
        use_relay=False,
        use_auto_relay=False,
        auto_nat=False,
        wait_timeout=min(join_timeout, 3.0),
    )
    try:
        dht.wait_until_ready(timeout=join_timeout)
    except TimeoutError:
        _shutdown_dht(dht)
        raise ConfigError(
            f"could not join the DHT via --hv.initial-peers {list(initial_peers)} within "
            f"--hv.join-timeout={join_timeout}s; check that a peer runs there"
        ) from None
    except Exception as e:
        _shutdown_dht(dht)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "bootstrap" in reason:
            raise ConfigError(
                f"no DHT peer answered at --hv.initial-peers {list(initial_peers)}; start hivemind-dht "
                "there first or fix the address"
            ) from None
        raise ConfigError(
            f"could not start the DHT ({reason}); check --hv.initial-peers {list(initial_peers)} "
            f"and --hv.host-maddrs {list(host_maddrs)}"
        ) from None
    chunk_timeout = max(1.0, min(averaging_timeout / 4, 30.0))
    averager = _CanonicalAverager(
        [torch.zeros(numel, dtype=torch.float32)],
        dht,
        start=False,
        prefix=f"{run_id}/shard{shard_index}",
        target_group_size=galaxy_size,
        min_group_size=2,
        min_matchmaking_time=matchmaking_time,
        request_timeout=min(3.0, matchmaking_time / 2),
        allreduce_timeout=averaging_timeout,
        next_chunk_timeout=chunk_timeout,
        compression=COMPRESSIONS[compression](),
        client_mode=False,
        allow_state_sharing=False,
    )
    try:
        _start_keeping_signal_handlers(averager, join_timeout)
    except BaseException:
        if averager.is_alive():
            averager.terminate()
        _shutdown_dht(dht)
        raise
    return HivemindAverager(
        dht,
        averager,
        galaxy_rank=galaxy_rank,
        galaxy_size=galaxy_size,
        averaging_timeout=averaging_timeout,
    )


def _start_keeping_signal_handlers(averager: DecentralizedAverager, timeout: float) -> None:
    """Hivemind sets SIGINT to ignored in the parent before forking (so Ctrl-C reaches only the trainer, which
    shuts the averager down in order); the child inherits that, we restore the trainer's handlers."""
    if threading.current_thread() is not threading.main_thread():
        averager.start()
        averager.wait_until_ready(timeout)
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        averager.run_in_background(await_ready=True, timeout=timeout)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _check_initial_peers(initial_peers: Sequence[str]) -> None:
    for maddr in initial_peers:
        try:
            parsed = Multiaddr(maddr)
            parsed["p2p"]
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"--hv.initial-peers {maddr!r} is not a full peer multiaddr ({reason}); pass the "
                "line hivemind-dht prints, e.g. /ip4/10.0.0.1/tcp/31337/p2p/12D3KooW..."
            ) from None


def _check_ports_free(host_maddrs: Sequence[str]) -> None:
    """p2pd reports a busy port only in its log; find out here and say which flag to change."""
    for maddr in host_maddrs:
        try:
            parsed = Multiaddr(maddr)
            family = socket.AF_INET6 if "ip6" in parsed else socket.AF_INET
            host, port = parsed["ip6" if family == socket.AF_INET6 else "ip4"], int(parsed["tcp"])
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"--hv.host-maddrs {maddr!r} is not a valid multiaddr ({reason}); e.g. /ip4/0.0.0.0/tcp/0"
            ) from None
        if port == 0:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise ConfigError(
                        f"--hv.host-maddrs {maddr!r}: cannot listen there ({e.strerror})"
                    ) from None
                raise ConfigError(
                    f"--hv.host-maddrs {maddr!r}: port {port} is already in use; pick a free port or tcp/0"
                ) from None


def _shutdown_dht(dht: DHT) -> None:
    """Shut the DHT down; if its process is stuck (e.g. still bootstrapping), end its p2pd child and it by PID,
    since terminating only the DHT process would orphan the p2pd daemon."""
    if dht.is_alive() and dht._ready.done() and not dht._ready.exception():
        dht.shutdown()
    if dht.is_alive():
        for pid in _child_pids(dht.pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        dht.terminate()
        dht.join(5)


def _child_pids(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                children.append(int(entry))
    return children
