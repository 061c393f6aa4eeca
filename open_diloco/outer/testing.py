"""A galaxy of threads: implements the outer loop's ``Averager`` protocol in one process, no hivemind. The
unit tests and the benchmarks (scripts/bench) share it, so it lives in the package rather than under tests/.

Each thread is a cluster; a barrier makes every round meet. The result is the exact mean of the buffers of the
clusters present (less those outside the round's cohort, as the galaxy's reducers leave them out), copied to
each, so it is bitwise identical by construction: what the unit tests check is the outer loop's math and
decisions around it. With one of our codecs (``compression``) the mean is rounded the way the galaxy's reducer
does (decode(encode(mean)); the senders' buffers are already on the codec's grid, which the wire carries
exactly), so benches measure the codec's effect on training. The buffer has the layout of the galaxy's
(``HivemindAverager.buffer``): the values, then the sparse ``magnitude`` rule's block scores, each part
rounded by its own codec."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

from open_diloco.config import HvConfig
from open_diloco.outer.codecs import score_values, wire_codecs
from open_diloco.outer.digests import combine_hashes
from open_diloco.outer.guard import ClaimCheck
from open_diloco.outer.matchmaking import MatchmakingPlan
from open_diloco.outer.policy import out_of_cohort
from open_diloco.outer.protocols import Membership, RoundReport


class InProcessGalaxy:
    """``size`` clusters averaging in threads. ``drop``: galaxy ranks missing from every round (they average
    alone). ``departed``: galaxy ranks the membership records say are gone; ``silent``: those of them that did
    not say they ended (their record expired)."""

    def __init__(
        self,
        size: int,
        drop: set[int] | None = None,
        compression: str = "none",
        departed: set[int] | None = None,
        silent: set[int] | None = None,
        serve_state: bool = False,
        robust_mean: bool = False,
        sparse_rule: str = HvConfig().sparse_rule,
    ):
        self.size = size
        self.departed = departed or set()
        self.silent = silent or set()
        self.silent_seconds: dict[int, float] = {}
        """How long each silent cluster has been silent (``Membership.silent_seconds``; unset: just now)."""
        self.lead = -1
        """The lead outer step the membership records show (-1: unknown)."""
        self.lead_work = 0
        """The committed work of the lead's chain (``Membership.lead_work``)."""
        self.step_seconds: dict[int, float] = {}
        """Seconds per inner step each cluster's record shows (``Membership.step_seconds``)."""
        self.ages: dict[int, float] = {}
        """The records' ages (``Membership.ages``); none: a holding cluster has nothing to wait for
        (``outer/hold_pause.py``)."""
        self.lead_progress = (-1, 0.0)
        """(inner step, seconds since) the lead cluster's record shows (``Membership.lead_inner_step``)."""
        self.serve_state = serve_state
        """Let ``download_state`` answer with another averager's served state (else nobody serves)."""
        self.robust_mean = robust_mean
        """Clip every cluster's Δ to the round's median claim, as the galaxy's reducers do
        (``--hv.robust-mean``)."""
        self.averagers: dict[int, InProcessAverager] = {}
        self._joining = threading.Lock()
        """Guards ``averagers``: each cluster thread adds its own while the others' membership reads it."""
        self.compression, self.sparse_rule = compression, sparse_rule
        self.codecs = wire_codecs(compression, sparse_rule)
        self.drop = drop or set()
        self.barrier = threading.Barrier(size, timeout=30)
        self.buffers: dict[int, torch.Tensor] = {}
        self.meta: dict[int, dict] = {}

    def averager(self, rank: int, numel: int) -> InProcessAverager:
        """Cluster ``rank``'s averager of ``numel`` values a round (and their block scores, if any)."""
        averager = InProcessAverager(
            self, rank, numel, score_values(numel, self.compression, self.sparse_rule)
        )
        with self._joining:
            self.averagers[rank] = averager
        return averager

    def members(self) -> dict[int, InProcessAverager]:
        """A snapshot of the averagers by galaxy rank. Why a copy under the lock: iterating the live dict
        while a slower cluster thread joins raised "dictionary changed size during iteration" (1 run in 12
        under a busy scheduler), which broke the round barrier for every thread."""
        with self._joining:
            return dict(self.averagers)


