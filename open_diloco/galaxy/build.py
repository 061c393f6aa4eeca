"""The one place that turns a cluster's ``--hv.*`` configuration into its part of the galaxy: every rank's
shard averager (its DHT node, identity, allowlist, wire compression) and rank 0's status record.

Everything below takes its settings from the :class:`~open_diloco.config.HvConfig` handed down from here and
keeps no defaults of its own: a default repeated below the configuration drifts from it (``sparse_rule``
once read ``random`` in four places while the flag said ``magnitude``). What the galaxy needs from the world
and the model besides the flags, a caller states in a :class:`ClusterShard`.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, Float16Compression, NoCompression

from open_diloco import version_line
from open_diloco.config import HvConfig
from open_diloco.galaxy.allowlist import Allowlist, ensure_identity, rank_key_file
from open_diloco.galaxy.allreduce import CodecCompression
from open_diloco.galaxy.averager import SHUTDOWN_SECONDS, HivemindAverager
from open_diloco.galaxy.canonical_averager import CanonicalAverager
from open_diloco.galaxy.dht import shutdown_dht, start_dht
from open_diloco.galaxy.lifecycle import end_child
from open_diloco.galaxy.reachability import (
    check_reachability,
    report_reachability_in_background,
    serve_dial_back,
)
from open_diloco.galaxy.status import StatusPublisher, cluster_identity
from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.codecs import codec_label, score_values, wire_codecs

log = logging.getLogger(__name__)

ELASTIC_GROUP = 64
"""The most clusters one round of an elastic galaxy groups (hivemind's ``target_group_size``; each round's
plan sets the group it waits for: the clusters alive)."""


@dataclass(frozen=True)
class ClusterShard:
    """What the galaxy needs to know of one rank's shard beyond the ``--hv.*`` flags."""

    index: int
    """The rank in its cluster: its shard averages with shard ``index`` of every other cluster."""
    ranks: int
    """The cluster's ranks (its torchrun world size), one shard each: the same in every cluster."""
    numel: int
    """Values one round averages on this shard: the shard, or one fragment of it (``--hv.fragments``)."""
    model_fingerprint: str
    """A hash of the model's parameter names and shapes (``model.model_fingerprint``)."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """The model config's fields that decide those shapes (``model.shape_fields``): a mismatch names them."""
    tokens_per_step: int = 0
    """Tokens of one inner step of the cluster (--total-batch-size × --seq-length): with --hv.round-steps
    by-speed a Δ's weight counts steps, so every cluster's steps must hold as many tokens."""
    samples_per_step: int = 0
    """Samples of one inner step (--total-batch-size): an elastic galaxy's page is one step's samples, so
    every cluster's must be as many, of as many tokens (the same tokens cut 8 × 128 and 4 × 256 would deal
    pages that overlap)."""

    @classmethod
    def flat(cls, numel: int) -> ClusterShard:
        """The one shard of a one-rank cluster whose model is ``numel`` values, no more: benchmarks and tests
        of the averager alone."""
        return cls(
            index=0, ranks=1, numel=numel, model_fingerprint=f"numel {numel}", model_config={"numel": numel}
        )

    def schema(self, hv: HvConfig) -> dict[str, Any]:
        """What this cluster must share with every other to average (``membership_record.SCHEMA_KEYS``,
        compared at every round), and the model fields a mismatch is explained with."""
        seq_length = self.tokens_per_step // max(1, self.samples_per_step)
        return {
            "model_fingerprint": self.model_fingerprint,
            "ranks": self.ranks,
            "codec": codec_label(hv.compression, hv.sparse_density, hv.sparse_rule),
            "fragments": hv.fragments,
            "round_steps": (
                f"by-speed, {self.tokens_per_step} tokens per inner step"
                if hv.round_steps == "by-speed"
                else hv.round_steps
            ),
            # an elastic galaxy deals pages of one order: each must be as many samples of as many tokens
            "membership": (
                f"elastic, {hv.local_steps // hv.fragments} pages a stride of "
                f"{self.samples_per_step} samples of {seq_length} tokens"
                if hv.elastic
                else "fixed"
            ),
            "model_config": dict(self.model_config),
        }


