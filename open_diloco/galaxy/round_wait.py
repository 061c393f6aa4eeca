"""Waiting for one round of one shard's averager (:class:`HivemindRound`), and the round's identity on the
wire.

The round and the attempt are in hivemind's matchmaking key (:func:`round_key_bits`), so peers of other rounds
or attempts never meet. While a shard still looks for a group it reads the membership records every
:data:`MEMBERSHIP_POLL_SECONDS` and stops early when nobody will come: every other cluster left, the galaxy
already applied the round (*overtaken*), or every other live cluster started a later attempt (*moved on*)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from hivemind.averaging.control import AveragingStage, StepControl

from open_diloco.errors import DuplicateGalaxyRank, RoundFailed
from open_diloco.galaxy.canonical_averager import GRACE_SECONDS
from open_diloco.outer.matchmaking import MatchmakingClock, MatchmakingPlan
from open_diloco.outer.policy import out_of_cohort
from open_diloco.outer.protocols import Membership, RoundReport

_NO_GROUP = "could not find a group"  # hivemind 1.1.12's message when matchmaking reaches its deadline alone
MEMBERSHIP_POLL_SECONDS = 2.0  # how often a peer looking for a group checks whether anyone is left to find


class RoundOwner(Protocol):
    """What a round needs of the shard's averager that started it (``galaxy/averager.py``'s
    ``HivemindAverager``): who it is, how long a round may take, the membership it polls, the reports of a
    round without others, and where a round's group and matchmaking are remembered."""

    galaxy_rank: int
    galaxy_size: int
    peer_id: str
    averaging_timeout: float
    clock: MatchmakingClock
    last_group_round_end: float | None
    last_group: tuple[int, frozenset[int]]

    def membership(self) -> Membership: ...

    def alone_in(self, view: Membership) -> bool: ...

    def lonely_report(
        self, metadata: dict[str, Any], start: float, overtaken: bool = False, moved_on: bool = False
    ) -> RoundReport: ...


class HivemindRound:
    """A hivemind round in flight (see ``PendingRound``)."""

    def __init__(
        self,
        owner: RoundOwner,
        control: StepControl | None,
        metadata: dict[str, Any],
        start: float,
        plan: MatchmakingPlan | None = None,
    ):
        self.owner, self.control, self.metadata, self.start = owner, control, metadata, start
        self.plan = plan
        """The round's matchmaking (``outer/matchmaking.py``); a whole round's matchmaking seconds go back to
        the owner's clock."""

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
                fix = (
                    "two clusters of an elastic galaxy share an id (or, rarely, its rank): give one a new "
                    "--hv.cluster-id, or delete its --ckpt.path/cluster_id"
                    if owner.elastic
                    else f"give every cluster a unique --hv.world-rank in 0..{owner.galaxy_size - 1}"
                )
                raise DuplicateGalaxyRank(f"peer {peer} also claims galaxy rank {rank}; {fix}")
            peers[rank] = data
        owner.last_group_round_end = time.monotonic()
        matchmaking_seconds = max(0.0, result["grouped_at"] - self.start)
        if self.plan is not None and not self.plan.waits_for_behind:
            owner.clock.observe_round(matchmaking_seconds, whole=len(peers) >= self.plan.group_size)
        owner.last_group = (round_id, frozenset(peers) - {owner.galaxy_rank})
        stale_peers = out_of_cohort(result["gathered"])
        stale = sorted(result["gathered"][peer].get("galaxy_rank", -1) for peer in stale_peers)
        rejected = sorted(
            {
                result["gathered"][peer].get("galaxy_rank", -1)
                for peer in result["rejected"]
                if peer in result["gathered"] and peer not in stale_peers
            }
        )
        return RoundReport(
            group_size=len(result["gathered"]),
            complete=result["failed_size"] == 0 and result["banned_senders"] == 0,
            peers=peers,
            seconds=time.monotonic() - self.start,
            matchmaking_seconds=matchmaking_seconds,
            exchange_seconds=result["done_at"] - result["grouped_at"],
            matchmaking_window_seconds=self.plan.window if self.plan is not None else None,
            matchmaking_min_group=self.plan.min_group if self.plan is not None else None,
            round_trip_seconds=owner.clock.round_trip(),
            bytes_sent=result["bytes_sent"],
            bytes_received=result["bytes_received"],
            rejected=rejected,
            stale=stale,
        )

    def _result_unless_left_alone(self) -> dict[str, Any]:
        """The round's result, within the averaging timeout. While this peer still looks for a group, the
        membership records can say nobody will come, and the round would otherwise wait out the whole timeout:
        :class:`_LeftAlone` when every other cluster left (stopped or crashed after this round began);
        :class:`_Overtaken` when the galaxy already applied this round without us (see
        ``RoundReport.overtaken``)."""
        owner, control = self.owner, self.control
        deadline = self.start + owner.averaging_timeout + GRACE_SECONDS
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
        return everyone_moved_on(
            view, self.owner.galaxy_rank, self.metadata["round_id"] + 1, self.metadata.get("attempt", 0)
        )


def everyone_moved_on(view: Membership, galaxy_rank: int, round_no: int, attempt: int) -> bool:
    """Every other live cluster with a record of its attempts started a later attempt of round ``round_no``
    (or a later round) than ``attempt``: nobody will come to this one. A cluster still at an earlier round may
    yet come."""
    others = [started for rank, started in view.attempts.items() if rank != galaxy_rank]
    return bool(others) and all(started > (round_no, attempt) for started in others)


class _LeftAlone(Exception):
    """Every other cluster left while this peer looked for a group."""


class _MovedOn(Exception):
    """Every other cluster left this attempt of the round while this peer looked for a group."""


class _Overtaken(Exception):
    """The galaxy applied this round without this peer while it looked for a group."""


ROUND_BITS, ATTEMPT_BITS = 40, 8


def round_key_bits(round_id: int, attempt: int) -> str:
    """hivemind's group bits for (round, attempt): its matchmaking key is ``{prefix}.0b{bits}``, so only peers
    of the same round and attempt can ever form a group. Attempts past 255 wrap (a round is never retried that
    often: ``--hv.max-retries``)."""
    return format(round_id % (1 << ROUND_BITS), f"0{ROUND_BITS}b") + format(
        attempt % (1 << ATTEMPT_BITS), f"0{ATTEMPT_BITS}b"
    )