class InProcessRound:
    def __init__(self, averager: InProcessAverager, round_id: int, fingerprint: dict, attempt: int = 0):
        self.averager, self.round_id = averager, round_id
        self.fingerprint, self.attempt = fingerprint, attempt

    def wait(self) -> RoundReport:
        av, galaxy = self.averager, self.averager.galaxy
        galaxy.buffers[av.rank] = av.values.clone()
        galaxy.meta[av.rank] = {
            "galaxy_rank": av.rank,
            "round_id": self.round_id,
            "attempt": self.attempt,
            **self.fingerprint,
        }
        galaxy.barrier.wait()
        if av.rank in galaxy.drop:
            present = [av.rank]
        else:
            present = [r for r in sorted(galaxy.buffers) if r not in galaxy.drop]
        stale = out_of_cohort({r: galaxy.meta[r] for r in present})  # every reducer of the galaxy leaves out
        claims = ClaimCheck(
            {r: galaxy.meta[r].get("delta_norm") for r in present},
            av.rank,
            0.0,
            galaxy.robust_mean,
            stale=frozenset(stale),
        )
        cohort = [r for r in present if r not in stale]
        weights = [float(galaxy.meta[r].get("weight", 1.0)) for r in cohort]
        scaled = torch.stack([galaxy.buffers[r] * claims.scale(r) for r in cohort])
        if all(weight == 1.0 for weight in weights):
            average = scaled.mean(0)
        else:  # --hv.round-steps by-speed: weighted by the steps behind each Δ, as the reducers do
            average = (scaled * torch.tensor(weights).unsqueeze(1)).sum(0) / sum(weights)
        sent = av.values.numel() * 4
        if galaxy.codecs is not None:
            sent = 0
            for key, (own, averaged) in enumerate(zip(av.parts(av.values), av.parts(average), strict=True)):
                codec = galaxy.codecs.for_key(key)
                sent += codec.encode(own, on_grid=True).numel()  # a peer of two sends about one encoding
                if len(present) > 1:
                    codec.round_trip_(averaged)
        peers = {r: galaxy.meta[r] for r in present}
        galaxy.barrier.wait()
        av.values.copy_(average)
        return RoundReport(
            group_size=len(present), complete=True, peers=peers, bytes_sent=sent, stale=sorted(stale)
        )


class InProcessAverager:
    def __init__(self, galaxy: InProcessGalaxy, rank: int, numel: int, scores: int = 0):
        self.galaxy, self.rank = galaxy, rank
        self.values = torch.zeros(numel + scores)
        self.sizes = [numel, scores] if scores else [numel]
        self.calls = 0
        self.get_state = None
        self.finished = False

    def parts(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``flat`` cut like the galaxy's tensors: the values, then the block scores (views)."""
        return flat.split(self.sizes)

    @contextlib.contextmanager
    def buffer(self) -> Iterator[torch.Tensor]:
        yield self.values

    def matchmaking_plan(self, live_clusters: int, coming: bool = False) -> MatchmakingPlan:
        """Nothing to wait for in one process: every cluster's round is already there."""
        return MatchmakingPlan(window=0.0, request_timeout=0.0, group_size=live_clusters)

    def start_round(
        self, round_id: int, fingerprint: dict, attempt: int = 0, plan: MatchmakingPlan | None = None
    ) -> InProcessRound:
        self.calls += 1
        return InProcessRound(self, round_id, fingerprint, attempt)

    def genesis_entry(self) -> dict | None:
        return None  # (no DHT mirror in process)

    def membership(self) -> Membership:
        """What the galaxy's records would say: each serving cluster's outer step (``steps``, read off its
        served state) and its averager, by galaxy rank (``sources``), when the galaxy serves state. Each
        cluster's state is read once (a snapshot copies its θ_outer: benches read this every round)."""
        galaxy = self.galaxy
        members = galaxy.members()
        served = {
            rank: other.get_state()[0] for rank, other in members.items() if other.get_state is not None
        }
        serving = [rank for rank in served if galaxy.serve_state and rank not in galaxy.departed]
        return Membership(
            departed=frozenset(self.galaxy.departed),
            lead=self.galaxy.lead,
            lead_work=self.galaxy.lead_work,
            works={rank: _work(metadata) for rank, metadata in served.items()},
            silent=frozenset(self.galaxy.silent),
            silent_seconds=dict(self.galaxy.silent_seconds),
            lead_inner_step=self.galaxy.lead_progress[0],
            lead_seen_seconds=self.galaxy.lead_progress[1],
            steps={rank: int(served[rank]["outer_step"]) for rank in serving},
            sources={rank: str(rank) for rank in serving},
            reported={rank: self._record(rank, other, served.get(rank)) for rank, other in members.items()},
            step_seconds=dict(galaxy.step_seconds),
            ages=dict(galaxy.ages),
        )

    def _record(
        self, rank: int, other: InProcessAverager, metadata: dict | None
    ) -> tuple[int, str | None, bool]:
        """What cluster ``rank``'s status record would say (``Membership.reported``): its outer step and
        hash, read off its served ``metadata`` (a cluster here is one rank: its shard's hash is the model's),
        and whether it still trains. Why not "unknown": a cluster at its last round waits for those behind it,
        and every unknown one looked behind (each finished unit-test galaxy waited the whole final check,
        15 s)."""
        training = rank not in self.galaxy.departed and not other.finished
        if metadata is None:
            return -1, None, training
        shard_hash = metadata.get("shard_hash")
        return int(metadata["outer_step"]), shard_hash and combine_hashes([shard_hash]), training

    def serve_state(self, get_state) -> None:
        self.get_state = get_state

    def download_state(self, timeout: float, source: str | None = None, holders: Sequence[str] | None = None):
        """``source``'s state, as it serves it now (``holders`` change nothing in process: the same bytes)."""
        if not self.galaxy.serve_state:
            return None
        for rank, other in sorted(self.galaxy.members().items()):
            if rank != self.rank and other.get_state is not None and source in (None, str(rank)):
                metadata, tensors = other.get_state()
                return metadata, [tensor.clone() for tensor in tensors]
        return None

    def shutdown(self, finished: bool = False) -> None:
        self.finished = finished


def _work(served: dict) -> int:
    """The committed work of a served state's chain (its last entry's), as its status record would say."""
    tail = served.get("ledger") or []
    return int(tail[-1].get("work") or 0) if tail else 0