@dataclass
class GalaxyPart:
    """This rank's part of the galaxy: its shard's averager, and on rank 0 the cluster's status record."""

    averager: HivemindAverager
    status: StatusPublisher | None


def wire_compression(hv: HvConfig) -> CompressionBase:
    """``--hv.compression`` as a hivemind compression: none and fp16 are hivemind's own, the others ours
    (``open_diloco.outer.codecs``, carried by ``galaxy/allreduce.py``'s :class:`CodecCompression`); ours take
    the sparse rule (``magnitude`` adds a tensor of block scores). None of hivemind's 8-bit codecs is offered:
    in hivemind 1.1.12 ``Uniform8BitQuantization``/``Quantile8BitQuantization`` do not round-trip with NumPy
    2.4 (``TypeError: only 0-dimensional arrays can be converted to Python scalars`` in ``extract``), and
    ``BLOCKWISE_8BIT`` needs bitsandbytes."""
    if hv.compression == "none":
        return NoCompression()
    if hv.compression == "fp16":
        return Float16Compression()
    return CodecCompression(wire_codecs(hv.compression, hv.sparse_rule))


def averaging_settings(hv: HvConfig) -> dict[str, Any]:
    """The arguments of a hivemind ``DecentralizedAverager`` that decide whom a round waits for, how long, and
    what goes on the wire (a benchmark's plain hivemind baseline takes the same)."""
    return dict(
        target_group_size=max(hv.galaxy_size, ELASTIC_GROUP) if hv.elastic else hv.galaxy_size,
        min_group_size=2,
        min_matchmaking_time=hv.matchmaking_time,
        request_timeout=min(3.0, hv.matchmaking_time / 2),
        allreduce_timeout=hv.averaging_timeout,
        next_chunk_timeout=max(1.0, min(hv.averaging_timeout / 4, 30.0)),
        compression=wire_compression(hv),
    )


def join_galaxy(hv: HvConfig, shard: ClusterShard, cluster: ClusterComm) -> GalaxyPart:
    """Start this rank's shard averager and, on rank 0, the cluster's status record; every rank of the cluster
    calls it at once (it gathers the ranks' PeerIDs).

    With no ``--hv.initial-peers`` and several ranks, rank 0's DHT is the entry point and the others join it.
    """
    if hv.initial_peers or shard.ranks == 1:
        averager = start_shard_averager(hv, shard, initial_peers=hv.initial_peers)
    else:
        averager = start_shard_averager(hv, shard, initial_peers=[]) if shard.index == 0 else None
        entry = cluster.broadcast_strings(averager.visible_maddrs if averager is not None else [])
        averager = averager or start_shard_averager(hv, shard, initial_peers=entry)
    try:
        shard_peer_ids = cluster.gather_strings(averager.peer_id)
        # a client shard serves no state, and so neither does its cluster
        any_client = "1" in cluster.gather_strings("1" if averager.averager.client_mode else "0")
        status = None
        if shard.index == 0:
            identity = cluster_identity(
                hv.world_rank, averager.schema, hv.local_steps, version_line(), shard_peer_ids
            )
            identity["client_mode"] = any_client
            if hv.cluster_id is not None:
                identity["cluster_id"] = hv.cluster_id
            status = StatusPublisher(
                averager.dht, hv.run_id, identity, hv.heartbeat_interval, hv.member_expiry
            )
        return GalaxyPart(averager, status)
    except BaseException:
        averager.shutdown()  # the caller only knows what this returns, which does not exist yet
        raise


