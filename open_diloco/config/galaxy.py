"""The ``--hv.*`` flags: how this cluster finds the other clusters of its galaxy and averages with them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from cyclopts import Parameter
from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from open_diloco.addresses import announce_address, listen_address, peer_address
from open_diloco.config.fields import STRICT, show_ranges_in_help
from open_diloco.errors import ConfigError

Multiaddrs = Annotated[list[str], Parameter(consume_multiple=True, negative=())]


class HvConfig(BaseModel):
    """The galaxy: how this cluster finds the others and averages with them (DiLoCo outer loop)."""

    model_config = STRICT

    initial_peers: Multiaddrs = []
    """Multiaddrs of DHT peers to join (the line `hivemind-dht` prints); several allowed. Empty: this cluster
    starts its own DHT (fine for a galaxy of one, or for the first cluster of a galaxy)."""

    galaxy_size: Annotated[int, Field(ge=1)] = 1
    """Number of clusters training together. Without --hv.world-rank (an elastic galaxy): how many clusters
    the galaxy's first round needs; others join and leave later."""

    world_rank: Annotated[int, Field(ge=0)] = 0
    """This cluster's rank in a fixed galaxy, 0 … galaxy-size − 1, unique per cluster. Unset, with
    --hv.initial-peers or a galaxy size above 1: an elastic galaxy, where the cluster is known by its
    --hv.cluster-id and joins and leaves at round boundaries (docs/round-protocol.md)."""

    cluster_id: str | None = None
    """This cluster's id in an elastic galaxy (no --hv.world-rank). Unset: made at the first start and kept in
    --ckpt.path (`cluster_id`), so a restart is the same cluster."""

    local_steps: Annotated[int, Field(ge=1)] = 500
    """H: inner steps between two outer steps."""

    round_steps: Literal["equal", "by-speed"] = "equal"
    """Inner steps each cluster takes per round. `equal`: every cluster takes H, so a round waits for the
    slowest. `by-speed`: the fastest cluster takes H and each slower one the share its speed allows in the
    same time (from the inner-step times the clusters publish, or --hv.cluster-speed), so no cluster idles;
    each pseudo-gradient is averaged weighted by the inner steps (tokens) behind it, and the lr, the syncs and
    --max-steps follow the galaxy's steps, not the cluster's own. Every cluster must use the same, and with
    `by-speed` the same tokens per inner step (--total-batch-size × --seq-length). See
    docs/unequal-clusters.md."""

    cluster_speed: Annotated[float, Field(ge=0, le=1)] = 0.0
    """With --hv.round-steps by-speed: this cluster's speed as a share of the fastest cluster's, fixed (it
    takes that share of each round's steps, rounded, at least one) instead of measured. 0: measure. For an
    operator who knows the ratio, and for runs that must repeat exactly."""

    fragments: Annotated[int, Field(ge=1)] = 1
    """P: streaming DiLoCo. Each shard's θ_outer is cut into P equal slices that sync in turn, one every H/P
    inner steps (fragment f at steps f·H/P + H, 2H, ...), so each all-reduce carries 1/P of the model. 1: the
    whole model every H steps. Must divide --hv.local-steps; every cluster must use the same. See
    docs/overlap.md."""

    sync_delay: Annotated[int, Field(ge=0)] = 0
    """τ: inner steps a sync's all-reduce (matchmaking included) runs in the background before its outer
    update lands, mixed with the inner steps made meanwhile (--hv.sync-alpha). 0: training waits for the
    round. At most H/P (then a sync lands at the step the next one starts: the network is never idle)."""

    sync_alpha: Annotated[float, Field(ge=0, lt=1)] = 0.5
    """α: with --hv.sync-delay, a landing fragment becomes α·θ_local + (1 − α)·θ_outer (θ_local: the model, τ
    inner steps on); 0 drops those steps. Neither dropping nor re-applying those steps trained as well as
    mixing (docs/overlap.md)."""

    outer_lr: Annotated[float, Field(gt=0)] = 1.0
    """Learning rate of the outer optimizer (SGD, optionally with (Nesterov) momentum). The default, lr 1 with
    momentum 0, is plain averaging (θ_outer ← mean θ_local), which trained best of the outer settings tried on
    the quality yardstick (`scripts/bench/convergence.py`); the DiLoCo papers' 0.7 with momentum 0.9 trained
    clearly worse there (docs/results/training-quality.md). Above 1 extrapolates the average, below 1 damps
    it."""

    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Momentum of the outer optimizer; 0 is plain SGD (with --hv.outer-lr 1: plain averaging). The DiLoCo
    papers use 0.9 (Nesterov) with lr 0.7 for long runs at H ≈ 500; with momentum, the steady-state step is
    lr/(1 − momentum) times the averaged pseudo-gradient."""

    outer_nesterov: bool = True
    """Nesterov momentum in the outer step (off: heavy-ball momentum); no effect with momentum 0."""

    outer_warmup_rounds: Annotated[int, Field(ge=0)] = 0
    """Outer steps over which the outer lr and momentum ramp linearly from plain averaging (lr 1, momentum 0)
    to --hv.outer-lr and --hv.outer-momentum; round 1 is then plain averaging, so the first round's large
    pseudo-gradient never enters the momentum. 0: full settings from round 1."""

    run_id: Annotated[str, Field(min_length=1)] = "open_diloco"
    """Prefix of every DHT key of this run; clusters of one galaxy must share it."""

    host_maddrs: Multiaddrs = ["/ip4/0.0.0.0/tcp/0"]
    """Multiaddrs this cluster's peers listen on (port 0: any free port)."""

    announce_maddrs: Multiaddrs = []
    """Multiaddrs other clusters should dial, where they differ from what the host listens on (NAT,
    docker)."""

    matchmaking_time: Annotated[float, Field(gt=0)] = 2.0
    """The least a round waits for the rest of the live galaxy before an all-reduce goes on with a partial
    group (a full group starts at once). Each round waits longer when the galaxy's whole rounds took longer
    to form (1.5 × their 90th percentile, ``outer/matchmaking.py``), so the default fits a WAN too. Raise it
    to the time a cluster takes to download θ_outer over its slowest link where re-syncs are frequent (a
    cluster that re-synced is that late for the next round, which is then retried once:
    docs/round-protocol.md)."""

    averaging_timeout: Annotated[float, Field(gt=0)] = 120.0
    """Seconds an outer-step all-reduce may take, matchmaking included, before the round counts as failed."""

    join_timeout: Annotated[float, Field(gt=0)] = 60.0
    """Seconds to wait for the DHT and (for a late joiner) for a peer to download the outer state from."""

    final_wait: Annotated[float, Field(ge=0)] = 120.0
    """Seconds a cluster at the end of its run waits for clusters that went silent less than this long ago
    (crashed, or cut off by a partition and training on) to come back and end on the galaxy's final θ_outer,
    serving it meanwhile (docs/round-protocol.md, The last round). A crashed cluster looks the same as a
    cut-off one: a run whose cluster crashed within this time of its end waits out the rest of it; one silent
    for longer costs nothing. 0: only clusters already there count (a cut across the run's end then ends the
    galaxy split)."""

    compression: Literal["none", "fp16", "bf16", "int8", "int4", "int2", "sparse"] = "none"
    """Wire compression of the pseudo-gradient all-reduce (bytes per round vs fp32 `none`): `fp16`/`bf16` 2x;
    `int8`, `int4`, `int2` blockwise quantization, ~4x, ~7.5x, ~15x; `sparse` sends --hv.sparse-density of the
    values at 2 bits, the same places in every cluster (no indices on the wire), >= 100x by default; what a
    round does not send stays in the model until its turn. Every
    cluster must use the same. How to choose: docs/compression.md."""

    error_feedback: bool = True
    """With a lossy codec (bf16, int*, sparse): add what the encoding dropped to the next round's
    pseudo-gradient (one fp32 copy of the shard per rank, checkpointed)."""

    sparse_density: Annotated[float, Field(gt=0, le=1)] = 0.1
    """`sparse`: the share of the values sent each round (`magnitude`: of the blocks of 128; `random`,
    `cyclic`: of every 4096 values)."""

    sparse_rule: Literal["magnitude", "random", "cyclic"] = "magnitude"
    """`sparse`: which values a round sends, the same in every cluster with no indices on the wire.
    `magnitude`: the blocks of 128 values where the clusters left the most unsent the round before, by a
    one-byte score per block averaged in the round itself (it trained better than `random` on the yardstick:
    docs/compression.md); `random`: a fresh set drawn from the round id each round; `cyclic`: a window sliding
    so every value goes once every 1/density rounds."""

    on_partial_round: Literal["retry", "proceed", "fail"] = "retry"
    """What to do when not every cluster took part in a round: `retry` it (up to --hv.max-retries, then
    proceed), `proceed` with the clusters present, or `fail` (stop the run)."""

    max_bad_rounds: Annotated[int, Field(ge=1)] = 3
    """Rounds in a row this cluster may sit out with a bad pseudo-gradient (not finite, or out of bound: its
    training diverged; it adopts the galaxy's θ_outer instead of sending) before it stops with one line saying
    why."""

    delta_norm_bound: Annotated[float, Field(ge=0)] = 10.0
    """A pseudo-gradient whose norm exceeds this many times the reference is out of bound: this cluster does
    not send its own when it exceeds the galaxy's recent median, and its reducers leave out a sender that
    exceeds their own. 0: off (claims are still checked). See docs/security.md."""

    robust_mean: bool = False
    """Clip every cluster's pseudo-gradient to the round's median norm before averaging (off: the plain
    mean)."""

    max_retries: Annotated[int, Field(ge=0)] = 2
    """Retries of a partial round before proceeding with the clusters present (policy `retry`)."""

    fork_after: Annotated[float, Field(ge=0)] = 120.0
    """Seconds a cluster without a majority of the galaxy's roster commits nothing (it takes the majority's
    state once the partition heals) before it commits on a fork of the ledger: the way on for
    a side whose majority is gone for good (docs/round-protocol.md, "Quorum"). 0: never hold (every side of a
    partition commits on its own, as before the quorum)."""

    heartbeat_interval: Annotated[float, Field(gt=0)] = 5.0
    """Seconds between refreshes of this cluster's membership and status record in the DHT (besides one after
    every round and one when it leaves)."""

    member_expiry: Annotated[float, Field(gt=0)] = 15.0
    """Seconds without a refresh after which a cluster no longer counts as alive: rounds stop waiting for it
    (and `open-diloco status` flags it silent). A cluster that leaves cleanly stops counting at once."""

    identity_path: Path | None = None
    """Directory of this cluster's libp2p key files, one per local rank (`rank0.key`, ...; made on first
    start): its PeerIDs stay the same across restarts, so other clusters' --hv.allowlist can name them.
    `open-diloco identity DIR --ranks N` makes them and prints the PeerIDs. Unset: new PeerIDs at every
    start."""

    allowlist: Path | None = None
    """File of the PeerIDs allowed to average with this cluster and to download its state, one per line (`#`
    comments); every peer not on it is refused, both ways. Unset: anyone who reaches the DHT and knows the run
    id. See docs/security.md."""

    client_mode: bool = False
    """This cluster cannot be dialled (behind a NAT or a firewall that drops what comes in): it takes part in
    every round as a client of the all-reduce. It sends its pseudo-gradient to the reducers and copies their
    averages, reduces no span, and serves no state to other clusters. The galaxy needs at least one cluster
    without it. See docs/networks.md."""

    auto_client_mode: bool = False
    """Before joining, ask another cluster to dial this one back (at most 30 s): if it cannot reach any
    address this cluster announces, join as a client (as `--hv.client-mode`). The first cluster of a galaxy
    has nobody to ask and joins as a reachable one. See docs/networks.md."""

    skip_load_from_peers: bool = False
    """Start from this cluster's own initial weights instead of downloading the galaxy's current state."""

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _valid_maddrs(cls, maddrs: list[str], info: ValidationInfo) -> list[str]:
        check = {
            "initial_peers": peer_address,
            "host_maddrs": listen_address,
            "announce_maddrs": announce_address,
        }[info.field_name]
        for maddr in maddrs:
            check(maddr)
        return maddrs

    @property
    def elastic(self) -> bool:
        """Clusters join and leave by the ledger, known by id, not by a rank (``open_diloco/cluster_id.py``):
        what a cluster started without --hv.world-rank in a galaxy is."""
        return self.cluster_id is not None

    @property
    def unranked(self) -> bool:
        """Started in a galaxy without --hv.world-rank: elastic once its id is known."""
        in_a_galaxy = self.galaxy_size > 1 or bool(self.initial_peers)
        return in_a_galaxy and "world_rank" not in self.model_fields_set and self.cluster_id is None

    @property
    def alone(self) -> bool:
        """A galaxy of one by its flags: no other cluster can come (the rounds need no DHT)."""
        return self.galaxy_size == 1 and not self.elastic

    @model_validator(mode="after")
    def _cross_field(self) -> HvConfig:
        if self.cluster_id is not None and "world_rank" in self.model_fields_set:
            raise ConfigError(
                f"--hv.cluster-id {self.cluster_id} names a cluster of an elastic galaxy, --hv.world-rank "
                f"{self.world_rank} one of a fixed galaxy: drop one of them"
            )
        if self.world_rank >= self.galaxy_size and not self.elastic:
            raise ConfigError(
                f"--hv.world-rank {self.world_rank} is not below --hv.galaxy-size {self.galaxy_size}: "
                f"give each cluster a rank in 0..{self.galaxy_size - 1}"
            )
        if self.member_expiry <= self.heartbeat_interval:
            raise ConfigError(
                f"--hv.member-expiry {self.member_expiry} is not above --hv.heartbeat-interval "
                f"{self.heartbeat_interval}: every live cluster would look gone between two heartbeats; "
                "raise the expiry (3 intervals is a good choice)"
            )
        if self.local_steps % self.fragments:
            raise ConfigError(
                f"--hv.fragments {self.fragments} does not divide --hv.local-steps {self.local_steps}: "
                "fragments sync every local-steps/fragments inner steps; choose a divisor"
            )
        if self.sync_delay > self.local_steps // self.fragments:
            raise ConfigError(
                f"--hv.sync-delay {self.sync_delay} is above --hv.local-steps/--hv.fragments = "
                f"{self.local_steps // self.fragments}: a sync must land before the next one starts; lower "
                "the delay"
            )
        if self.compression == "sparse" and (self.fragments > 1 or self.sync_delay):
            raise ConfigError(
                "--hv.compression sparse does not combine with --hv.fragments or --hv.sync-delay yet: a "
                "sparse round keeps what it does not send in the model, as a fragment schedule does; use one "
                "or the other"
            )
        if self.auto_client_mode and self.client_mode:
            raise ConfigError(
                "--hv.auto-client-mode decides client mode from the reachability check: drop "
                "--hv.client-mode, or drop --hv.auto-client-mode to be a client whatever the check says"
            )
        if self.auto_client_mode and not self.initial_peers:
            raise ConfigError(
                "--hv.auto-client-mode needs --hv.initial-peers: a cluster that starts the DHT has nobody to "
                "dial it back"
            )
        if self.client_mode and not self.initial_peers:
            raise ConfigError(
                "--hv.client-mode needs --hv.initial-peers: a cluster nobody can dial cannot start the DHT; "
                "join the DHT a reachable peer runs"
            )
        if self.cluster_speed and self.round_steps != "by-speed":
            raise ConfigError(
                f"--hv.cluster-speed {self.cluster_speed} only applies with --hv.round-steps by-speed: add "
                "that, or drop --hv.cluster-speed"
            )
        if self.averaging_timeout <= self.matchmaking_time:
            raise ConfigError(
                f"--hv.averaging-timeout {self.averaging_timeout} is not above --hv.matchmaking-time "
                f"{self.matchmaking_time}: a round includes its matchmaking, so raise the timeout"
            )
        return self


show_ranges_in_help(HvConfig)
