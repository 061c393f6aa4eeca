"""What our averager process changes in hivemind's matchmaking, beside the round's key and sizes that
``CanonicalAverager.set_round`` sets: how often a looking shard reads the DHT, and when a group below the
round's floor may close after all."""

from __future__ import annotations

import asyncio
import time

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking

GROUP_POLL_SECONDS = 0.2  # a shard looking for a group reads its group key from the DHT at most this often
LEADER_REFRESH_SECONDS = 1.0  # ... and at least this often, while it looks (see ``refresh_leaders``)


class PacedGroupKeyManager(GroupKeyManager):
    """hivemind's group key manager, reading who is looking for a group at most every
    :data:`GROUP_POLL_SECONDS`.

    hivemind's matchmaking asks for a new read as soon as the last one found no leader to join, so a shard
    that waits for a group (for a slower cluster, or alone until its deadline) reads the DHT back to back:
    ~40 reads a second on loopback, each a round trip through the DHT's process, its daemon and the DHT
    peers: up to a core per waiting rank (alone: 6.0 CPU-s in 6 s). Paced, a waiting cluster costs its host
    next to nothing, and a leader that appears is still seen within a fraction of
    ``--hv.matchmaking-time``."""

    _last_read = float("-inf")

    async def get_averagers(self, group_key, only_active):
        wait = self._last_read + GROUP_POLL_SECONDS - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_read = time.monotonic()
        return await super().get_averagers(group_key, only_active)


async def lower_floor_later(matchmaking: Matchmaking, group_bits: str, after: float) -> None:
    """After ``after`` seconds still in the round of ``group_bits``, let a group of two close
    (``min_group_size``): the floor was a majority of the roster while more than half of it was alive by the
    records (``outer/quorum.smallest_group``), and records that have expired since said so of a side of a
    real split. hivemind reads ``min_group_size`` each time a leader's window ends, so the next window
    closes the pair."""
    await asyncio.sleep(after)
    if matchmaking.group_key_manager.group_bits == group_bits:
        matchmaking.min_group_size = 2


async def refresh_leaders(matchmaking: Matchmaking, group_bits: str) -> None:
    """While this shard looks for a group in the round of ``group_bits``, have hivemind re-read who else is
    looking at least every :data:`LEADER_REFRESH_SECONDS`.

    Why: hivemind re-reads the key only while the best leader it knows of might still be beaten by one it
    has not seen; it assumes every peer declares the same window, so that a peer arriving later declares a
    later expiry and can never be a better leader. Ours do not: a cluster that sees another one behind waits
    the ceiling (``MatchmakingPlan``, ``coming``), one that does not declares the usual window. A peer that
    came first with the long window then never heard of the later ones with shorter windows, whose
    expiries made them the better leaders: on loopback, two such peers ended every round alone after 30 s
    while the two others closed a pair after the floor came down (a galaxy of four, floor 3), and the `home`
    soak of 2026-12-04 (seed 5) held rounds for a minute that way, all four clusters connected. Re-read,
    the early peer finds the better leader and joins it with its followers: the four form one group as the
    last one arrives."""
    while matchmaking.group_key_manager.group_bits == group_bits:
        await asyncio.sleep(LEADER_REFRESH_SECONDS)
        if matchmaking.is_looking_for_group:
            matchmaking.potential_leaders.update_triggered.set()