def start_shard_averager(
    hv: HvConfig, shard: ClusterShard, *, initial_peers: Sequence[str]
) -> HivemindAverager:
    """Start this shard's DHT node and averager (key prefix ``{run_id}/shard{index}``), joining
    ``initial_peers`` (``--hv.initial-peers``, or rank 0's DHT; empty: a DHT of its own).

    hivemind matches only peers with the same tensor schema, so the buffer is ``shard.numel`` values; with
    ``--hv.compression sparse`` and the ``magnitude`` rule a second tensor carries the block scores, both
    views of one flat buffer (:meth:`HivemindAverager.buffer`), values first. Every wait is bounded by
    ``--hv.join-timeout``; bad addresses, unreachable peers and busy ports raise :class:`ConfigError` with a
    one-line fix.
    """
    allowlist = Allowlist.load(hv.allowlist) if hv.allowlist is not None else None
    _freeze_heap_before_forking()
    identity_path = _rank_identity(hv, shard.index, allowlist)
    dht = start_dht(
        initial_peers,
        hv.host_maddrs,
        hv.announce_maddrs,
        hv.join_timeout,
        client_mode=hv.client_mode,
        identity_path=identity_path,
    )
    client_mode = hv.client_mode or _unreachable(hv, dht, allowlist, shard.index)
    numel, scores = shard.numel, score_values(shard.numel, hv.compression, hv.sparse_rule)
    # shared before the views are cut: one segment
    wire_buffer = torch.zeros(numel + scores, dtype=torch.float32).share_memory_()
    averager = CanonicalAverager(
        [wire_buffer[:numel], wire_buffer[numel:]] if scores else [wire_buffer],
        dht,
        start=False,
        prefix=f"{hv.run_id}/shard{shard.index}",
        client_mode=client_mode,  # reduces no span: nobody needs to dial it
        allow_state_sharing=False,
        shutdown_timeout=SHUTDOWN_SECONDS,
        **averaging_settings(hv),
    )
    averager.delta_norm_bound, averager.robust_mean = hv.delta_norm_bound, hv.robust_mean  # before the fork
    averager.allowlist = allowlist
    try:
        _start_keeping_signal_handlers(averager, hv.join_timeout)
    except BaseException:
        end_child(averager)
        shutdown_dht(dht)
        raise
    if not (hv.client_mode or hv.auto_client_mode):
        report_reachability_in_background(dht, f"rank {shard.index}")
    return HivemindAverager(
        dht,
        averager,
        hv,
        shard_index=shard.index,
        schema=shard.schema(hv),
        initial_peers=initial_peers,
        allowlist=allowlist,
        wire_buffer=wire_buffer,
    )


def _unreachable(hv: HvConfig, dht: DHT, allowlist: Allowlist | None, rank: int) -> bool:
    """Serve other clusters' dial-backs and, with ``--hv.auto-client-mode``, have this rank's announced
    addresses dialled back now (``galaxy/reachability.py``): True when it should join as a client. A client is
    neither dialled nor dials back."""
    if hv.client_mode:
        return False
    serve_dial_back(dht, allowlist.peers if allowlist is not None else None)
    if not hv.auto_client_mode:
        return False  # checked beside the trainer once the averager has started (no thread across its fork)
    found = check_reachability(dht)
    found.report(f"rank {rank}")
    if found.reachable is False:
        log.warning(
            "rank %d joins as a client of the all-reduce (--hv.auto-client-mode): nobody can dial it", rank
        )
    return found.reachable is False


def _freeze_heap_before_forking() -> None:
    """Move every object alive now out of the cyclic GC's reach (``gc.freeze``), in this process and in the
    DHT and averager processes about to be forked from it. A collection writes into each object it scans,
    and a page written on either side of a fork becomes a private copy on both: without it every full
    collection, here or in a fork, copies the part of the interpreter's heap the two still share (~15 MiB
    per fork measured at 96M, docs/results/outer-memory.md). What is frozen was alive before the galaxy
    started (modules, the configuration, the meta model): kept for the run anyway."""
    gc.collect()
    gc.freeze()


def _rank_identity(hv: HvConfig, rank: int, allowlist: Allowlist | None) -> str | None:
    """This rank's libp2p key file under ``--hv.identity-path`` (made if missing; the rank names it, so the
    shard's PeerID is the same at every start), or ``None``: a new PeerID every start."""
    if hv.identity_path is None:
        return None
    peer_id = ensure_identity(hv.identity_path, rank)
    key_file = str(rank_key_file(hv.identity_path, rank))
    log.info("rank %d: PeerID %s (%s)", rank, peer_id, key_file)
    if allowlist is not None and not allowlist.admits(peer_id):
        log.warning(
            "this rank's PeerID %s is not on --hv.allowlist %s: the other clusters' lists must name it",
            peer_id,
            hv.allowlist,
        )
    return key_file


def _start_keeping_signal_handlers(averager: DecentralizedAverager, timeout: float) -> None:
    """Hivemind sets SIGINT to ignored in the parent before forking; we keep the trainer's handlers."""
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
